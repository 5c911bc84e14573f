"""Decode attention: both Pallas kernels in interpret mode against the pure-JAX reference (the three tiers:
docs/architecture.md#three-kernel-tiers).

The reference itself is checked once against a plain numpy softmax attention (``_numpy_attention``).
Cases cover GQA ratios 1/3/4/8, odd slot counts (ragged last block), odd lengths, empty and full masks, bias,
selected-block subsets (with ``-1`` pads, repeats, ``[B, N]`` form), bf16 inputs and TPU-legal block shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import decode_attention as da
from kernels_pallas.decode_attention import (
    NEG_INF,
    check_block_shape,
    decode_attention,
    decode_attention_reference,
    merge,
    normalise,
    pallas_gpu,
)

PALLAS = ("pallas_tpu", "pallas_gpu")


def _inputs(b, hkv, g, s, d, dtype=jnp.float32, seed=0):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.standard_normal((b, hkv * g, d)), dtype)
    k = jnp.asarray(r.standard_normal((b, hkv, s, d)), dtype)
    v = jnp.asarray(r.standard_normal((b, hkv, s, d)), dtype)
    return r, q, k, v


def _case(name):
    if name == "g1_odd_valid_bias_lengths":
        r, q, k, v = _inputs(2, 2, 1, 200, 64)
        return (
            q,
            k,
            v,
            dict(
                valid=jnp.asarray(r.random((2, 2, 200)) < 0.7),
                bias=jnp.asarray(np.log(r.integers(1, 9, (2, 2, 200))), jnp.float32),
                lengths=jnp.array([200, 77]),
            ),
        )
    if name == "g3_block_subset":
        r, q, k, v = _inputs(2, 2, 3, 256, 64, seed=1)
        bi = jnp.array([[[1, -1, 1], [0, 1, -1]], [[-1, -1, -1], [1, 0, 0]]], jnp.int32)  # pads, repeats, none
        return q, k, v, dict(valid=jnp.asarray(r.random((2, 2, 256)) < 0.8), block_indices=bi)
    if name == "g4_lengths_only_2d_blocks":
        r, q, k, v = _inputs(2, 1, 4, 300, 64, seed=2)
        return q, k, v, dict(lengths=jnp.array([0, 259]), block_indices=jnp.array([[2, 0], [2, 0]], jnp.int32))
    if name == "g8_empty_and_full_mask_tpu_legal":
        _, q, k, v = _inputs(2, 1, 8, 256, 128, seed=3)
        return q, k, v, dict(valid=jnp.stack([jnp.zeros((1, 256), bool), jnp.ones((1, 256), bool)]))
    raise KeyError(name)


CASES = (
    "g1_odd_valid_bias_lengths",
    "g3_block_subset",
    "g4_lengths_only_2d_blocks",
    "g8_empty_and_full_mask_tpu_legal",
)


def _numpy_attention(q, k, v, mask, bias):
    """Softmax attention ``[B, Hq, D]`` in float64 numpy, zero for rows with no valid slot."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, hq, d = q.shape
    hkv = k.shape[1]
    out = np.zeros((b, hq, d))
    for bi in range(b):
        for hi in range(hq):
            h = hi // (hq // hkv)
            sel = np.asarray(mask[bi, h])
            if not sel.any():
                continue
            sc = k[bi, h][sel] @ q[bi, hi] / np.sqrt(d) + np.asarray(bias[bi, h], np.float64)[sel]
            p = np.exp(sc - sc.max())
            out[bi, hi] = p @ v[bi, h][sel] / p.sum()
    return out


def test_reference_matches_numpy_softmax():
    q, k, v, kw = _case("g1_odd_valid_bias_lengths")
    mask = np.asarray(kw["valid"]) & (np.arange(200)[None, None, :] < np.asarray(kw["lengths"])[:, None, None])
    got = normalise(decode_attention_reference(q, k, v, **kw))
    np.testing.assert_allclose(np.asarray(got), _numpy_attention(q, k, v, mask, kw["bias"]), rtol=1e-5, atol=1e-5)
    # block subset: reference keeps exactly the listed blocks
    q, k, v, kw = _case("g3_block_subset")
    listed = np.zeros((2, 2, 256), bool)
    for bi, hi, blk in np.argwhere(np.ones((2, 2, 3), bool)):
        idx = int(kw["block_indices"][bi, hi, blk])
        if idx >= 0:
            listed[bi, hi, idx * 128 : (idx + 1) * 128] = True
    got = normalise(decode_attention_reference(q, k, v, **kw))
    want = _numpy_attention(q, k, v, listed & np.asarray(kw["valid"]), np.zeros((2, 2, 256)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def check_against_reference(impl, q, k, v, kw, *, interpret=True, tol=1e-5):
    """The kernel's partials equal the reference's within ``tol``; empty rows are exactly (0, NEG_INF, 0).
    Returns the reference's empty-row mask. (Also used compiled by tests/accelerator.)"""
    run = jax.jit(lambda q, k, v, kw: decode_attention(q, k, v, **kw, impl=impl, interpret=interpret))  # traced
    o, m, l = run(q, k, v, kw)
    o_r, m_r, l_r = decode_attention_reference(q, k, v, **kw)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_r), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(m), np.asarray(m_r), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(l), np.asarray(l_r), rtol=tol, atol=tol)
    empty = np.asarray(l_r) == 0
    assert np.all(np.asarray(m)[empty] == np.float32(NEG_INF)) and np.all(np.asarray(o)[empty] == 0)
    return empty


@pytest.mark.parametrize("impl", PALLAS)
@pytest.mark.parametrize("case", CASES)
def test_pallas_matches_reference_fp32(impl, case):
    empty = check_against_reference(impl, *_case(case))
    if case.startswith("g8"):
        assert empty[0].all() and not empty[1].any()  # the empty-mask row and the full-mask row


def check_bf16(impl, *, interpret=True):
    r, q, k, v = _inputs(1, 2, 4, 160, 64, dtype=jnp.bfloat16, seed=4)
    valid = jnp.asarray(r.random((1, 2, 160)) < 0.9)
    o, m, l = decode_attention(q, k, v, valid, impl=impl, interpret=interpret)
    assert o.dtype == m.dtype == l.dtype == jnp.float32
    o_r, m_r, l_r = decode_attention_reference(q, k, v, valid)
    np.testing.assert_allclose(np.asarray(m), np.asarray(m_r), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(normalise((o, m, l))), np.asarray(normalise((o_r, m_r, l_r))), rtol=2e-2, atol=2e-2
    )


@pytest.mark.parametrize("impl", PALLAS)
def test_pallas_bf16_inputs(impl):
    check_bf16(impl)


@pytest.mark.parametrize("case", ["g1_odd_valid_bias_lengths", "g8_empty_and_full_mask_tpu_legal"])
def test_gpu_kernel_with_several_blocks_per_program(case):
    """The GPU kernel with one program per (sequence, KV head) (``target_programs=1``) and blocks of 32 slots: its
    loop visits up to 8 blocks in turn, so its online softmax must rescale the running output and sum whenever a
    later block raises the max (keys grow along the slots, so it does). At the default tiling these sizes give
    each program one block, and the cases above never run that rescaling."""
    q, k, v, kw = _case(case)
    k = k * jnp.linspace(0.2, 2.0, k.shape[2])[None, None, :, None]
    got = pallas_gpu.decode_attention_gpu(q, k, v, **kw, block_size=32, interpret=True, target_programs=1)
    want = decode_attention_reference(q, k, v, **kw)
    for x, y in zip(got, want):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


def test_partials_over_block_subsets_merge_to_the_whole():
    q, k, v, kw = _case("g1_odd_valid_bias_lengths")
    a = decode_attention(q, k, v, **kw, block_indices=jnp.array([[0], [0]]), impl="pallas_tpu", interpret=True)
    b = decode_attention(q, k, v, **kw, block_indices=jnp.array([[1], [1]]), impl="pallas_tpu", interpret=True)
    whole = decode_attention_reference(q, k, v, **kw)
    np.testing.assert_allclose(np.asarray(normalise(merge(a, b))), np.asarray(normalise(whole)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_xla_matches_reference(case):
    """The XLA path (chunks / gathered blocks, kernels_pallas.decode_attention.xla) against the masked spec;
    tests/kernels_pallas/test_decode_attention_xla.py sweeps its chunking."""
    check_against_reference("xla", *_case(case))


def test_impl_none_is_xla_on_cpu(monkeypatch):
    monkeypatch.delenv(da.ENV_IMPL, raising=False)
    assert jax.default_backend() == "cpu" and da.default_impl() == "xla"
    q, k, v, kw = _case("g3_block_subset")
    for x, y in zip(decode_attention(q, k, v, **kw), decode_attention(q, k, v, **kw, impl="xla")):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    monkeypatch.setenv(da.ENV_IMPL, "pallas_gpu")
    assert da.default_impl() == "pallas_gpu"
    monkeypatch.setenv(da.ENV_IMPL, "cuda")
    with pytest.raises(ValueError, match=da.ENV_IMPL):
        da.default_impl()


def test_unknown_impl_is_an_error():
    q, k, v, kw = _case("g3_block_subset")
    with pytest.raises(ValueError, match="impl='triton'.*xla"):
        decode_attention(q, k, v, **kw, impl="triton")


def test_tpu_tiling_check_raises_like_mosaic():
    check_block_shape("k", (2, 2, 256, 64), (None, None, 128, 64))  # legal: multiple of 8 / full dim
    check_block_shape("mask", (2, 2, 1, 200), (None, None, 1, 200))  # legal: full dims
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        check_block_shape("mask", (2, 2, 1, 256), (None, None, 1, 64))
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        check_block_shape("k", (2, 2, 256, 64), (None, None, 12, 64))
    q, k, v, kw = _case("g3_block_subset")
    kw.pop("block_indices")
    with pytest.raises(ValueError, match="divisible by 8 and 128"):  # valid mask block (1, 64) of (1, 256)
        decode_attention(q, k, v, **kw, impl="pallas_tpu", block_size=64, interpret=True)


def test_bad_inputs_name_the_argument():
    q, k, v, kw = _case("g3_block_subset")
    with pytest.raises(ValueError, match="valid has shape"):
        decode_attention(q, k, v, valid=kw["valid"][:, :, :10])
    with pytest.raises(ValueError, match="lengths"):
        decode_attention(q, k, v, lengths=jnp.array([257, 3]))
    with pytest.raises(ValueError, match="block_indices range"):
        decode_attention(q, k, v, block_indices=jnp.array([[2], [0]]))
    with pytest.raises(ValueError, match="multiple of the 2 KV heads"):
        decode_attention(q[:, :5], k, v)
    with pytest.raises(ValueError, match="block_size"):
        decode_attention(q, k, v, block_size=0)
    with pytest.raises(ValueError, match="power-of-two"):
        decode_attention(q, k, v, impl="pallas_gpu", block_size=96, interpret=True)


def test_kvjax_attend_routes_through_decode_attention():
    from kvjax.model import attention

    q, k, v, kw = _case("g1_odd_valid_bias_lengths")
    got = attention.attend(q, k, v, kw["valid"], bias=kw["bias"])  # CPU: xla
    want = decode_attention_reference(q, k, v, valid=kw["valid"], bias=kw["bias"])
    for x, y in zip(got, want):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="impl='bogus'"):
        attention.attend(q, k, v, kw["valid"], impl="bogus")


@pytest.mark.parametrize("impl", ("reference", "xla") + tuple(PALLAS))
@pytest.mark.parametrize("case", ("g1_odd_valid_bias_lengths", "g8_empty_and_full_mask_tpu_legal"))
def test_learned_sinks_join_every_kernels_softmax(impl, case):
    """gpt-oss's sinks (kvjax.model.sinks): a sink logit per query head merged into each kernel's partials before
    normalising equals a NumPy softmax with the sink as one more logit (its value zero); an empty row stays 0."""
    from kvjax.model.attention import normalise as normalise_sinks

    q, k, v, kw = _case(case)
    b, hq, d = q.shape
    sinks = jnp.asarray(np.random.RandomState(7).randn(hq).astype(np.float32))
    if impl == "reference":
        part = decode_attention_reference(q, k, v, **kw)
    else:
        part = decode_attention(q, k, v, **kw, impl=impl, interpret=impl != "xla")
    got = np.asarray(normalise_sinks(part, sinks=sinks))
    s = k.shape[2]
    mask = np.ones((b, k.shape[1], s), bool) if kw.get("valid") is None else np.asarray(kw["valid"]).astype(bool)
    if kw.get("lengths") is not None:
        mask &= np.arange(s)[None, None, :] < np.asarray(kw["lengths"])[:, None, None]
    bias = np.zeros(mask.shape) if kw.get("bias") is None else np.asarray(kw["bias"], np.float64)
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    for bi in range(b):
        for hi in range(hq):
            h = hi // (hq // k.shape[1])
            sel = mask[bi, h]
            sc = np.append(kn[bi, h][sel] @ qn[bi, hi] / np.sqrt(d) + bias[bi, h][sel], float(sinks[hi]))
            p = np.exp(sc - sc.max())
            want = p[:-1] @ vn[bi, h][sel] / p.sum()
            np.testing.assert_allclose(got[bi, hi], want, rtol=1e-5, atol=1e-5)
