"""cosine_kmeans: the pure-JAX reference against an independent numpy float64 implementation (cosine argmax with
lowest-index ties and the sentinel, per-cluster sums by a loop, the Lloyd mean with empty clusters kept), the
Pallas kernels (interpret mode on CPU) against the reference with TPU-legal and ragged row tiles, bf16 and f32
keys, and bad input (lowering for TPU and GPU: test_export.py). Data: keys with large-magnitude outlier channels
(ClusterKV §III-B's reason for cosine), ragged valid masks, C not a multiple of 128, empty and invalid clusters.
Labels must be equal except at near-ties (top-2 cosine gap < 1e-5, checked in float64)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.cosine_kmeans import (
    centroid_update,
    centroid_update_reference,
    cosine_assign,
    cosine_assign_reference,
    default_impl,
    lloyd_step,
)
from kvjax.engine.census import Census, loop_census

# ---------------------------------------------------------------------------------------------- numpy float64


def np_normalise(c):
    c = np.asarray(c, np.float64)
    return c / (np.linalg.norm(c, axis=-1, keepdims=True) + 1e-8)


def np_assign(x, cent, valid=None, cvalid=None):
    x = np.asarray(x, np.float64)
    n, l, _ = x.shape
    c = cent.shape[1]
    cn = np_normalise(cent)
    out = np.full((n, l), c, np.int64)
    for i in range(n):
        ok = np.ones(c, bool) if cvalid is None else np.asarray(cvalid[i])
        if not ok.any():
            continue  # no valid centroid: every row keeps the sentinel
        sim = x[i] @ cn[i].T  # [L, C]
        sim[:, ~ok] = -np.inf
        lab = np.argmax(sim, axis=1)  # the first maximum: the lowest index wins a tie
        rows = np.ones(l, bool) if valid is None else np.asarray(valid[i])
        out[i, rows] = lab[rows]
    return out


def np_update(x, labels, c):
    x = np.asarray(x, np.float64)
    n, l, d = x.shape
    sums, counts, abssum = np.zeros((n, c, d)), np.zeros((n, c), np.int64), np.zeros((n, c, d))
    for i in range(n):
        for r in range(l):
            j = int(labels[i, r])
            if 0 <= j < c:
                sums[i, j] += x[i, r]
                abssum[i, j] += np.abs(x[i, r])
                counts[i, j] += 1
    return sums, counts, abssum


def np_lloyd(x, cent, valid=None, cvalid=None):
    lab = np_assign(x, cent, valid, cvalid)
    sums, counts, _ = np_update(x, lab, cent.shape[1])
    new = np.where(counts[..., None] > 0, sums / np.maximum(counts, 1)[..., None], np.asarray(cent, np.float64))
    return new, lab, counts


def assert_labels(got, want, x, cent):
    """Equal, except where both labels are real centroids within 1e-5 cosine of each other (a near-tie)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == np.int32
    c = cent.shape[1]
    x = np.asarray(x, np.float64)
    cn = np_normalise(cent)
    for i, r in np.argwhere(got != want):
        a, b = int(got[i, r]), int(want[i, r])
        assert a < c and b < c, f"row ({i}, {r}): label {a} vs {b} (sentinel {c})"
        cos = cn[i] @ x[i, r] / np.linalg.norm(x[i, r])
        assert abs(cos[a] - cos[b]) < 1e-5, f"row ({i}, {r}): label {a} vs {b}, cosine gap {abs(cos[a] - cos[b])}"
    assert (got != want).mean() <= 0.01


def assert_sums(got, want, abssum):
    """Relative 1e-4, with an absolute floor from the float32 summation of the member magnitudes."""
    got = np.asarray(got, np.float64)
    assert np.all(np.abs(got - want) <= 1e-4 * np.abs(want) + 1e-6 * abssum + 1e-6), np.abs(got - want).max()


# ---------------------------------------------------------------------------------------------- data


CASES = ["d48_c5", "d64_c130_outliers", "d128_c7_masks"]


def make_case(name, dtype=np.float32):
    """Keys ``x [3, L, D]`` (bf16-rounded when asked), raw centroids, masks; see CASES."""
    rng = np.random.default_rng(CASES.index(name))
    n = 3
    l, d, c = {"d48_c5": (50, 48, 5), "d64_c130_outliers": (300, 64, 130), "d128_c7_masks": (200, 128, 7)}[name]
    dirs = rng.standard_normal((n, max(c, 8), d))
    member = rng.integers(0, dirs.shape[1], (n, l))
    x = np.take_along_axis(dirs, member[..., None], axis=1) + 0.3 * rng.standard_normal((n, l, d))
    if name == "d64_c130_outliers":
        x[..., [3, 17]] = 8.0 * x[..., [3, 17]] + 4.0  # large-magnitude outlier channels (KIVI, §III-B)
        x[..., 40] = -np.abs(x[..., 40])  # a channel negative in every key (for the empty cluster below)
    x *= rng.uniform(0.2, 5.0, (n, l, 1))  # row norms do not change a cosine argmax
    valid = cvalid = None
    if dtype is not np.float32:
        x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
    pick = np.stack([rng.choice(l, c, replace=False) for _ in range(n)])  # distinct sampled keys (§III-B init)
    cent = x[np.arange(n)[:, None], pick] * rng.uniform(0.1, 10.0, (n, c, 1))
    if name == "d48_c5":
        cent[:, 4] = cent[:, 1]  # an exact duplicate: every tie must go to centroid 1, centroid 4 stays empty
    if name == "d64_c130_outliers":
        cent[:, 0] = 0.0
        cent[:, 0, 40] = 5.0  # negative cosine with every key: an empty cluster
        valid = np.arange(l)[None, :] < np.array([l, 157, 1])[:, None]  # ragged lengths, one single row
        cvalid = rng.uniform(size=(n, c)) < 0.9
        cvalid[:, [0, 7, 120]] = True
        cent[:, 120] = cent[:, 7]  # an exact duplicate in another centroid tile (GPU tC = 64): 7 wins every tie
    if name == "d128_c7_masks":
        valid = rng.uniform(size=(n, l)) < 0.8
        cvalid = np.ones((n, c), bool)
        cvalid[1, [2, 5]] = False
        cvalid[2] = False  # no valid centroid: every row of head 2 gets the sentinel
    return x.astype(np.float32), cent.astype(np.float32), valid, cvalid


def jx(a, dtype=None):
    return None if a is None else jnp.asarray(a, dtype)


# ---------------------------------------------------------------------------------------------- reference


@pytest.mark.parametrize("name", CASES)
def test_reference_matches_numpy(name):
    x, cent, valid, cvalid = make_case(name)
    c = cent.shape[1]
    want_lab = np_assign(x, cent, valid, cvalid)
    lab = cosine_assign_reference(jx(x), jx(cent), jx(valid), jx(cvalid))
    assert_labels(lab, want_lab, x, cent)
    # the update with the numpy labels, plus labels outside [0, C) that must be ignored
    bad = want_lab.copy()
    bad[:, ::17] = -1
    bad[:, 5::23] = c + 3
    s, k, a = np_update(x, bad, c)
    sums, counts = centroid_update_reference(jx(x), jx(bad, jnp.int32), c)
    assert sums.dtype == jnp.float32 and counts.dtype == jnp.int32
    assert_sums(sums, s, a)
    np.testing.assert_array_equal(np.asarray(counts), k)
    new, lab2 = lloyd_step(jx(x), jx(cent), jx(valid), jx(cvalid), impl="xla")
    want_new, want_lab2, want_counts = np_lloyd(x, cent, valid, cvalid)
    assert_labels(lab2, want_lab2, x, cent)
    np.testing.assert_allclose(np.asarray(new), want_new, rtol=1e-4, atol=1e-4 * np.abs(x).max())
    empty = want_counts == 0
    assert empty.any()  # every case has an empty or invalid cluster: it keeps its old centroid exactly
    np.testing.assert_array_equal(np.asarray(new)[empty], cent[empty])
    tie = {"d48_c5": (1, 4), "d64_c130_outliers": (7, 120)}.get(name)
    if tie:  # exact duplicate centroids: the lowest index wins every tie
        assert (np.asarray(lab) == tie[0]).any() and (np.asarray(lab) != tie[1]).all()
    if name == "d64_c130_outliers":
        assert (want_counts[:, 0] == 0).all()
        assert (np.asarray(lab)[1, 157:] == c).all() and (np.asarray(lab)[2, 1:] == c).all()
    if name == "d128_c7_masks":
        assert (np.asarray(lab)[2] == c).all() and (want_counts[2] == 0).all()


@pytest.mark.parametrize("name", CASES)
def test_xla_row_tiles_match_numpy(name):
    """The CPU path (``impl="xla"``) assigns ``block_l`` rows at a time (memory linear in L, ClusterKV's C grows
    with L): with small tiles (several per head, a ragged last one) the labels are numpy's."""
    x, cent, valid, cvalid = make_case(name)
    want = np_assign(x, cent, valid, cvalid)
    for block in (64, 100):
        lab = cosine_assign(jx(x), jx(cent), jx(valid), jx(cvalid), impl="xla", block_l=block)
        assert_labels(lab, want, x, cent)


def test_reference_ignores_row_norm():
    x, cent, valid, cvalid = make_case("d48_c5")
    scale = np.random.default_rng(1).uniform(1e-3, 1e3, x.shape[:2] + (1,)).astype(np.float32)
    a = cosine_assign_reference(jx(x), jx(cent), jx(valid), jx(cvalid))
    b = cosine_assign_reference(jx(x * scale), jx(cent), jx(valid), jx(cvalid))
    assert_labels(b, np.asarray(a), x, cent)


# ---------------------------------------------------------------------------------------------- kernels

# (case, dtype, tpu block_l, gpu block_l): TPU tiles a multiple of 128 (ragged L: 300 rows pad to 384 or 512) or
# one tile of all L (None: the default 512 >= L); GPU tiles powers of two, ragged (50 -> 64, 300 -> 320 or 384,
# 200 -> 256 with the default 64), D=48 zero-padded to 64.
KERNEL_CASES = [
    ("d48_c5", np.float32, None, 16),
    ("d64_c130_outliers", np.float32, 128, 64),
    ("d64_c130_outliers", jnp.bfloat16, 256, 128),
    ("d128_c7_masks", jnp.bfloat16, None, None),
]


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("name,dtype,tpu_block,gpu_block", KERNEL_CASES)
def test_kernels_match_reference(impl, name, dtype, tpu_block, gpu_block):
    check_kernel(impl, name, dtype, tpu_block, gpu_block)


def check_kernel(impl, name, dtype, tpu_block, gpu_block, *, interpret=True):
    """lloyd_step and centroid_update against the reference and numpy (also used compiled by tests/accelerator)."""
    x, cent, valid, cvalid = make_case(name, dtype)
    block_l = tpu_block if impl == "pallas_tpu" else gpu_block
    c = cent.shape[1]
    xj = jx(x, dtype)
    kw = dict(impl=impl, interpret=interpret, block_l=block_l)
    new, lab = lloyd_step(xj, jx(cent), jx(valid), jx(cvalid), **kw)
    want_new, want_lab = lloyd_step(xj, jx(cent), jx(valid), jx(cvalid), impl="xla")
    assert_labels(lab, want_lab, x, cent)
    tie = {"d48_c5": (1, 4), "d64_c130_outliers": (7, 120)}.get(name)
    if tie:  # exact duplicate centroids: the lowest index wins every tie
        assert (np.asarray(lab) == tie[0]).any() and (np.asarray(lab) != tie[1]).all()
    if (np.asarray(lab) == np.asarray(want_lab)).all():
        np.testing.assert_allclose(np.asarray(new), np.asarray(want_new), rtol=1e-4, atol=1e-5 * np.abs(x).max())
    # the update on the reference labels (plus ignored out-of-range labels): sums and counts
    labels = np.asarray(want_lab).copy()
    labels[:, ::19] = -1
    labels[:, 7::29] = c + 3
    sums, counts = centroid_update(xj, jx(labels), c, **kw)
    s, k, a = np_update(x, labels, c)
    assert sums.shape == s.shape and sums.dtype == jnp.float32 and counts.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(counts), k)
    ws, wk = centroid_update_reference(xj, jx(labels), c)
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(wk))
    assert_sums(sums, np.asarray(ws, np.float64), a)
    assert_sums(sums, s, a)


def test_empty_rows():
    x = jnp.zeros((2, 0, 16), jnp.float32)
    cent = jnp.ones((2, 3, 16), jnp.float32)
    for impl in ("pallas_tpu", "pallas_gpu"):
        new, lab = lloyd_step(x, cent, impl=impl, interpret=True)
        assert lab.shape == (2, 0)
        np.testing.assert_array_equal(np.asarray(new), np.asarray(cent))


def test_default_impl_on_cpu_is_xla():
    if jax.default_backend() == "cpu":
        assert default_impl() == "xla"


def test_bad_input():
    x, cent, valid, cvalid = (jx(a) for a in make_case("d48_c5"))
    lab = jnp.zeros(x.shape[:2], jnp.int32)
    with pytest.raises(ValueError, match="impl"):
        cosine_assign(x, cent, impl="cuda")
    with pytest.raises(ValueError, match="x has shape"):
        cosine_assign(x[0], cent)
    with pytest.raises(ValueError, match="x has dtype"):
        cosine_assign(x.astype(jnp.int32), cent)
    with pytest.raises(ValueError, match="centroids has shape"):
        cosine_assign(x, cent[:, :, :8])
    with pytest.raises(ValueError, match="centroids has C=0"):
        cosine_assign(x, cent[:, :0])
    with pytest.raises(ValueError, match="centroids has dtype"):
        cosine_assign(x, cent.astype(jnp.int32))
    with pytest.raises(ValueError, match="valid has shape"):
        cosine_assign(x, cent, jnp.ones((3, 7), bool))
    with pytest.raises(ValueError, match="valid has dtype"):
        cosine_assign(x, cent, jnp.ones(x.shape[:2], jnp.int32))
    with pytest.raises(ValueError, match="cvalid has shape"):
        cosine_assign(x, cent, None, jnp.ones((3, 4), bool))
    with pytest.raises(ValueError, match="num_clusters"):
        centroid_update(x, lab, 0)
    with pytest.raises(ValueError, match="num_clusters"):
        centroid_update(x, lab, 2.0)
    with pytest.raises(ValueError, match="labels has shape"):
        centroid_update(x, lab[:, :3], 5)
    with pytest.raises(ValueError, match="labels has dtype"):
        centroid_update(x, lab.astype(jnp.float32), 5)
    for bad in (0, -128, 1.5):
        with pytest.raises(ValueError, match="block_l"):
            cosine_assign(x, cent, impl="pallas_tpu", interpret=True, block_l=bad)
    xl = jnp.zeros((1, 300, 16), jnp.float32)  # L=300 in tiles of 64: the [1, tL] label rows are TPU-illegal
    with pytest.raises(ValueError, match="block_l=64 gives a TPU-illegal"):
        cosine_assign(xl, jnp.ones((1, 3, 16)), impl="pallas_tpu", interpret=True, block_l=64)
    with pytest.raises(ValueError, match="block_l=64 gives a TPU-illegal"):
        centroid_update(xl, jnp.zeros((1, 300), jnp.int32), 3, impl="pallas_tpu", interpret=True, block_l=64)
    for bad in (24, 8):
        with pytest.raises(ValueError, match=f"block_l={bad} must be a power of two"):
            cosine_assign(x, cent, impl="pallas_gpu", interpret=True, block_l=bad)
        with pytest.raises(ValueError, match=f"block_l={bad} must be a power of two"):
            centroid_update(x, lab, 5, impl="pallas_gpu", interpret=True, block_l=bad)


# ---------------------------------------------------------------------------------------------- accelerators' xla path


@pytest.fixture
def on_gpu(monkeypatch):
    """The kernels' backend reads as a GPU (the xla path's large blocks and one-hot update are traced)."""
    from kernels_pallas import impl_choice

    monkeypatch.setattr(impl_choice, "backend", lambda: "gpu")


@pytest.mark.parametrize(
    "name,dtype,block",
    [("d48_c5", np.float32, None), ("d64_c130_outliers", jnp.bfloat16, None), ("d64_c130_outliers", np.float32, 128)],
)
def test_accelerator_xla_path_matches_numpy(on_gpu, name, dtype, block):
    """On a GPU/TPU the xla path assigns in one block of all rows (or ``block`` rows) and sums by one-hot matmuls:
    labels against numpy's float64 arg-max, sums and counts against numpy's loop (out-of-range labels ignored,
    including a non-finite row's), the Lloyd step's new centroids against numpy's."""
    from kernels_pallas.cosine_kmeans import _common

    x, cent, valid, cvalid = make_case(name, dtype)
    c = cent.shape[1]
    assert _common.xla_block_l(3, x.shape[1], c) == x.shape[1]  # small: one block of every row
    xj = jx(x, dtype)
    lab = cosine_assign(xj, jx(cent), jx(valid), jx(cvalid), impl="xla", block_l=block)
    assert_labels(lab, np_assign(x, cent, valid, cvalid), x, cent)
    labels = np_assign(x, cent, valid, cvalid)
    labels[:, ::19] = -1
    labels[:, 7::29] = c + 3
    xbad = np.array(x)
    xbad[1, 7] = np.inf  # label c + 3: ignored, so it must not reach a sum (0 * inf)
    sums, counts = centroid_update(jx(xbad, dtype), jx(labels, jnp.int32), c, impl="xla", block_l=block)
    s, k, a = np_update(x, labels, c)
    assert sums.dtype == jnp.float32 and counts.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(counts), k)
    assert_sums(sums, s, a)
    new, lab2 = lloyd_step(xj, jx(cent), jx(valid), jx(cvalid), impl="xla", block_l=block)
    want_new, want_lab, _ = np_lloyd(x, cent, valid, cvalid)
    if (np.asarray(lab2) == want_lab).all():
        np.testing.assert_allclose(np.asarray(new), want_new, rtol=1e-4, atol=1e-5 * np.abs(x).max())


def test_accelerator_xla_path_is_few_large_operations(on_gpu, monkeypatch):
    """Traced for a GPU at ClusterKV's 32k-token, batch-8 shapes (N = 64 heads, C = 410): the assignment and the
    update are each one matmul per block of rows, the blocks as large as ``ACCEL_BLOCK_BYTES`` allows (two blocks of
    19,968 rows: two trips of one loop), no scatter (atomics on a GPU); with the whole ``L`` in budget, no loop."""
    from kernels_pallas.cosine_kmeans import _common

    x = jax.ShapeDtypeStruct((64, 32768, 128), jnp.bfloat16)
    cent = jax.ShapeDtypeStruct((64, 410, 128), jnp.float32)
    lab = jax.ShapeDtypeStruct((64, 32768), jnp.int32)

    def census(fn, arg):
        return loop_census(fn, x, arg), str(jax.make_jaxpr(fn)(x, arg))

    assert _common.xla_block_l(64, 32768, 410) == 19968
    steps = [(lambda x, c: cosine_assign(x, c, impl="xla"), cent), (lambda x, lab: centroid_update(x, lab, 410), lab)]
    for fn, arg in steps:
        got, text = census(fn, arg)
        assert got == Census(scan_trips=2) and "scatter" not in text and text.count("dot_general") == 1
    monkeypatch.setattr(_common, "ACCEL_BLOCK_BYTES", 4 << 30)
    for fn, arg in steps:
        got, text = census(fn, arg)
        assert got == Census() and "scatter" not in text and text.count("dot_general") == 1


def test_slower_kernel_is_not_the_default_on_gpu(on_gpu, monkeypatch):
    """The Triton kernels are verified on a GPU but measured slower than the xla path (impl_choice.SLOWER_THAN_XLA):
    impl=None takes xla there, also under KVJAX_UNVERIFIED_KERNELS=1; the kernel's own variable still takes it."""
    monkeypatch.delenv("KVJAX_COSINE_KMEANS_IMPL", raising=False)
    assert default_impl() == "xla"
    monkeypatch.setenv("KVJAX_UNVERIFIED_KERNELS", "1")
    assert default_impl() == "xla"
    monkeypatch.setenv("KVJAX_COSINE_KMEANS_IMPL", "pallas_gpu")
    assert default_impl() == "pallas_gpu"
