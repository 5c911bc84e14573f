"""The prefill census (DESIGN principle 15): each registered method's one-layer prefill traced for a GPU
at 32k tokens x batch 8, bfloat16, Llama-3.1-8B attention shapes (abstract inputs: nothing allocated; the backend
reads as a GPU, so the accelerator paths and the verified kernels are traced), with its while loops, scan trips,
conds and host callbacks counted (:func:`kvjax.engine.census.loop_census`) against the bound here. Zero unless the
algorithm itself iterates; where not, the bound says why. A method without a declared bound fails: declare one."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import pytest

from kvjax import methods
from kvjax.engine.census import Census, loop_census
from kvjax.methods.base import Capacity

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from roofline_measure import abstract_state, attention_config  # noqa: E402

#: method -> (the census at most, why it is not zero)
BOUNDS = {
    "full": (Census(), ""),
    "streaming_llm": (Census(), ""),
    "snapkv": (Census(), ""),
    "pyramidkv": (Census(), ""),
    "chunkkv": (Census(), ""),
    "quest": (Census(), ""),
    "pqcache": (Census(scan_trips=10), "the codebook K-means: 10 Lloyd iterations (a static fori_loop)"),
    "clusterkv": (
        Census(while_loops=1, scan_trips=6),
        "the K-means runs to convergence (at most `iters` = 20 updates: one while loop, a host round trip per "
        "iteration on a GPU); each assignment and update goes in row blocks of at most 2 GiB (2 at these shapes)",
    ),
    "chelsea": (
        Census(while_loops=4),
        "Alg. 1's merge rounds: one while loop per level of the round plan, each round halving at most (8 rounds "
        "at budget 0.2)",
    ),
    "h2o": (
        Census(while_loops=8),
        "the accumulated scores' XLA path (until its Pallas kernels are verified: none then): 8 query bands, each a "
        "loop over tiles of at most 1 GiB (582 trips in all here; the CPU path's tiles made 33,280)",
    ),
    "less": (Census(while_loops=8, scan_trips=16), "H2O's scores, and the fold of the evicted tokens in 16 blocks"),
}


@pytest.fixture
def as_gpu(monkeypatch):
    from kernels_pallas import impl_choice

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(impl_choice, "backend", lambda: "gpu")
    yield
    jax.clear_caches()  # nothing traced as a GPU is reused by a later test


def prefill_census(name: str, n: int = 32768, batch: int = 8, layer: int = 2) -> Census:
    cfg = attention_config()
    m = methods.at_budget(name, 0.2)
    own = m.at(layer)
    dt = jnp.bfloat16
    state = abstract_state(cfg, m, batch, Capacity(n, 17), layer, dt)
    q = jax.ShapeDtypeStruct((batch, cfg.num_heads, n, cfg.head_dim), dt)
    k = jax.ShapeDtypeStruct((batch, cfg.num_kv_heads, n, cfg.head_dim), dt)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    kw = {"previous": None} if own.reuses_previous_layer else {}
    run = own.prefill_attend if own.attends_prompt else own.prefill
    return loop_census(
        lambda st, q, k, v, ln: run(st, layer=layer, q=q, k=k, v=v, lengths=ln, **kw), state, q, k, k, lengths
    )


@pytest.mark.parametrize("name", sorted(methods.REGISTRY))
def test_prefill_census_within_its_bound(as_gpu, name):
    assert name in BOUNDS, f"{name}: declare its prefill census bound (and why it is not zero) in BOUNDS"
    bound, why = BOUNDS[name]
    got = prefill_census(name)
    assert all(g <= b for g, b in zip(got.__dict__.values(), bound.__dict__.values())), (name, got, bound, why)
    assert got.callbacks == 0
