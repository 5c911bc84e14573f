"""chunked_similarity: the Pallas kernels (interpret mode on CPU) against the pure-JAX reference, the reference
against a numpy loop, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.chunked_similarity import chunk_best_match, default_impl
from kernels_pallas.chunked_similarity.reference import chunk_best_match_reference


def inputs(b, h, m, d, seed=0, p_valid=0.8):
    k = jax.random.normal(jax.random.PRNGKey(seed), (b, h, m, d), jnp.float32)
    valid = jax.random.uniform(jax.random.PRNGKey(seed + 1), (b, h, m)) < p_valid
    return k, valid


def numpy_best(k, valid, chunk):
    k, valid = np.asarray(k, np.float64), np.asarray(valid)
    b, h, m, d = k.shape
    best = np.full((b, h, m // chunk, chunk // 2), -np.inf)
    idx = np.zeros_like(best, dtype=np.int64)
    for bi in range(b):
        for hi in range(h):
            for p in range(m // chunk):
                for i in range(chunk // 2):
                    a = p * chunk + 2 * i
                    if not valid[bi, hi, a]:
                        continue
                    for j in range(chunk // 2):
                        bb = p * chunk + 2 * j + 1
                        if not valid[bi, hi, bb]:
                            continue
                        c = k[bi, hi, a] @ k[bi, hi, bb] / np.linalg.norm(k[bi, hi, a]) / np.linalg.norm(k[bi, hi, bb])
                        if c > best[bi, hi, p, i]:
                            best[bi, hi, p, i], idx[bi, hi, p, i] = c, j
    return best, idx


def check(out, want, k=None, chunk=None):
    """``out`` equals ``want``; with the keys ``k`` and ``chunk``, an index may differ at a near-tie (its cosine,
    in float64, within 1e-5 of the best)."""
    best, idx = (np.asarray(x) for x in out)
    wb, wi = (np.asarray(x) for x in want)
    np.testing.assert_array_equal(np.isinf(best), np.isinf(wb))
    fin = np.isfinite(wb)
    np.testing.assert_allclose(best[fin], wb[fin], atol=1e-5)
    if k is None:
        np.testing.assert_array_equal(idx, wi)
        return
    kc = np.asarray(k, np.float64)
    for bi, hi, p, i in np.argwhere(idx != wi):
        a, b = (kc[bi, hi, p * chunk + 2 * j + o] for j, o in ((i, 0), (idx[bi, hi, p, i], 1)))
        assert abs(a @ b / np.linalg.norm(a) / np.linalg.norm(b) - wb[bi, hi, p, i]) < 1e-5, (bi, hi, p, i)


def test_reference_matches_numpy_loop():
    k, valid = inputs(2, 2, 24, 8)
    check(chunk_best_match_reference(k, valid, 6), numpy_best(k, valid, 6))


KERNEL_CASES = [
    ((2, 3, 32, 16), 8),  # small
    ((1, 2, 512, 64), 256),  # TPU-legal: tile [128, 128] lanes, c=256
    ((1, 1, 256, 128), 256),
]  # head_dim 128: tile [128, 256]


def check_kernel(impl, shape, chunk, *, interpret=True, dtype=jnp.float32):
    """The kernel on ``inputs(*shape)`` equals the reference (also used compiled by tests/accelerator)."""
    k, valid = inputs(*shape, seed=shape[2])
    k = k.astype(dtype)
    got = chunk_best_match(k, valid, chunk, impl=impl, interpret=interpret)
    check(got, chunk_best_match_reference(k, valid, chunk), None if interpret else k, chunk)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("shape,chunk", KERNEL_CASES)
def test_kernels_match_reference(impl, shape, chunk):
    check_kernel(impl, shape, chunk)


def check_bf16_and_empty_chunks(impl, *, interpret=True):
    k, valid = inputs(1, 2, 64, 16, seed=3)
    valid = valid.at[:, :, 16:32].set(False)  # one chunk entirely invalid: -inf, idx 0
    k = k.astype(jnp.bfloat16)
    want = chunk_best_match_reference(k, valid, 16)
    assert np.all(np.isinf(np.asarray(want[0][:, :, 1]))) and np.all(np.asarray(want[1][:, :, 1]) == 0)
    check(chunk_best_match(k, valid, 16, impl=impl, interpret=interpret), want)


def test_bf16_keys_and_empty_chunks():
    for impl in ("pallas_tpu", "pallas_gpu"):
        check_bf16_and_empty_chunks(impl)


def test_default_impl_and_bad_input():
    assert default_impl() == {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(jax.default_backend(), "xla")
    k, valid = inputs(1, 1, 16, 8)
    with pytest.raises(ValueError, match="chunk=5"):
        chunk_best_match(k, valid, 5)
    with pytest.raises(ValueError, match="multiple of chunk"):
        chunk_best_match(k, valid, 6)
    with pytest.raises(ValueError, match="valid has shape"):
        chunk_best_match(k, valid[..., :8], 8)
    with pytest.raises(ValueError, match="impl='triton'"):
        chunk_best_match(k, valid, 8, impl="triton")
    with pytest.raises(ValueError, match="powers of two"):
        chunk_best_match(jnp.zeros((1, 1, 24, 8)), jnp.ones((1, 1, 24), bool), 12, impl="pallas_gpu", interpret=True)
