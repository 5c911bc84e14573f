"""accumulated_attention: the Pallas GPU kernels (interpret mode on CPU) against the pure-JAX reference and NumPy
(odd lengths, padding holding NaN/inf, an empty and a 1-token sequence, GQA groups of 1-4, blocks of queries and
keys of different sizes, bf16 and float32, with and without ``v``); ``impl=None`` is the XLA path on CPU; bad
blocks raise. The compiled kernels are checked on a GPU by tests/accelerator/test_kernels.py with these helpers."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas.accumulated_attention as aa

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kvjax"))
from test_causal_attention import np_accumulated, np_causal  # noqa: E402

#: (lengths, Hq, Hkv, T, D, block_q, block_k)
KERNEL_CASES = [
    ((45, 30, 1, 0), 4, 2, 45, 16, 16, 16),  # ragged T, empty and 1-token sequences, GQA 2
    ((70, 33), 6, 2, 70, 16, 32, 16),  # GQA 3, query blocks larger than key blocks
    ((64, 40), 2, 2, 64, 32, 16, 32),  # MHA, key blocks larger than query blocks, T a multiple of both
    ((50,), 4, 1, 50, 16, 16, 16),  # one KV head for 4 query heads
]
IDS = ["gqa2-ragged", "gqa3-bq>bk", "mha-bk>bq", "gqa4"]


def inputs(lengths, hq, hkv, t, d, dtype=jnp.float32, seed=0):
    """q, k, v in ``dtype`` with NaN / inf / NaN past each length, and float32 NumPy copies with zeros there."""
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((len(lengths), h, t, d)).astype(np.float32) for h in (hq, hkv, hkv)]
    xs = [np.array(jnp.asarray(x, dtype), np.float32) for x in xs]
    clean = [x.copy() for x in xs]
    for b, n in enumerate(lengths):
        for x, bad in zip(xs, (np.nan, np.inf, np.nan)):
            x[b, :, n:] = bad
        for x in clean:
            x[b, :, n:] = 0
    return [jnp.asarray(x, dtype) for x in xs], clean


def check_kernel(impl, case, *, dtype=jnp.float32, with_v=True, interpret=True, blocks=True, numpy=True, **kw):
    """``impl`` against the reference (and NumPy where ``numpy``): scores within 1e-5 (float32 accumulation of the
    same ``exp``), outputs within 1e-5 (float32) / 2e-2 (bf16: ``p`` rounded to bf16 before ``P v`` in both, from
    different running maxima); padded rows 0, nothing NaN. blocks: the case's block sizes (else the defaults)."""
    lengths, hq, hkv, t, d, bq, bk = case
    (q, k, v), (cq, ck, cv) = inputs(lengths, hq, hkv, t, d, dtype, seed=t + d)
    n = jnp.asarray(lengths, jnp.int32)
    opts = dict(kw, **({"block_q": bq, "block_k": bk} if blocks else {}))
    fn = jax.jit(lambda q, k, v, n: aa.accumulated_attention(q, k, v, n, impl=impl, interpret=interpret, **opts))
    out, acc = fn(q, k, v if with_v else None, n)
    ref_out, ref_acc = jax.jit(lambda *a: aa.accumulated_attention_reference(*a))(q, k, v if with_v else None, n)
    acc = np.asarray(acc)
    assert acc.shape == (len(lengths), hkv, t) and acc.dtype == np.float32 and np.isfinite(acc).all()
    np.testing.assert_allclose(acc, np.asarray(ref_acc), atol=1e-5, rtol=1e-4)
    if numpy:
        np.testing.assert_allclose(acc, np_accumulated(cq, ck, np.asarray(lengths)), atol=1e-5, rtol=1e-4)
    if not with_v:
        assert out is None
        return
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(out, np.asarray(ref_out, np.float32), atol=tol, rtol=tol)
    if numpy:
        np.testing.assert_allclose(out, np_causal(cq, ck, cv, np.asarray(lengths), None), atol=tol, rtol=tol)
    for b, m in enumerate(lengths):
        assert not out[b, :, m:].any() and not acc[b, :, m:].any()


@pytest.mark.parametrize("case", KERNEL_CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_pallas_gpu_interpret_matches_reference(case, dtype):
    check_kernel("pallas_gpu", case, dtype=dtype)


@pytest.mark.parametrize("case", KERNEL_CASES[:2], ids=IDS[:2])
def test_pallas_gpu_scores_only(case):
    check_kernel("pallas_gpu", case, with_v=False)


def test_reference_default_impl_and_bad_blocks(monkeypatch):
    monkeypatch.delenv(aa.ENV_IMPL, raising=False)
    assert aa.default_impl() == "xla"  # CPU
    case = KERNEL_CASES[0]
    check_kernel(None, case, blocks=False)  # impl=None: the reference
    (q, k, v), _ = inputs(*case[:5])
    n = jnp.asarray(case[0], jnp.int32)
    with pytest.raises(ValueError, match="power-of-two tiles of at least 16: block_q=24"):
        aa.accumulated_attention(q, k, v, n, impl="pallas_gpu", interpret=True, block_q=24)
    with pytest.raises(ValueError, match="lengths has shape"):
        aa.accumulated_attention(q, k, v, n[:1], impl="xla")
    monkeypatch.setenv(aa.ENV_IMPL, "pallas_tpu")
    with pytest.raises(ValueError, match="KVJAX_ACCUMULATED_ATTENTION_IMPL='pallas_tpu' must be one of"):
        aa.default_impl()


def test_columns_block_fits_shared_memory():
    """The column kernel's query block at Llama-3.1-8B's heads in bf16: 128 rows asked 273 KiB of shared memory on an
    H200 (limit 227 KiB); it takes 64. SmolLM2's heads and float32's blocks, which ran there, are kept."""
    from kernels_pallas.accumulated_attention.pallas_gpu import COLUMNS_SMEM, columns_block_q

    assert columns_block_q(128, 64, 4, 128, 2, 2) == 64
    assert columns_block_q(128, 64, 3, 64, 2, 2) == 128
    assert columns_block_q(64, 32, 4, 128, 4, 1) == 64
    for g, d, size, stages in [(4, 128, 2, 2), (8, 128, 2, 2), (4, 256, 4, 2)]:
        bq = columns_block_q(128, 64, g, d, size, stages)
        assert bq == 16 or (g * bq * stages + 64) * d * size <= COLUMNS_SMEM
