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


@pytest.mark.parametrize("seed", range(4))
def test_every_chunking_matches_the_reference(seed):
    r = np.random.default_rng(seed)
    for _ in range(12):
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
