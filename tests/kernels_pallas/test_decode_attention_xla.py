"""The XLA decode-attention path (``kernels_pallas.decode_attention.xla``): equal to the masked reference for
every chunking, and structurally a read of only the live chunks or the listed blocks (no op of the compiled
program spans all ``S`` slots besides the buffers themselves)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.decode_attention import decode_attention_reference
from kernels_pallas.decode_attention.xla import chunk_rows, decode_attention_xla


def _random_case(r):
    b, hkv, g, d = int(r.integers(1, 3)), int(r.integers(1, 3)), int(r.integers(1, 4)), 8
    s = int(r.integers(1, 90))
    bs, chunk = int(r.choice([1, 4, 16, 128])), int(r.choice([4, 8, 16, 64]))
    q = jnp.asarray(r.normal(size=(b, hkv * g, d)), jnp.float32)
    k = jnp.asarray(r.normal(size=(b, hkv, s, d)), jnp.float32)
    v = jnp.asarray(r.normal(size=(b, hkv, s, d)), jnp.float32)
    kw = {}
    if r.random() < 0.5:
        kw["valid"] = jnp.asarray(r.random((b, hkv, s)) < 0.8)
    if r.random() < 0.5:
        kw["bias"] = jnp.asarray(r.normal(size=(b, hkv, s)), jnp.float32)
    if r.random() < 0.7:
        kw["lengths"] = jnp.asarray(r.integers(0, s + 1, b), jnp.int32)
    if r.random() < 0.6:  # -1 pads, repeats, blocks past the lengths, [B, Hkv, N] or [B, N]
        n = int(r.integers(0, 7))
        shape = (b, hkv, n) if r.random() < 0.5 else (b, n)
        kw["block_indices"] = jnp.asarray(r.integers(-1, -(-s // bs), shape), jnp.int32)
    return q, k, v, kw, bs, chunk


#: random cases per seed: seed 0 in the default run, 1 in CI's second line (tests/extended.py), 2 and 3 with --runslow
SEEDS = [0, pytest.param(1, marks=pytest.mark.extended)] + [pytest.param(s, marks=pytest.mark.slow) for s in (2, 3)]


@pytest.mark.parametrize("seed", SEEDS)
def test_every_chunking_matches_the_reference(seed):
    r = np.random.default_rng(seed)
    for _ in range(6):
        q, k, v, kw, bs, chunk = _random_case(r)
        run = jax.jit(lambda q, k, v, kw: decode_attention_xla(q, k, v, **kw, block_size=bs, chunk=chunk))
        got = run(q, k, v, kw)
        want = decode_attention_reference(q, k, v, **kw, block_size=bs)
        for x, y in zip(got, want):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


def test_chunk_rows_targets_cache_sized_chunks():
    assert chunk_rows(1, 8, 128, 4) == 512  # 2 MiB of float32 keys at Llama-3.1-8B's 8 KV heads
    assert chunk_rows(1, 8, 128, 2) == 1024
    assert chunk_rows(64, 32, 128, 4) == 64 and chunk_rows(1, 1, 8, 1) == 4096  # clamped


def _hlo_shapes(fn, *args) -> list[tuple[str, tuple[int, ...]]]:
    """(op, shape) of every instruction of the compiled program that computes or copies (parameters, tuples,
    bitcasts and the loop itself only alias their operands)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\S* (\S+?)\(", line)
        if m and m.group(2) not in ("parameter", "get-tuple-element", "tuple", "bitcast", "while"):
            out.append((m.group(2), tuple(int(x) for x in m.group(1).split(",") if x)))
    return out


@pytest.mark.parametrize("listed", [False, True])
def test_no_op_spans_every_slot(listed):
    """A masked read is a full read: apart from aliases of the K/V/valid buffers, no instruction of the compiled step
    has the slot count ``S`` as a dimension (the loop slices or gathers cache-sized chunks)."""
    s = 4099  # prime-ish, so no chunk or block count equals it by accident
    q = jax.ShapeDtypeStruct((1, 8, 64), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 2, s, 64), jnp.float32)
    valid = jax.ShapeDtypeStruct((1, 2, s), jnp.bool_)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    bi = jax.ShapeDtypeStruct((1, 2, 9), jnp.int32) if listed else None
    fn = lambda q, k, v, valid, lengths, bi: decode_attention_xla(q, k, v, valid, lengths, None, bi, 16, 256)
    shapes = _hlo_shapes(fn, q, k, k, valid, lengths, bi)
    spanning = [(op, sh) for op, sh in shapes if s in sh]
    assert shapes and not spanning, spanning


# ------------------------------------------------------------------------------------------------ runs of slots


def _numpy_runs_attention(q, k, v, starts, lens):
    """Softmax attention ``[B, Hq, D]`` in float64 over the slots of the runs (per query head), zero where none."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    lens = np.asarray(lens)
    out = np.zeros((b, hq, d))
    for bi in range(b):
        for qh in range(hq):
            h = qh // g
            ln = lens[bi, h] if lens.ndim == 3 else lens[bi, h, qh % g]
            rows = [s for st, n in zip(np.asarray(starts)[bi, h], ln) for s in range(st, st + n)]
            if rows:
                sc = k[bi, h, rows] @ q[bi, qh] / np.sqrt(d)
                p = np.exp(sc - sc.max())
                out[bi, qh] = p @ v[bi, h, rows] / p.sum()
    return out


def _random_runs(r, b, hkv, g, s, per_query):
    """Disjoint runs of random lengths (0 included) in a random order, per (b, h)."""
    n_runs = int(r.integers(1, 6))
    starts = np.zeros((b, hkv, n_runs), np.int32)
    lens = np.zeros((b, hkv, g, n_runs) if per_query else (b, hkv, n_runs), np.int32)
    for bi in range(b):
        for h in range(hkv):
            cuts = np.sort(r.choice(s + 1, 2 * n_runs, replace=True))
            order = r.permutation(n_runs)
            for i, j in enumerate(order):
                lo, hi = int(cuts[2 * j]), int(cuts[2 * j + 1])
                starts[bi, h, i] = lo
                if per_query:
                    lens[bi, h, :, i] = r.integers(0, hi - lo + 1, g)
                else:
                    lens[bi, h, i] = hi - lo
    return starts, lens


@pytest.mark.parametrize("seed", SEEDS)
def test_runs_match_the_reference_and_numpy(seed):
    from kernels_pallas.decode_attention import decode_attention_runs, decode_attention_runs_reference
    from kernels_pallas.decode_attention.xla import decode_attention_runs_xla

    r = np.random.default_rng(seed)
    for _ in range(4):
        b, hkv, g, d = int(r.integers(1, 3)), int(r.integers(1, 3)), int(r.integers(1, 4)), 8
        s = int(r.integers(1, 90))
        bs, chunk = int(r.choice([1, 4, 16, 128])), int(r.choice([4, 8, 16, 64]))
        q = jnp.asarray(r.normal(size=(b, hkv * g, d)), jnp.float32)
        k = jnp.asarray(r.normal(size=(b, hkv, s, d)), jnp.float32)
        v = jnp.asarray(r.normal(size=(b, hkv, s, d)), jnp.float32)
        starts, lens = _random_runs(r, b, hkv, g, s, per_query=bool(r.random() < 0.5))
        span = lens if lens.ndim == 3 else lens.max(axis=2)
        max_rows = int(span.sum(axis=-1).max()) + int(r.integers(0, 5))
        run = jax.jit(
            lambda q, k, v, st, ln: decode_attention_runs_xla(
                q, k, v, st, ln, max_rows=max_rows, block_size=bs, chunk=chunk
            )
        )
        got = run(q, k, v, jnp.asarray(starts), jnp.asarray(lens))
        want = decode_attention_runs_reference(q, k, v, jnp.asarray(starts), jnp.asarray(lens))
        for x, y in zip(got, want):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
        from kernels_pallas.decode_attention import normalise

        np.testing.assert_allclose(
            np.asarray(normalise(want)), _numpy_runs_attention(q, k, v, starts, lens), rtol=1e-5, atol=1e-5
        )
        pub = decode_attention_runs(q, k, v, jnp.asarray(starts), jnp.asarray(lens), max_rows=max_rows, block_size=bs)
        for x, y in zip(pub, want):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_runs_through_the_block_kernels(impl):
    """Without a run kernel the Pallas impls attend the gathered windows (interpret mode here)."""
    from kernels_pallas.decode_attention import decode_attention_runs, decode_attention_runs_reference

    r = np.random.default_rng(5)
    b, hkv, g, d, s = 2, 2, 2, 128, 200
    q = jnp.asarray(r.normal(size=(b, hkv * g, d)), jnp.float32)
    k = jnp.asarray(r.normal(size=(b, hkv, s, d)), jnp.float32)
    v = jnp.asarray(r.normal(size=(b, hkv, s, d)), jnp.float32)
    for per_query in (False, True):
        starts, lens = _random_runs(r, b, hkv, g, s, per_query)
        span = lens if lens.ndim == 3 else lens.max(axis=2)
        got = decode_attention_runs(
            q,
            k,
            v,
            jnp.asarray(starts),
            jnp.asarray(lens),
            max_rows=int(span.sum(-1).max()),
            block_size=16,
            impl=impl,
            interpret=True,
        )
        want = decode_attention_runs_reference(q, k, v, jnp.asarray(starts), jnp.asarray(lens))
        for x, y in zip(got, want):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


def test_runs_bad_inputs_name_the_argument():
    from kernels_pallas.decode_attention import decode_attention_runs

    q = jnp.zeros((1, 4, 8))
    k = jnp.zeros((1, 2, 40, 8))
    st, ln = jnp.array([[[0, 20], [5, 30]]]), jnp.array([[[4, 4], [4, 4]]])
    with pytest.raises(ValueError, match="starts has shape"):
        decode_attention_runs(q, k, k, st[0], ln, max_rows=8)
    with pytest.raises(ValueError, match="lens has shape"):
        decode_attention_runs(q, k, k, st, ln[..., :1], max_rows=8)
    with pytest.raises(ValueError, match="runs leave the buffer"):
        decode_attention_runs(q, k, k, st + 20, ln, max_rows=8)
    with pytest.raises(ValueError, match="max_rows=7 is below the 8 rows"):
        decode_attention_runs(q, k, k, st, ln, max_rows=7)


def test_runs_plan_bytes_count_distinct_rows():
    from kernels_pallas.decode_attention import runs_plan_bytes

    k = jax.ShapeDtypeStruct((1, 2, 400, 8), jnp.float32)
    st = np.array([[[0, 100, 200], [0, 0, 0]]])
    ln = np.array([[[40, 3, 0], [17, 0, 0]]])  # 40 rows, 3 -> a 16-row window, 0 -> nothing; 17 rows
    row = 2 * 8 * 4
    assert runs_plan_bytes(k, st, ln, block_size=16, num_heads=4) == (40 + 16 + 17) * row + 4 * 8 * 4 + 4 * 10 * 4


@pytest.mark.parametrize("seed", range(3))
def test_run_windows_without_a_search_loop_on_accelerators(seed, monkeypatch):
    """``run_windows`` finds each window's run by a binary search on CPU and by comparing every window with every
    run end on GPU/TPU (no loop): the same windows, here with the backend faked for that one function."""
    from kernels_pallas.decode_attention import xla

    r = np.random.default_rng(seed)
    b, hkv, g, s, bs = 2, 2, 3, 57, 4
    starts, lens = _random_runs(r, b, hkv, g, s, per_query=bool(seed % 2))
    want = xla.run_windows(jnp.asarray(starts), jnp.asarray(lens), bs, -(-s // bs) + starts.shape[-1])

    def jaxpr():  # a fresh function: make_jaxpr caches a function's trace
        return str(
            jax.make_jaxpr(lambda st, ln: xla.run_windows(st, ln, bs, 30))(jnp.asarray(starts), jnp.asarray(lens))
        )

    assert "scan" in jaxpr()  # the CPU's binary search
    monkeypatch.setattr(xla.jax, "default_backend", lambda: "gpu")
    got = xla.run_windows(jnp.asarray(starts), jnp.asarray(lens), bs, -(-s // bs) + starts.shape[-1])
    assert "scan" not in jaxpr() and "while" not in jaxpr()
    for x, y in zip(got, want):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
