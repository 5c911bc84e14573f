"""pq_lookup: the pure-JAX reference against a numpy loop and the PQ-reconstruction identity, the Pallas
kernels (interpret mode on CPU) against the reference, including TPU-legal tiles, per-sequence ``lengths``
(slots past them are NEG_INF and their blocks are skipped), and bad input. Codes are sub-space-major
``[B, Hkv, m, S]``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.pq_lookup import NEG_INF, default_impl, pq_lookup
from kernels_pallas.pq_lookup.reference import pq_lookup_reference


def inputs(b, h, g, m, bits, s, seed=0):
    rng = np.random.default_rng(seed)
    k = 2**bits
    lut = rng.standard_normal((b, h, g, m, k)).astype(np.float32)
    codes = rng.integers(0, k, size=(b, h, m, s)).astype(np.uint8)
    return lut, codes


def numpy_lookup(lut, codes, lengths=None):
    b, h, g, m, _ = lut.shape
    s = codes.shape[-1]
    out = np.full((b, h, g, s), NEG_INF)
    for bi in range(b):
        for hi in range(h):
            for gi in range(g):
                for si in range(s if lengths is None else min(lengths[bi], s)):
                    out[bi, hi, gi, si] = sum(float(lut[bi, hi, gi, i, codes[bi, hi, i, si]]) for i in range(m))
    return out


def test_reference_matches_numpy_loop():
    lut, codes = inputs(2, 2, 3, 2, 4, 19)
    np.testing.assert_allclose(
        np.asarray(pq_lookup_reference(jnp.asarray(lut), jnp.asarray(codes))), numpy_lookup(lut, codes), atol=1e-5
    )
    lengths = [19, 7]
    np.testing.assert_allclose(
        np.asarray(pq_lookup_reference(jnp.asarray(lut), jnp.asarray(codes), jnp.asarray(lengths))),
        numpy_lookup(lut, codes, lengths),
        atol=1e-5,
    )


def test_reconstruction_identity():
    """scores == q · concat_i C[i, codes_i] (method note ``docs/notes/pqcache.md`` §8.12 test 2)."""
    rng = np.random.default_rng(3)
    b, h, g, m, k, dm, s = 1, 2, 2, 4, 16, 3, 11
    q = rng.standard_normal((b, h, g, m, dm))
    cent = rng.standard_normal((b, h, m, k, dm))
    codes = rng.integers(0, k, size=(b, h, m, s)).astype(np.uint8)
    lut = np.einsum("bhgid,bhicd->bhgic", q, cent).astype(np.float32)
    khat = np.stack(
        [np.concatenate([cent[0, hi, i, codes[0, hi, i, si]] for i in range(m)]) for hi in range(h) for si in range(s)]
    ).reshape(h, s, m * dm)
    want = np.einsum("hgd,hsd->hgs", q[0].reshape(h, g, m * dm), khat)
    got = np.asarray(pq_lookup(jnp.asarray(lut), jnp.asarray(codes), impl="xla"))[0]
    np.testing.assert_allclose(got, want, atol=1e-5)


KERNEL_CASES = [
    ((2, 3, 1, 1, 4, 37), 16),  # G=1, m=1, S not a multiple of the tile
    ((1, 2, 4, 2, 6, 200), 128),  # the paper's m=2, b=6: m*K = 128 lanes; TPU-legal tT=128
    ((1, 1, 8, 4, 8, 64), 32),  # G=8, m=4, b=8 (m*K = 1024)
    ((1, 2, 3, 2, 6, 1024), 512),  # TPU-legal default tile tT=512, G=3
]
LENGTH_CASES = [
    ((3, 2, 1, 2, 4, 100), 16, (100, 37, 0)),  # full, mid-block, empty
    ((2, 2, 3, 2, 6, 300), 128, (129, 128)),  # one past a tile edge, exactly a tile; G=3
    ((2, 1, 4, 4, 4, 64), 32, (1, 64)),  # a single live slot
]


def check_kernel(impl, shape, block_t, *, interpret=True):
    """The kernel equals the reference (also used compiled by tests/accelerator)."""
    lut, codes = inputs(*shape, seed=shape[-1])
    want = np.asarray(pq_lookup(jnp.asarray(lut), jnp.asarray(codes), impl="xla"))
    got = np.asarray(pq_lookup(jnp.asarray(lut), jnp.asarray(codes), impl=impl, interpret=interpret, block_t=block_t))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("shape,block_t", KERNEL_CASES)
def test_kernels_match_reference(impl, shape, block_t):
    check_kernel(impl, shape, block_t)


def check_kernel_with_lengths(impl, shape, block_t, lengths, *, interpret=True):
    """Slots past ``lengths[b]`` are NEG_INF; live slots equal the reference (and the numpy loop)."""
    lut, codes = inputs(*shape, seed=7)
    lens = jnp.asarray(lengths, jnp.int32)
    want = np.asarray(pq_lookup(jnp.asarray(lut), jnp.asarray(codes), lens, impl="xla"))
    np.testing.assert_allclose(want, numpy_lookup(lut, codes, lengths), atol=1e-5)
    got = np.asarray(
        pq_lookup(jnp.asarray(lut), jnp.asarray(codes), lens, impl=impl, interpret=interpret, block_t=block_t)
    )
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for bi, n in enumerate(lengths):
        assert (got[bi, :, :, n:] == NEG_INF).all()


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("shape,block_t,lengths", LENGTH_CASES)
def test_kernels_with_lengths_match_reference(impl, shape, block_t, lengths):
    check_kernel_with_lengths(impl, shape, block_t, lengths)


def test_kernels_skip_dead_blocks():
    """Codes past ``lengths`` are never read: garbage (out-of-range codes) there changes nothing."""
    lut, codes = inputs(1, 2, 2, 2, 4, 96, seed=3)
    lens = jnp.asarray([40], jnp.int32)
    want = np.asarray(pq_lookup(jnp.asarray(lut), jnp.asarray(codes), lens, impl="xla"))
    codes[..., 64:] = 255  # blocks of 32 starting at 64: dead
    for impl in ("pallas_tpu", "pallas_gpu"):
        got = np.asarray(pq_lookup(jnp.asarray(lut), jnp.asarray(codes), lens, impl=impl, interpret=True, block_t=32))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_default_impl_on_cpu_is_xla():
    if jax.default_backend() == "cpu":
        assert default_impl() == "xla"


def test_bad_input():
    lut, codes = inputs(1, 2, 2, 2, 4, 8)
    with pytest.raises(ValueError, match="impl"):
        pq_lookup(jnp.asarray(lut), jnp.asarray(codes), impl="cuda")
    with pytest.raises(ValueError, match="codes has shape"):
        pq_lookup(jnp.asarray(lut), jnp.asarray(codes[:, :, :1]))
    with pytest.raises(ValueError, match="lengths has shape"):
        pq_lookup(jnp.asarray(lut), jnp.asarray(codes), jnp.asarray([1, 2]))
    with pytest.raises(ValueError, match="integer"):
        pq_lookup(jnp.asarray(lut), jnp.asarray(codes, jnp.float32))
    with pytest.raises(ValueError, match="power"):
        pq_lookup(jnp.asarray(lut), jnp.asarray(codes), impl="pallas_gpu", interpret=True, block_t=24)
