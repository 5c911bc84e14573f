"""What only the tests need to know about a method, keyed by its registry name: a plugin brings none of it.

- ``SMALL_OPTIONS``: the options that make a method compress at test sizes (prompts of tens of tokens, two layers):
  its windows, chunks, pages and sinks shrunk. The property, budget-contract, sharding and accelerator tests build
  every registered method with them (:func:`small`); a method without an entry runs at its defaults.
- ``SMALL_VARIANTS``: static options the property tests vary over the small options (each value compiles, so few);
  the first is the one their fixed example runs. Default: the options as they are, ``({},)``.
- ``XLA_BYTES_BAND``: XLA's ``cost_analysis()["bytes accessed"]`` of one compiled decode step over what
  ``bytes_read_per_step`` declares, on tests/kvjax/test_measured.py's tiny model (prompts that fill the bucket): the
  band it must fall in. XLA counts an in-place scatter as the whole buffer read and written, and loops and branches
  whole; docs/interface.md#measured-against-xla says what each method's band holds. Default ``(3.0, 5.0)``, a slot
  cache's.
"""

from __future__ import annotations

SMALL_OPTIONS: dict[str, dict] = {
    "chelsea": dict(n_sink=2, n_recent=4, chunk=8, interval=4),  # 2 sinks, 4 recent, chunks of 8, every 4 steps
    # 4 bits: at 3 a retrieval near-tie flips under a 1e-6 weight perturbation in the sharding tests
    "pqcache": dict(sink=2, bits=4),
    "clusterkv": dict(sink=2, tokens_per_cluster=4, window=2, window_clusters=1, n_full=1),  # one full layer of two
    "quest": dict(page_size=4, n_full=0),  # pages of 4, both layers of two compressed
    "less": dict(hidden=16),  # a 16-wide kernel hidden layer
}

SMALL_VARIANTS: dict[str, tuple[dict, ...]] = {
    "chunkkv": ({"reuse": 2}, {}, {"chunk_size": 3}),  # index reuse, a chunk of 3
    "less": ({"policy": "lambda"}, {"policy": "h2o"}),  # both sparse policies
}

DEFAULT_XLA_BYTES_BAND = (3.0, 5.0)
XLA_BYTES_BAND: dict[str, tuple[float, float]] = {
    "less": (2.5, 4.5),
    "chelsea": (13.0, 21.0),
    "quest": (9.0, 14.0),
    "pqcache": (9.0, 15.0),
    "clusterkv": (26.0, 40.0),
}


def small_options(name: str) -> dict:
    """``name``'s options at test sizes (``SMALL_OPTIONS``; none for a method without an entry)."""
    return dict(SMALL_OPTIONS.get(name, {}))


def small_variants(name: str) -> tuple[dict, ...]:
    """The static options the property tests vary for ``name`` (``SMALL_VARIANTS``), the first the fixed example's."""
    return SMALL_VARIANTS.get(name, ({},))


def xla_bytes_band(name: str) -> tuple[float, float]:
    """The band XLA's bytes accessed by ``name``'s decode step must fall in, over its ``bytes_read_per_step``."""
    return XLA_BYTES_BAND.get(name, DEFAULT_XLA_BYTES_BAND)


def own_kernels(method) -> tuple[str, ...]:
    """The method's own Pallas kernels (its ``step_kernels`` besides the decode attention): set by its ``impl``."""
    return tuple(k for k in method.step_kernels if k != "decode_attention")


def small(name: str, **options):
    """``methods.get(name, ...)`` at test sizes: :func:`small_options`, then ``options`` over them."""
    from kvjax import methods  # here, not at import: importing this table does not start jax

    if name not in methods.REGISTRY:
        methods.get(name)  # the unknown-name error
    return methods.get(name, **{**small_options(name), **options})


def small_at_budget(name: str, budget, **options):
    """``methods.at_budget(name, budget, ...)`` at test sizes: the budget passed only to a method that declares one
    (``methods.takes_budget``), the small options under ``options``."""
    from kvjax import methods

    return small(name, **({"budget": budget} if methods.takes_budget(name) else {}), **options)
