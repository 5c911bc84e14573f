"""Every Pallas kernel compiled on the device (``pallas_gpu`` on a GPU, ``pallas_tpu`` on a TPU; not interpret
mode) against its pure-JAX reference (``kernels_pallas/<kernel>/reference.py``).

Runs only on a GPU/TPU backend: ``JAX_PLATFORMS=cuda python3 -m pytest tests/accelerator -m accelerator``
(``tpu`` on a TPU; tests/conftest.py). The cases are the interpret-mode tests' (tests/kernels_pallas: their
``check_*`` helpers and case lists, run here with ``interpret=False``; TPU-illegal tiles left out on a TPU), plus
SmolLM2's and Llama-3.1-8B's heads (9 / 3 and 32 / 8 heads, head_dim 64 and 128) in bf16 and float32 with odd
buffer lengths, per-sequence lengths and ``-1``-padded block lists with repeats.

Tolerances: float32 partials within 1e-4 (the kernels' float32 dots run at ``HIGHEST``, so only the summation
order differs); bf16 inputs: ``m`` and ``l`` within 1e-3 and the normalised output within 2e-2 (``p`` is rounded
to bf16 before ``p @ v``, in the kernels and in the reference alike). The PQ lookup within 1e-5, chunked
similarity and K-means as in their interpret tests (exact indices except at float64-checked near-ties).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.decode_attention import decode_attention_reference, normalise

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels_pallas"))
import test_accumulated_attention as taa  # noqa: E402
import test_chunked_similarity as tcs  # noqa: E402
import test_cosine_kmeans as tck  # noqa: E402
import test_decode_attention as tda  # noqa: E402
import test_export as tex  # noqa: E402
import test_pq_lookup as tpq  # noqa: E402

pytestmark = pytest.mark.accelerator

INTERPRET = os.environ.get("KVJAX_ACCELERATOR_DRY_RUN") == "1"  # on CPU: the same tests in interpret mode
IMPL = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(jax.default_backend(), "pallas_tpu")
DTYPES = [jnp.bfloat16, jnp.float32]


def tpu_legal(block):
    """On TPU a tile of the token axis must be a multiple of 128 (or the whole axis, None)."""
    return IMPL != "pallas_tpu" or block is None or block % 128 == 0


# ---------------------------------------------------------------------------------------------- decode attention


@pytest.mark.parametrize("case", tda.CASES)
def test_decode_attention_cases(case):
    tda.check_against_reference(IMPL, *tda._case(case), interpret=INTERPRET, tol=1e-4)


def test_decode_attention_bf16():
    tda.check_bf16(IMPL, interpret=INTERPRET)


def model_inputs(heads, dtype, with_mask: bool, seed=0):
    """q, k, v at ``heads`` (test_export.HEADS), 2 sequences in a 1087-slot buffer, lengths (1087, 531), and
    per-(b, h) lists of 6 blocks of 128 with -1 pads and repeats (with_mask: also a valid mask and a bias)."""
    hq, hkv, d = tex.HEADS[heads]
    b, s, nb = 2, 1087, 9
    r = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(r.standard_normal(shape), dtype) for shape in ((b, hq, d), (b, hkv, s, d), (b, hkv, s, d)))
    kw = dict(lengths=jnp.array([s, 531], jnp.int32))
    if with_mask:
        blocks = r.integers(-1, nb, (b, hkv, 6))
        blocks[:, :, -1] = blocks[:, :, 0]  # a repeat
        kw.update(
            valid=jnp.asarray(r.random((b, hkv, s)) < 0.9),
            bias=jnp.asarray(np.log(r.integers(1, 9, (b, hkv, s))), jnp.float32),
            block_indices=jnp.asarray(blocks, jnp.int32),
        )
    return q, k, v, kw


@pytest.mark.parametrize("heads", tex.HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_mask", [False, True], ids=["lengths", "mask_bias_blocks"])
def test_decode_attention_model_shapes(heads, dtype, with_mask):
    q, k, v, kw = model_inputs(heads, dtype, with_mask)
    if dtype == jnp.float32:
        tda.check_against_reference(IMPL, q, k, v, kw, interpret=INTERPRET, tol=1e-4)
        return
    o, m, l = jax.jit(lambda q, k, v, kw: tda.decode_attention(q, k, v, **kw, impl=IMPL, interpret=INTERPRET))(
        q, k, v, kw
    )
    o_r, m_r, l_r = decode_attention_reference(q, k, v, **kw)
    np.testing.assert_allclose(np.asarray(m), np.asarray(m_r), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(np.asarray(l), np.asarray(l_r), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(
        np.asarray(normalise((o, m, l))), np.asarray(normalise((o_r, m_r, l_r))), rtol=2e-2, atol=2e-2
    )


# ---------------------------------------------------------------------------------------------- chunked similarity


@pytest.mark.parametrize("shape,chunk", tcs.KERNEL_CASES)
def test_chunked_similarity_cases(shape, chunk):
    tcs.check_kernel(IMPL, shape, chunk, interpret=INTERPRET)


def test_chunked_similarity_bf16_and_empty_chunks():
    tcs.check_bf16_and_empty_chunks(IMPL, interpret=INTERPRET)


@pytest.mark.parametrize("heads", tex.HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_similarity_model_shapes(heads, dtype):
    _, hkv, d = tex.HEADS[heads]
    tcs.check_kernel(IMPL, (2, hkv, 1024, d), 256, interpret=INTERPRET, dtype=dtype)  # Chelsea's chunk of 256


# ---------------------------------------------------------------------------------------------- PQ lookup


@pytest.mark.parametrize("shape,block_t", [c for c in tpq.KERNEL_CASES if tpu_legal(c[1])])
def test_pq_lookup_cases(shape, block_t):
    tpq.check_kernel(IMPL, shape, block_t, interpret=INTERPRET)


@pytest.mark.parametrize("shape,block_t,lengths", [c for c in tpq.LENGTH_CASES if tpu_legal(c[1])])
def test_pq_lookup_lengths(shape, block_t, lengths):
    tpq.check_kernel_with_lengths(IMPL, shape, block_t, lengths, interpret=INTERPRET)


@pytest.mark.parametrize("heads", tex.HEADS)
def test_pq_lookup_model_shapes(heads):
    hq, hkv, _ = tex.HEADS[heads]
    tpq.check_kernel_with_lengths(IMPL, (2, hkv, hq // hkv, 2, 6, 1087), None, (1087, 531), interpret=INTERPRET)


# ---------------------------------------------------------------------------------------------- cosine K-means


@pytest.mark.parametrize("name,dtype,tpu_block,gpu_block", tck.KERNEL_CASES)
def test_cosine_kmeans_cases(name, dtype, tpu_block, gpu_block):
    tck.check_kernel(IMPL, name, dtype, tpu_block, gpu_block, interpret=INTERPRET)


# ---------------------------------------------------------------------------------------------- accumulated attention
# H2O's prompt pass: a GPU kernel only (a TPU runs the XLA path), so these skip on a TPU (and run the GPU kernel in
# interpret mode in a dry run on CPU).
gpu_only = pytest.mark.skipif(
    jax.default_backend() == "tpu", reason="accumulated_attention has no TPU kernel (XLA path)"
)


@gpu_only
@pytest.mark.parametrize("case", taa.KERNEL_CASES, ids=taa.IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
def test_accumulated_attention_cases(case, dtype):
    taa.check_kernel("pallas_gpu", case, dtype=dtype, interpret=INTERPRET)


@gpu_only
@pytest.mark.parametrize("heads", tex.HEADS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
@pytest.mark.parametrize("with_v", [True, False], ids=["attention", "scores"])
def test_accumulated_attention_model_shapes(heads, dtype, with_v):
    """SmolLM2's and Llama-3.1-8B's heads, 1087 tokens (a ragged last block), lengths (1087, 531), the default
    blocks and Triton settings; against the XLA reference (NumPy is too slow at this size)."""
    hq, hkv, d = tex.HEADS[heads]
    case = ((1087, 531), hq, hkv, 1087, d, None, None)
    taa.check_kernel("pallas_gpu", case, dtype=dtype, with_v=with_v, interpret=INTERPRET, blocks=False, numpy=False)
