"""The proof that the method interface is narrow: Knorm (kvpress's KnormPress), written from docs/interface.md alone
in one file of at most 60 lines (``docs/examples/knorm.py``), joins through ``kvjax.methods.load_plugin`` with no
other file touched; it keeps what an independent NumPy reference keeps, passes the property tests every built-in
method passes (``test_properties.test_method_properties``: budget contract, bytes held, capacity, finite logits,
no retrace over 64 decode steps) and runs from the command line with ``--plugin``. The registry is restored after
each test, so the rest of the suite sees only the built-in methods."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cli, methods
from kvjax.config import ModelConfig
from kvjax.methods.base import CAPABILITIES, Capacity, Recalls, SlotMethod

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import test_properties  # noqa: E402
from tiny_models import save_tiny_llama  # noqa: E402

EXAMPLE = HERE.parents[1] / "docs" / "examples" / "knorm.py"


@pytest.fixture
def knorm():
    saved = dict(methods.REGISTRY)
    assert methods.load_plugin(str(EXAMPLE)) == ["knorm"]
    yield methods.REGISTRY["knorm"]
    methods.REGISTRY.clear()
    methods.REGISTRY.update(saved)


def test_one_small_file_registered_by_the_plugin_loader(knorm):
    assert len(EXAMPLE.read_text().splitlines()) <= 60
    assert issubclass(knorm, SlotMethod) and methods.get("knorm", budget=8) == knorm(budget=8)
    with pytest.raises(ValueError, match="already registered"):  # a built-in's name is not taken over
        methods.register(type("Full", (knorm,), {"name": "full", "__module__": "elsewhere"}))
    with pytest.raises(FileNotFoundError, match="missing.py"):
        methods.load_plugin("missing.py")


def test_at_budget_passes_the_budget_only_where_it_is_declared(knorm):
    """``methods.at_budget`` (a sweep at one budget): a method with a ``budget`` field gets it, ``full`` (none)
    comes back as itself; ``takes_budget`` is the field's presence, for the plugin too; an unknown name is the
    registry's error; a bad budget is the method's own (validated once, in ``__post_init__``)."""
    for n in methods.names():
        declared = "budget" in {f.name for f in dataclasses.fields(methods.REGISTRY[n])}
        assert methods.takes_budget(n) == declared == (methods.get(n).budget is not None), n
    assert methods.at_budget("full", 0.2) == methods.get("full")
    assert methods.at_budget("knorm", 8) == knorm(budget=8) and methods.at_budget("snapkv", 0.2).budget == 0.2
    assert methods.at_budget("quest", 0.3, page_size=4) == methods.get("quest", budget=0.3, page_size=4)
    with pytest.raises(ValueError, match="not registered"):
        methods.at_budget("nope", 0.2)
    with pytest.raises(ValueError, match="budget"):
        methods.at_budget("snapkv", 1.5)


def test_a_token_count_and_a_fraction_are_different_methods(knorm):
    """``budget=1`` (one token) and ``budget=1.0`` (the whole prompt) are equal in Python; as dataclass fields they
    made two equal, equally hashed methods, so ``jax.jit`` (static methods) ran the program compiled for one for the
    other (tests/kvjax/test_engine.py has the run). ``Method.__eq__``/``__hash__`` compare field types too, for the
    built-in classes (``eq=False``) and for a plugin's (set by ``register``)."""
    checked = []
    for n in [n for n in methods.names() if methods.takes_budget(n)]:
        try:
            one = methods.get(n, budget=1)
        except ValueError:  # a smallest legal count above 1 (Quest's page, ClusterKV's sinks): no collision
            continue
        whole = methods.get(n, budget=1.0)
        assert one != whole and len({one, whole}) == 2, n
        assert one == methods.get(n, budget=1) and hash(one) == hash(methods.get(n, budget=1)), n
        checked.append(n)
    assert "knorm" in checked and "snapkv" in checked
    plan = methods.get("snapkv", budget=1, full_layers=2)  # FullFirst compares its inner method the same way
    assert plan != methods.get("snapkv", budget=1.0, full_layers=2) and plan == methods.get("snapkv", 2, budget=1)


def test_cover_picks_a_method_by_what_it_declares(knorm):
    """``methods.cover``, by which the costly tests choose their default methods: each combination of the traits
    that occurs in the registry once, by its first method; a new method joins only with a new combination."""
    traits = ("recalls", "recompresses", "attends_prompt")
    key = {n: tuple(bool(getattr(methods.get(n), t)) for t in traits) for n in methods.names()}
    first = {}
    for n in methods.names():
        first.setdefault(key[n], n)
    assert methods.cover(*traits) == tuple(first.values())
    assert methods.cover(*traits) == ("full", "h2o", "chelsea", "pqcache") and "knorm" not in methods.cover(*traits)
    assert methods.cover("recompresses", any_true=True) == ("chelsea",)

    recall = {"selected_positions": lambda self, state, layer, q: None, "attended": lambda self, n, steps, ctx=None: 0}
    both = dataclasses.dataclass(frozen=True)(
        type("KnormBoth", (knorm, Recalls), {"name": "knorm_both", "recompresses": True, **recall})
    )
    methods.register(both)
    assert methods.cover(*traits)[-1] == "knorm_both"
    with pytest.raises(ValueError, match="recals"):
        methods.cover("recals")


def test_a_capability_is_a_type_and_its_flag_follows(knorm):
    """Each optional capability is a type whose abstract functions are the capability: a method that inherits one
    without implementing it cannot be built, its flag is derived from the type, and setting a flag instead is a
    TypeError when the class is created."""
    for flag, capability in CAPABILITIES.items():
        lacking = dataclasses.dataclass(frozen=True)(type(f"Lacks_{flag}", (knorm, capability), {}))
        assert getattr(lacking, flag) is True and getattr(knorm, flag) is False
        with pytest.raises(TypeError, match="abstract"):
            lacking(budget=0.5)
        with pytest.raises(TypeError, match=capability.__name__):
            type(f"Sets_{flag}", (knorm,), {flag: True})
    assert [n for n in methods.names() if methods.REGISTRY[n].recalls] == ["pqcache", "clusterkv", "quest"]
    assert all(isinstance(methods.get(n), Recalls) == methods.get(n).recalls for n in methods.names())


@pytest.mark.parametrize("budget", [5, 0.25])
def test_keeps_the_lowest_norm_keys(knorm, budget):
    """Against NumPy: per sequence and KV head, the ``P`` prompt positions of smallest ``||k||`` (``P`` = the budget
    in tokens, ``ceil(budget * n)`` for a fraction, at most ``n``), their K and V rows, nothing else."""
    cfg = ModelConfig("llama", 64, 32, 48, 1, 4, 2, 8, max_position_embeddings=64)
    r = np.random.default_rng(0)
    lengths = [24, 13, 3]
    q = r.standard_normal((3, 4, 24, 8)).astype(np.float32)
    k, v = (r.standard_normal((3, 2, 24, 8)).astype(np.float32) for _ in range(2))
    m = knorm(budget=budget)
    st = m.init(cfg, 3, Capacity(24, 2), 0, jnp.float32)
    st = jax.jit(m.prefill, static_argnums=1)(st, 0, q, k, v, jnp.asarray(lengths))
    for b, n in enumerate(lengths):
        keep = min(n, budget if isinstance(budget, int) else int(np.ceil(budget * n)))
        for h in range(2):
            want = np.sort(np.argsort(np.linalg.norm(k[b, h, :n], axis=-1))[:keep])
            pos = np.asarray(st.pos[b, h])
            live = pos >= 0
            np.testing.assert_array_equal(np.sort(pos[live]), want, err_msg=f"sequence {b}, head {h}")
            order = np.argsort(pos[live])
            np.testing.assert_array_equal(np.asarray(st.k[b, h])[live][order], k[b, h, want])
            np.testing.assert_array_equal(np.asarray(st.v[b, h])[live][order], v[b, h, want])


def test_passes_the_property_tests(knorm):
    test_properties.test_method_properties("knorm")


def test_runs_from_the_command_line(knorm, tmp_path, capsys):
    model = save_tiny_llama(tmp_path / "tiny")
    argv = ["generate", "--model", str(model), "--method", "knorm", "--budget", "0.5", "--max-new-tokens", "3"]
    assert cli.main(["--plugin", str(EXAMPLE), *argv, "--prompt", "the cat sat on the mat and looked at the dog"]) == 0
    assert "knorm" in capsys.readouterr().err
    assert cli.main(["--plugin", str(tmp_path / "missing.py"), *argv, "--prompt", "hi"]) == 2
    assert "missing.py" in capsys.readouterr().err
