"""Prefill attention (``kvjax.model.prefill_attention``): every implementation against the pure-JAX ``chunked``
reference, the implementation choice, and memory linear in T for the engine's prefill with every method.

- ``splash`` (jax's Pallas TPU kernel) runs here in interpret mode: SmolLM2's heads (9 query / 3 KV, head_dim 64)
  and Llama-3.1-8B's (32 / 8, 128), T = 300 (not a multiple of the 128-token block: padded to 384, three blocks),
  two sequences of lengths 300 and 157, with and without a 100-token sliding window.
- ``cudnn``: the cuDNN kernel cannot run, or be exported, from a CPU jaxlib (tests/kernels_pallas/test_export.py
  checks the reason). What can go wrong on our side is the argument mapping (layout ``[B, T, N, H]``, lengths,
  window, GQA), so ``_cudnn_call`` runs here with ``implementation="xla"``; the kernel itself is checked on a GPU
  (tests/accelerator/test_prefill.py).
- Tolerances: float32 within 2e-5 of the reference (only the summation order differs; the conftest sets matmuls
  to ``HIGHEST``); bfloat16 within 2e-2 absolute of the float32 reference computed from the same bf16-rounded
  inputs: the outputs reach 3.5 in magnitude, where one bf16 ulp is 1.6e-2, and the kernels also round
  ``q/sqrt(D)`` and the probabilities to bf16 before the matmuls (measured: splash 1.0e-2, the cuDNN mapping under
  ``xla`` 1.3e-2, ``chunked`` itself in bf16 1.0e-2). Only rows of real queries are compared; padded rows must be
  finite.
- Memory: ``core.prefill`` of a one-layer random model compiled for abstract inputs (``jax.ShapeDtypeStruct``)
  at T = 8192 and 16384: XLA's temp bytes grow by less than 2.5x for 2x T (a ``[T, T]`` score matrix would give
  about 4x). ``full`` and ``snapkv`` (observation-window scoring) in the default run, every method with
  ``--runslow``. Measured (CPU, budget 0.1): ratios 1.47 to 1.61 for all eleven methods.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.engine import core
from kvjax import engine, methods
from kvjax import model as M
from kvjax.model import prefill_attention as P
from kvjax.config import ModelConfig
from kvjax.methods.base import Capacity
from methods_table import small_at_budget


HEADS = {"smollm2": (9, 3, 64), "llama31_8b": (32, 8, 128)}  # query heads, KV heads, head_dim
T, LENGTHS, WINDOW = 300, (300, 157), 100
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def inputs(heads, dtype, t=T, lengths=LENGTHS, seed=0):
    hq, hkv, d = HEADS[heads]
    r = np.random.default_rng(seed)
    b = len(lengths)
    q, k, v = (jnp.asarray(r.standard_normal(s), dtype) for s in ((b, hq, t, d), (b, hkv, t, d), (b, hkv, t, d)))
    return q, k, v, jnp.asarray(lengths, jnp.int32)


def check(out, q, k, v, n, window, dtype):
    """``out`` against ``chunked`` in float32 on the same inputs (chunk 128: three query chunks at T = 300)."""
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = np.asarray(P.prefill_attention(*f32, n, window, impl="chunked", chunk=128))
    out = np.asarray(out.astype(jnp.float32))
    assert out.shape == ref.shape and np.isfinite(out).all()
    real = (np.arange(q.shape[2])[None, :] < np.asarray(n)[:, None])[:, None, :, None]
    np.testing.assert_allclose(np.where(real, out, 0), np.where(real, ref, 0), atol=TOL[dtype], rtol=0)


def _splash_cases():
    """Every (heads, window, dtype); bfloat16 at Llama 3.1 8B's heads (31 s in interpret mode) in CI's second line
    (tests/extended.py): SmolLM2's heads check bfloat16's tolerance by default."""
    for dtype, name in ((jnp.float32, "f32"), (jnp.bfloat16, "bf16")):
        for window in (None, WINDOW):
            for heads in HEADS:
                ext = dtype == jnp.bfloat16 and heads == "llama31_8b"
                marks = pytest.mark.extended if ext else ()
                yield pytest.param(heads, window, dtype, marks=marks, id=f"{name}-{window}-{heads}")


@pytest.mark.parametrize("heads,window,dtype", list(_splash_cases()))
def test_splash_interpret_matches_chunked(heads, window, dtype):
    q, k, v, n = inputs(heads, dtype)
    out = jax.jit(
        functools.partial(P.prefill_attention, sliding_window=window, impl="splash", block_size=128, interpret=True)
    )(q, k, v, n)
    assert out.dtype == dtype
    check(out, q, k, v, n, window, dtype)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_cudnn_argument_mapping_with_xla(heads, window, dtype):
    """The cuDNN path's own code (``_cudnn_call``) with jax's ``xla`` implementation in place of the kernel."""
    q, k, v, n = inputs(heads, dtype)
    out = jax.jit(lambda q, k, v, n: P._cudnn_call(q, k, v, n, window, "xla"))(q, k, v, n)
    assert out.dtype == dtype
    check(out, q, k, v, n, window, dtype)


def test_chunked_matches_dense():
    """The reference itself: query/key chunks of 128 against the one-shot dense softmax (T = 300, window 100)."""
    q, k, v, n = inputs("smollm2", jnp.float32)
    for window in (None, WINDOW):
        dense = P.dense_attention(q, k, v, n, window)
        check(dense, q, k, v, n, window, jnp.float32)
    # model.causal_attention is the same entry point
    np.testing.assert_array_equal(
        np.asarray(M.causal_attention(q, k, v, n, WINDOW, 128, impl="chunked")),
        np.asarray(P.chunked_attention(q, k, v, n, WINDOW, 128)),
    )


def test_padded_rows_finite():
    """A zero-length and a one-token sequence: every row finite in every implementation (CPU-runnable)."""
    q, k, v, n = inputs("smollm2", jnp.bfloat16, t=130, lengths=(0, 1))
    outs = [
        P.prefill_attention(q, k, v, n, impl="chunked", chunk=64),
        P.splash_attention(q, k, v, n, block_size=128, interpret=True),
        P._cudnn_call(q, k, v, n, None, "xla"),
    ]
    for out in outs:
        assert np.isfinite(np.asarray(out.astype(jnp.float32))).all()
    # the one real query of sequence 1 sees only itself: its output is its value
    for out in outs:
        np.testing.assert_allclose(
            np.asarray(out[1, :, 0], np.float32), np.repeat(np.asarray(v[1, :, 0], np.float32), 3, axis=0), atol=1e-2
        )


@pytest.mark.parametrize("impl", ["splash", "cudnn_as_xla"])
def test_kernels_under_a_mesh(monkeypatch, impl):
    """Under the engine's mesh (2 x 4 of the conftest's 8 CPU devices, batch over ``data``, heads over ``model``)
    a kernel runs per device on its shard (``sharding.per_head``) and gives the reference's numbers; the cuDNN
    path is checked with ``_cudnn_call`` at ``implementation="xla"`` (``cudnn_attention`` swapped for it)."""
    from kvjax import sharding

    if impl == "cudnn_as_xla":
        monkeypatch.setattr(P, "cudnn_ineligible", lambda *a: None)
        monkeypatch.setattr(
            P, "cudnn_attention", lambda q, k, v, n, sliding_window: P._cudnn_call(q, k, v, n, sliding_window, "xla")
        )
    mesh = sharding.make_mesh({"data": 2, "model": 4})
    q, k, v, n = inputs("llama31_8b", jnp.float32, t=200, lengths=(200, 77))
    q, k, v, n = (sharding.put_batch(x, mesh) for x in (q, k, v, n))

    @jax.jit
    def run(q, k, v, n):
        with sharding.tracing(mesh):
            return P.prefill_attention(q, k, v, n, WINDOW, impl=impl.split("_")[0], block_size=128, interpret=True)

    text = run.lower(q, k, v, n).as_text()
    assert "shard_map" in text or "sdy.manual_computation" in text
    check(run(q, k, v, n), q, k, v, n, WINDOW, jnp.float32)


# ------------------------------------------------------------------------------------------ implementation choice


def test_default_impl_by_backend_and_env(monkeypatch):
    monkeypatch.delenv(P.ENV_IMPL, raising=False)
    assert jax.default_backend() == "cpu" and P.default_impl() == "chunked"
    for name in P.IMPLS:
        monkeypatch.setenv(P.ENV_IMPL, name)
        assert P.default_impl() == name
    monkeypatch.setenv(P.ENV_IMPL, "flash")
    with pytest.raises(ValueError, match="KVJAX_PREFILL_ATTENTION_IMPL='flash' must be one of"):
        P.default_impl()


def test_cudnn_eligibility_and_errors(monkeypatch):
    monkeypatch.delenv(P.ENV_IMPL, raising=False)
    q, k, v, n = inputs("smollm2", jnp.float32, t=8, lengths=(8, 5))
    assert not P.cudnn_eligible(q, k, v)
    assert P.cudnn_eligible(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
    assert P.cudnn_eligible(*(x.astype(jnp.float16) for x in (q, k, v)))
    wide = jnp.zeros((1, 2, 8, 512), jnp.bfloat16)
    assert "head_dim 512" in P.cudnn_ineligible(wide, wide, wide)
    odd = jnp.zeros((1, 2, 8, 60), jnp.bfloat16)
    assert "multiple of 8" in P.cudnn_ineligible(odd, odd, odd)
    with pytest.raises(ValueError, match=r"impl='cudnn'.*float16 or all bfloat16.*impl='chunked'"):
        P.prefill_attention(q, k, v, n, impl="cudnn")
    monkeypatch.setenv(P.ENV_IMPL, "cudnn")  # forced by the environment: as explicit as impl="cudnn"
    with pytest.raises(ValueError, match=r"KVJAX_PREFILL_ATTENTION_IMPL=cudnn: q, k, v have dtypes float32"):
        M.causal_attention(q, k, v, n)


def test_bad_arguments():
    q, k, v, n = inputs("smollm2", jnp.float32, t=8, lengths=(8, 5))
    with pytest.raises(ValueError, match="impl='flash' must be one of"):
        P.prefill_attention(q, k, v, n, impl="flash")
    with pytest.raises(ValueError, match="not a multiple of the 3 KV heads"):
        P.prefill_attention(q[:, :8], k, v, n)
    with pytest.raises(ValueError, match=r"lengths has shape \(3,\)"):
        P.prefill_attention(q, k, v, jnp.ones(3, jnp.int32))
    with pytest.raises(ValueError, match="sliding_window=0 must be a positive integer"):
        P.prefill_attention(q, k, v, n, 0)
    with pytest.raises(ValueError, match="block_size=100 must be a multiple of 128"):
        P.splash_attention(q, k, v, n, block_size=100, interpret=True)


# ------------------------------------------------------------------------------------------------ memory in T

CFG = ModelConfig("llama", 256, 64, 128, 1, 8, 2, 32, max_position_embeddings=1 << 17)
DEFAULT_METHODS = methods.cover("reuses_previous_layer")  # full and a window-scored prefill (every one: --runslow)


def prefill_temp_bytes(name: str, t: int, batch: int = 1) -> int:
    """XLA's temp bytes for ``core.prefill`` of CFG with ``name`` (budget 0.1) on a ``t``-token bucket,
    compiled for abstract inputs (nothing allocated)."""
    method = small_at_budget(name, 0.1)
    params = jax.eval_shape(lambda: M.random_params(CFG, jax.random.PRNGKey(0)))
    states = jax.eval_shape(lambda: engine.init_states(CFG, method, batch, Capacity(t, 16), jnp.float32))
    s = jax.ShapeDtypeStruct
    compiled = (
        jax.jit(functools.partial(core.prefill, CFG, method))
        .lower(params, s((batch, t), jnp.int32), s((batch,), jnp.int32), states)
        .compile()
    )
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in DEFAULT_METHODS else pytest.mark.slow) for n in methods.names()]
)
def test_prefill_memory_linear_in_t(name):
    small, large = prefill_temp_bytes(name, 8192), prefill_temp_bytes(name, 16384)
    assert large / small < 2.5, (
        f"{name}: prefill temp bytes {small} at T=8192 but {large} at T=16384 "
        f"(x{large / small:.2f} for 2x T): something is quadratic in T"
    )
