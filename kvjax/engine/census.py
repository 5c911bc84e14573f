"""Loop census of a traced program: the loops a GPU runs as host round trips.

On a GPU, XLA runs a ``while`` loop (``lax.while_loop``, a ``fori_loop`` with traced bounds) by copying its predicate
to the host before every trip and launching the body's kernels after it, and a ``scan`` the same way once per trip
(DESIGN principle 15). :func:`loop_census` traces a function (abstract inputs: nothing is allocated) and counts,
through every nested jaxpr (``jit``, ``cond`` branches, loop bodies; not inside a ``pallas_call``, whose loops run
on the device):

- ``while_loops``: ``while`` equations (their trips are data-dependent: each is at least one round trip);
- ``scan_trips``: the summed static lengths of ``scan`` equations, a nested scan's times its parents';
- ``conds``: ``cond`` equations (one predicate read each);
- ``callbacks``: host callbacks (``pure_callback``, ``io_callback``, ``debug_callback``).

>>> census = loop_census(jax.jit(method.prefill), state, layer, q, k, v, lengths)   # ShapeDtypeStructs welcome
>>> census.while_loops, census.scan_trips
"""

from __future__ import annotations

import dataclasses

import jax

_CALLBACKS = ("pure_callback", "io_callback", "debug_callback")


@dataclasses.dataclass(frozen=True)
class Census:
    while_loops: int = 0
    scan_trips: int = 0
    conds: int = 0
    callbacks: int = 0

    def __add__(self, other: "Census") -> "Census":
        return Census(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def times(self, n: int) -> "Census":
        return Census(*(a * n for a in dataclasses.astuple(self)))


def _subjaxprs(params: dict):
    for v in params.values():
        for x in v if isinstance(v, (list, tuple)) else (v,):
            if hasattr(x, "eqns"):
                yield x
            elif hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
                yield x.jaxpr


def census_of_jaxpr(jaxpr) -> Census:
    """:class:`Census` of a (closed) jaxpr, nested jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = Census()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "pallas_call":
            continue
        inner = Census()
        for sub in _subjaxprs(eqn.params):
            inner = inner + census_of_jaxpr(sub)
        if name == "scan":
            n = int(eqn.params["length"])
            total = total + Census(scan_trips=n) + inner.times(n)
        elif name == "while":
            total = total + Census(while_loops=1) + inner
        elif name == "cond":
            total = total + Census(conds=1) + inner
        else:
            total = total + inner + Census(callbacks=int(name in _CALLBACKS))
    return total


def loop_census(fn, *args, **kwargs) -> Census:
    """:class:`Census` of ``fn(*args, **kwargs)`` traced with ``jax.make_jaxpr`` (arrays or ShapeDtypeStructs)."""
    return census_of_jaxpr(jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args))
