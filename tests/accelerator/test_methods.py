"""Every registered method (``kvjax.methods.REGISTRY``) end to end on the device with its Pallas kernels, against
the same method on the same device with the pure-JAX references (``KVJAX_DECODE_ATTENTION_IMPL=xla`` and
``impl="xla"`` for the methods that call their own kernel).

Runs only on a GPU/TPU backend: ``JAX_PLATFORMS=cuda python3 -m pytest tests/accelerator -m accelerator``
(``tpu`` on a TPU). A tiny random float32 model with SmolLM2's heads (9 query / 3 KV heads, head_dim 64), three
sequences of odd lengths in a 64-token bucket, the prefill and 6 greedy decode steps; each method's small options
(tests/methods_table.py) make it compress at these lengths (ClusterKV re-clusters and Chelsea re-compresses
inside the decode steps). Both runs are fed the reference run's tokens, so every step compares like with like:
logits within 1e-3 (absolute and relative; float32, the kernels' dots at ``HIGHEST``) and the same greedy
tokens. The compiled decode step is checked to contain the expected Pallas kernels (the method's declared
``step_kernels``), so the comparison is never reference against reference.
"""

from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.decode_attention import ENV_IMPL
from kvjax.engine import core
from kvjax import engine, methods
from kvjax.config import ModelConfig
from kvjax.methods.base import Capacity
from kvjax.model import random_params
from methods_table import own_kernels, small_at_budget


pytestmark = pytest.mark.accelerator

DRY_RUN = os.environ.get("KVJAX_ACCELERATOR_DRY_RUN") == "1"  # on CPU: both runs are the reference (plumbing only)
IMPL = "xla" if DRY_RUN else {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(jax.default_backend(), "xla")
CFG = ModelConfig("llama", 256, 128, 256, 2, 9, 3, 64, max_position_embeddings=512)
BUCKET, STEPS, LENGTHS = 64, 6, (61, 17, 40)
TOL = 1e-3


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, jax.random.PRNGKey(0), jnp.float32, scale=0.15)


def run(monkeypatch, params, name, impl, feed=None):
    """Prefill and STEPS decode steps with every kernel at ``impl``: (logits [STEPS+1, B, V], tokens, the
    Pallas kernels in the compiled decode step). ``feed``: the tokens to decode (default: this run's argmax)."""
    monkeypatch.setenv(ENV_IMPL, impl)
    opts = {"impl": impl} if own_kernels(methods.REGISTRY[name]) else {}
    m = small_at_budget(name, 0.3, **opts)
    rng = np.random.default_rng(1)
    tokens, lengths = engine.pad_prompts([list(rng.integers(1, 255, n)) for n in LENGTHS], BUCKET)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    states = engine.init_states(CFG, m, len(LENGTHS), Capacity(BUCKET, STEPS + 1), jnp.float32)
    # fresh functions: jit's caches key on (cfg, method), not on the environment variable
    prefill = jax.jit(functools.partial(core.prefill, CFG, m))
    step = jax.jit(functools.partial(core.decode_step, CFG, m))
    states, logits = prefill(params, tokens, lengths, states)
    out, pos, kernels = [logits], lengths, None
    for i in range(STEPS):
        tok = jnp.argmax(logits, -1).astype(jnp.int32) if feed is None else jnp.asarray(feed[i])
        if kernels is None:
            text = step.lower(params, states, tok, pos).as_text()
            kernels = sorted(set(re.findall(r'name = "(\w+)_(?:tpu|gpu)"', text)))
        logits, states = step(params, states, tok, pos)
        out.append(logits)
        pos = pos + 1
    out = np.stack([np.asarray(x) for x in out])
    return out, out.argmax(-1), kernels


@pytest.mark.parametrize("name", methods.names())
def test_method_with_kernels_matches_reference(monkeypatch, params, name):
    want_logits, want_tokens, none = run(monkeypatch, params, name, "xla")
    assert none == []
    assert len(set(want_tokens.ravel().tolist())) > 3  # the tokens depend on the input (no collapse)
    logits, tokens, kernels = run(monkeypatch, params, name, IMPL, feed=want_tokens)
    if not DRY_RUN:
        assert kernels == sorted(methods.REGISTRY[name].step_kernels), kernels
    np.testing.assert_allclose(logits, want_logits, rtol=TOL, atol=TOL, err_msg=f"{name} on {IMPL}")
    np.testing.assert_array_equal(tokens, want_tokens, err_msg=f"{name} on {IMPL}")
