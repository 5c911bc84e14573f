"""Every Pallas kernel, and one whole engine decode step, lowers for its hardware: exported from this CPU-only
jaxlib with ``jax.export`` for ``platforms=["cuda"]`` (the ``pallas_gpu`` kernels) and ``["tpu"]`` (the
``pallas_tpu`` kernels), so a lowering break is caught in CI without a device.

What this checks: exporting runs the real Pallas lowering for the target, the Triton lowering for ``cuda`` (the
Triton IR is embedded in a ``__gpu$xla.gpu.triton`` custom call) and the Mosaic lowering for ``tpu`` (a
``tpu_custom_call``). It does not run the final compile (Triton to PTX; Mosaic's layout passes and VMEM
checks), which happens on the device. Kernels are found in the module by their ``pallas_call`` name. Inputs are
``jax.ShapeDtypeStruct``s (``jax.eval_shape`` for the model and the caches), so Llama-3.1-8B sizes allocate
nothing. Shapes: SmolLM2's heads (9 query / 3 KV, head_dim 64) and Llama-3.1-8B's (32 / 8, 128), bf16 and fp32,
odd buffer lengths, per-sequence lengths and block lists. The numbers are checked elsewhere: interpret mode on
CPU (the other files here) and compiled on a device (tests/accelerator).

Prefill attention (``kvjax.model.prefill_attention``): its ``splash`` path (jax's Pallas splash-attention kernel) is
exported for ``tpu`` the same way. Its ``cudnn`` path cannot be exported from a CPU-only jaxlib: jax refuses to
build the cuDNN call without cuDNN ("cuDNN is not detected."), which ``test_prefill_attention_cudnn_export``
checks (and, where the CUDA plugin is installed, the export itself).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas.accumulated_attention import accumulated_attention
from kernels_pallas.chunked_similarity import chunk_best_match
from kernels_pallas.cosine_kmeans import lloyd_step
from kernels_pallas.decode_attention import ENV_IMPL, decode_attention
from kernels_pallas.pq_lookup import pq_lookup
from kvjax.engine import core
from kvjax import engine, methods
from kvjax import model as M
from kvjax.config import ModelConfig, RopeConfig
from kvjax.methods.base import Capacity
from kvjax.model.prefill_attention import prefill_attention
from methods_table import own_kernels

S = jax.ShapeDtypeStruct
PLATFORMS = [("cuda", "pallas_gpu", "gpu"), ("tpu", "pallas_tpu", "tpu")]  # (export platform, impl, name suffix)
HEADS = {"smollm2": (9, 3, 64), "llama31_8b": (32, 8, 128)}  # query heads, KV heads, head_dim
DTYPES = [jnp.bfloat16, jnp.float32]
CHECKS = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]  # not in export's stable list


def exported_kernels(f, args, platform: str) -> list[str]:
    """Export ``jit(f)(*args)`` for ``platform``; the sorted ``pallas_call`` names in the module."""
    text = jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=CHECKS)(*args).mlir_module()
    assert ("tpu_custom_call" in text) if platform == "tpu" else ("__gpu$xla.gpu.triton" in text)
    return sorted(set(re.findall(r'name = "(\w+_(?:tpu|gpu))"', text)))


@pytest.mark.parametrize("platform,impl,suffix", PLATFORMS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_exports(platform, impl, suffix, heads, dtype):
    hq, hkv, d = HEADS[heads]
    b, s = 2, 1087  # odd capacity (1024-token bucket + 63 decode steps): a ragged last block
    q, kv = S((b, hq, d), dtype), S((b, hkv, s, d), dtype)
    valid, bias = S((b, hkv, s), jnp.bool_), S((b, hkv, s), jnp.float32)
    lengths = S((b,), jnp.int32)
    blocks, shared_blocks = S((b, hkv, 5), jnp.int32), S((b, 3), jnp.int32)  # -1-padded lists ([B, Hkv, N], [B, N])
    calls = [
        (lambda q, k, v: decode_attention(q, k, v, impl=impl), (q, kv, kv)),
        (lambda q, k, v, n: decode_attention(q, k, v, lengths=n, impl=impl), (q, kv, kv, lengths)),
        (
            lambda q, k, v, va, bs, n, bi: decode_attention(q, k, v, va, n, bs, bi, impl=impl),
            (q, kv, kv, valid, bias, lengths, blocks),
        ),
        (
            lambda q, k, v, n, bi: decode_attention(q, k, v, lengths=n, block_indices=bi, impl=impl),
            (q, kv, kv, lengths, shared_blocks),
        ),
    ]
    for f, args in calls:
        assert exported_kernels(f, args, platform) == [f"decode_attention_{suffix}"]


@pytest.mark.parametrize("platform,impl,suffix", PLATFORMS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_similarity_exports(platform, impl, suffix, heads, dtype):
    _, hkv, d = HEADS[heads]
    for m, chunk in ((1024, 256), (96, 16)):  # Chelsea's default chunk; a small one
        args = (S((2, hkv, m, d), dtype), S((2, hkv, m), jnp.bool_))
        f = functools.partial(chunk_best_match, chunk=chunk, impl=impl)
        assert exported_kernels(f, args, platform) == [f"chunk_best_match_{suffix}"]


@pytest.mark.parametrize("platform,impl,suffix", PLATFORMS)
@pytest.mark.parametrize("heads", HEADS)
def test_pq_lookup_exports(platform, impl, suffix, heads):
    hq, hkv, _ = HEADS[heads]
    g = hq // hkv
    for m, bits, s in ((2, 6, 1087), (2, 6, 4096), (4, 8, 1536)):  # the paper's m=2, b=6; ragged and aligned S
        args = (S((2, hkv, g, m, 2**bits), jnp.float32), S((2, hkv, m, s), jnp.uint8), S((2,), jnp.int32))
        f = functools.partial(pq_lookup, impl=impl)
        assert exported_kernels(f, args, platform) == [f"pq_lookup_{suffix}"]


@pytest.mark.parametrize("platform,impl,suffix", PLATFORMS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cosine_kmeans_exports(platform, impl, suffix, heads, dtype):
    _, hkv, d = HEADS[heads]
    n = 2 * hkv  # batch x KV heads clusterings
    for rows, c in ((1057, 13), (4000, 400)):  # ClusterKV's L/80 clusters; 400 as at 32k tokens
        args = (S((n, rows, d), dtype), S((n, c, d), jnp.float32), S((n, rows), jnp.bool_), S((n, c), jnp.bool_))
        f = functools.partial(lloyd_step, impl=impl)
        assert exported_kernels(f, args, platform) == [f"centroid_update_{suffix}", f"cosine_assign_{suffix}"]


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulated_attention_exports(heads, dtype):
    """H2O's prompt pass (the causal forward with each row's log-sum-exp, then the column sums) for ``cuda``: a
    4099-token prompt (a ragged last block) of 2 sequences, with ``v`` (attention and scores) and without (scores
    only). No TPU kernel: a TPU runs the XLA path."""
    hq, hkv, d = HEADS[heads]
    b, t = 2, 4099
    q, kv, n = S((b, hq, t, d), dtype), S((b, hkv, t, d), dtype), S((b,), jnp.int32)
    both = functools.partial(accumulated_attention, impl="pallas_gpu")
    scores = lambda q, k, n: accumulated_attention(q, k, None, n, impl="pallas_gpu")[1]  # noqa: E731
    want = ["prompt_columns_gpu", "prompt_forward_gpu"]
    assert exported_kernels(both, (q, kv, kv, n), "cuda") == want
    assert exported_kernels(scores, (q, kv, n), "cuda") == want


# ---------------------------------------------------------------------------------------------- decode step

MODELS = {  # a few layers of each; random weights, only their shapes are used
    "llama31_8b": (
        ModelConfig(
            model_type="llama",
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=3,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rms_norm_eps=1e-5,
            rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0),
            max_position_embeddings=131072,
        ),
        jnp.bfloat16,
    ),
    "smollm2": (
        ModelConfig(
            model_type="llama",
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_layers=3,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            tie_word_embeddings=True,
            rope=RopeConfig(theta=100000.0),
            max_position_embeddings=8192,
        ),
        jnp.float32,
    ),
}
# The kernels each method's decode step calls. H2O and LESS attend in pure JAX (they need per-slot weights);
#: Decode steps of the exported loop: past ClusterKV's 320-token window, so the step re-clusters (its K-means
#: kernels) as every method's default options run it.
STEPS = 330


def step_method(name: str, impl: str):
    """``name`` at its default options, budget 0.2 of the 1024-token bucket (none for ``full``), ``impl`` for its
    own kernels (``methods_table.own_kernels``)."""
    opts = {"impl": impl} if own_kernels(methods.REGISTRY[name]) else {}
    return methods.at_budget(name, 0.2, **opts)


@pytest.mark.parametrize("platform,impl,suffix", PLATFORMS)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", methods.names())
def test_decode_step_exports(monkeypatch, platform, impl, suffix, model, name):
    """``core.decode_step`` (the body of ``engine.decode_step`` and of the compiled loop) for 2 sequences,
    a 1024-token bucket and ``STEPS`` decode steps. The decode-attention impl is chosen by
    ``KVJAX_DECODE_ATTENTION_IMPL`` (``impl=None`` would pick ``xla`` by this CPU backend), the methods' own kernels
    by their ``impl`` option."""
    cfg, dtype = MODELS[model]
    monkeypatch.setenv(ENV_IMPL, impl)
    method = step_method(name, impl)
    b = 2
    params = jax.eval_shape(lambda: M.random_params(cfg, jax.random.PRNGKey(0), dtype))
    states = jax.eval_shape(lambda: engine.init_states(cfg, method, b, Capacity(1024, STEPS), dtype))
    token = pos = S((b,), jnp.int32)
    step = functools.partial(core.decode_step, cfg, method)  # a fresh function: no trace cached under xla
    want = methods.REGISTRY[name].step_kernels
    if not want:
        text = jax.export.export(jax.jit(step), platforms=[platform])(params, states, token, pos).mlir_module()
        assert "tpu_custom_call" not in text and "triton" not in text
        return
    assert exported_kernels(step, (params, states, token, pos), platform) == sorted(f"{k}_{suffix}" for k in want)


# ------------------------------------------------------------------------------------------- prefill attention

PREFILL_T = 4099  # a 4096-token prompt plus a ragged tail: padded to the 512-token splash block


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 4096])
def test_prefill_attention_splash_exports(heads, dtype, window):
    """``kvjax.model.prefill_attention`` with ``impl="splash"`` (jax's splash-attention kernel) for ``tpu``: two
    right-padded sequences (segment ids), causal or a sliding window (``LocalMask``), GQA through one
    multi-head kernel."""
    hq, hkv, d = HEADS[heads]
    b = 2
    args = (
        S((b, hq, PREFILL_T, d), dtype),
        S((b, hkv, PREFILL_T, d), dtype),
        S((b, hkv, PREFILL_T, d), dtype),
        S((b,), jnp.int32),
    )
    f = functools.partial(prefill_attention, sliding_window=window, impl="splash")
    text = jax.export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()
    assert "tpu_custom_call" in text
    assert sorted(set(re.findall(r'name = "(splash\w+)"', text))) == ["splash_mha_fwd_segmented_no_residuals"]


@pytest.mark.slow
def test_prefill_attention_splash_exports_64k():
    """A 64k-token Llama-3.1-8B-heads prefill (one sequence, bf16) lowers for ``tpu`` (building the 64k mask's
    block tables takes about 7 s of numpy on this CPU)."""
    hq, hkv, d = HEADS["llama31_8b"]
    t = 65536 + 7
    args = (
        S((1, hq, t, d), jnp.bfloat16),
        S((1, hkv, t, d), jnp.bfloat16),
        S((1, hkv, t, d), jnp.bfloat16),
        S((1,), jnp.int32),
    )
    text = jax.export.export(jax.jit(functools.partial(prefill_attention, impl="splash")), platforms=["tpu"])(
        *args
    ).mlir_module()
    assert "splash_mha_fwd_segmented_no_residuals" in text


def test_prefill_attention_cudnn_export():
    """``impl="cudnn"`` for ``cuda``. jax builds the cuDNN call only where cuDNN is installed: from a CPU jaxlib
    (no CUDA plugin) ``jax.export`` raises ``RuntimeError("cuDNN is not detected.")`` before lowering, so this
    CPU run can only check that reason; with the CUDA plugin installed it checks the fused-attention custom call
    (``__cudnn$fmha...``). The kernel's numbers are checked on a GPU (tests/accelerator/test_prefill.py)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_lowering

    hq, hkv, d = HEADS["llama31_8b"]
    b = 2
    args = (
        S((b, hq, PREFILL_T, d), jnp.bfloat16),
        S((b, hkv, PREFILL_T, d), jnp.bfloat16),
        S((b, hkv, PREFILL_T, d), jnp.bfloat16),
        S((b,), jnp.int32),
    )
    f = functools.partial(prefill_attention, sliding_window=4096, impl="cudnn")
    export = jax.export.export(jax.jit(f), platforms=["cuda"])
    if cudnn_lowering.cuda_versions is None:
        with pytest.raises(RuntimeError, match="cuDNN is not detected"):
            export(*args)
        return
    assert "__cudnn$fmha" in export(*args).mlir_module()


@pytest.mark.parametrize("model", MODELS)
def test_prefill_step_exports_splash(monkeypatch, model):
    """``core.prefill`` (3 layers, 2 sequences in a 1024-token bucket, the ``full`` method) for ``tpu`` with
    ``KVJAX_PREFILL_ATTENTION_IMPL=splash``: the engine's prefill attention goes through the splash kernel."""
    from kvjax.model.prefill_attention import ENV_IMPL as PREFILL_ENV

    cfg, dtype = MODELS[model]
    monkeypatch.setenv(PREFILL_ENV, "splash")
    method = methods.get("full")
    b, t = 2, 1024
    params = jax.eval_shape(lambda: M.random_params(cfg, jax.random.PRNGKey(0), dtype))
    states = jax.eval_shape(lambda: engine.init_states(cfg, method, b, Capacity(t, 63), dtype))
    prefill = functools.partial(core.prefill, cfg, method)  # a fresh function: no trace cached under chunked
    text = jax.export.export(jax.jit(prefill), platforms=["tpu"])(
        params, S((b, t), jnp.int32), S((b,), jnp.int32), states
    ).mlir_module()
    assert text.count('name = "splash_mha_fwd_segmented_no_residuals"') >= 1
