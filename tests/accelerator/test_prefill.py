"""Prefill attention on the device: the platform's fused kernel (``cudnn`` on a GPU, ``splash`` on a TPU; see
``kvjax.model.prefill_attention``) compiled, against the pure-JAX ``chunked`` reference on the same device, and a
64k-token prefill that must run in memory linear in T.

Runs only on a GPU/TPU backend: ``JAX_PLATFORMS=cuda python3 -m pytest tests/accelerator -m accelerator``
(``tpu`` on a TPU). ``KVJAX_ACCELERATOR_DRY_RUN=1`` runs it on CPU with shrunken sizes (splash in interpret mode
for the kernel comparison, ``chunked`` for the long prefill): it checks the test code, not a kernel.

- Kernel vs reference: SmolLM2's heads (9 query / 3 KV, head_dim 64) and Llama-3.1-8B's (32 / 8, 128), bf16,
  T = 4096 + 3 (a ragged last block), two sequences of lengths T and T // 2 + 1, causal and a 1024-token sliding
  window. The reference runs in float32 on the same bf16 inputs; real query rows within 2e-2 absolute (bf16
  rounding of ``q/sqrt(D)``, of the probabilities and of the output), padded rows finite. The compiled program is
  checked to contain the kernel (``__cudnn$fmha`` or the splash ``pallas_call``), so it is never reference
  against reference.
- Long prefill: ``core.prefill`` of a one-layer model with Llama-3.1-8B's shapes (hidden 4096, 32 / 8 heads,
  MLP 14336, vocabulary 128256), bf16, one 65536-token prompt, the ``full`` method: finite logits; the device's
  peak memory (``memory_stats()["peak_bytes_in_use"]`` where the backend reports it) is printed and recorded as a
  test property, and must stay below 24 GiB (the weights are 2.3 GiB; one head's ``[T, T]`` float32 scores alone
  would be 16 GiB).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.engine import core
from kvjax import engine, methods
from kvjax import model as M
from kvjax.model import prefill_attention as P
from kvjax.config import ModelConfig, RopeConfig
from kvjax.methods.base import Capacity

pytestmark = pytest.mark.accelerator

DRY_RUN = os.environ.get("KVJAX_ACCELERATOR_DRY_RUN") == "1"
IMPL = "splash" if DRY_RUN else {"gpu": "cudnn", "tpu": "splash"}.get(jax.default_backend(), "splash")
KERNEL = {"cudnn": "__cudnn$fmha", "splash": "splash_mha_fwd_segmented"}[IMPL]
HEADS = {"smollm2": (9, 3, 64), "llama31_8b": (32, 8, 128)}  # query heads, KV heads, head_dim
T, WINDOW = (300, 100) if DRY_RUN else (4096 + 3, 1024)
LONG_T = 4096 if DRY_RUN else 65536
PEAK_LIMIT = 24 << 30


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, WINDOW])
def test_platform_impl_matches_chunked(heads, window):
    hq, hkv, d = HEADS[heads]
    r = np.random.default_rng(0)
    lengths = jnp.asarray([T, T // 2 + 1], jnp.int32)
    q, k, v = (jnp.asarray(r.standard_normal(s), jnp.bfloat16) for s in ((2, hq, T, d), (2, hkv, T, d), (2, hkv, T, d)))
    f = jax.jit(functools.partial(P.prefill_attention, sliding_window=window, impl=IMPL, interpret=DRY_RUN))
    if not DRY_RUN:  # interpret mode lowers the kernel to plain HLO
        assert KERNEL in f.lower(q, k, v, lengths).as_text()
    out = np.asarray(f(q, k, v, lengths).astype(jnp.float32))
    ref = jax.jit(functools.partial(P.prefill_attention, sliding_window=window, impl="chunked"))
    want = np.asarray(ref(*(x.astype(jnp.float32) for x in (q, k, v)), lengths))
    assert np.isfinite(out).all()
    real = (np.arange(T)[None, :] < np.asarray(lengths)[:, None])[:, None, :, None]
    np.testing.assert_allclose(np.where(real, out, 0), np.where(real, want, 0), atol=2e-2, rtol=0)


def test_long_prefill_8b_heads(record_property):
    if DRY_RUN:  # CPU: a small model, the chunked path
        cfg = ModelConfig("llama", 256, 128, 256, 1, 8, 2, 64, max_position_embeddings=LONG_T)
    else:
        cfg = ModelConfig(
            model_type="llama",
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=1,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rms_norm_eps=1e-5,
            rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0),
            max_position_embeddings=131072,
        )
    method = methods.get("full")
    params = M.random_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, LONG_T), 1, cfg.vocab_size, jnp.int32)
    lengths = jnp.asarray([LONG_T - 5], jnp.int32)
    states = engine.init_states(cfg, method, 1, Capacity(LONG_T, 8), jnp.bfloat16)
    prefill = jax.jit(functools.partial(core.prefill, cfg, method))
    if not DRY_RUN:
        assert KERNEL in prefill.lower(params, tokens, lengths, states).as_text()
    states, logits = prefill(params, tokens, lengths, states)
    assert np.isfinite(np.asarray(logits, np.float32)).all()
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    print(
        f"\n{LONG_T}-token prefill ({IMPL if not DRY_RUN else 'chunked'}, {jax.devices()[0].device_kind}): "
        f"peak {peak / 2**30:.2f} GiB"
        if peak
        else f"\n{LONG_T}-token prefill: no memory_stats on this backend"
    )
    record_property("prefill_tokens", LONG_T)
    record_property("peak_bytes_in_use", peak)
    if peak is not None and not DRY_RUN:
        assert peak < PEAK_LIMIT, f"peak {peak / 2**30:.1f} GiB for a {LONG_T}-token one-layer prefill"
