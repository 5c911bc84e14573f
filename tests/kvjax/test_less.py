"""LESS (kvjax.methods.less) against the NumPy reference ``ref_less.py``: kernel maps, zero state = sparse
policy (bit-exact), H/z = Σ over the evicted set and Eq. (3) outputs, decode = parallel form, an exact
kernel recovers full attention, engine integration (no retrace, memory), kernel files and bad input."""

from __future__ import annotations

import functools
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import engine, methods
from kvjax.methods import less as L
from kvjax.methods.base import Capacity

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_less as ref  # noqa: E402

D = 8
HQ, HKV = 4, 2
phi_jit, psi_jit = jax.jit(L.mlp_phi), jax.jit(L.mlp_psi)
B = 2
POLICIES = ["h2o", "lambda"]


def model_cfg(hq=HQ, hkv=HKV, d=D, layers=1):
    return kvjax.ModelConfig(
        model_type="llama",
        vocab_size=32,
        hidden_size=32,
        intermediate_size=32,
        num_layers=layers,
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
    )


def rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@functools.lru_cache(maxsize=None)
def strong_kernels(rank=4, hidden=16, seed=0):
    """MLP kernels with scales raised from the 1e-4 warm start, so the low-rank term matters."""
    p = L.init_kernels(model_cfg(), jax.random.PRNGKey(seed), rank, hidden)
    return {**p, "k_s1": p["k_s1"] * 3e3, "k_s2": p["k_s2"] * 2e3}


def run(method, kernels, q, k, v, prompt_len, lengths, steps):
    """Prefill ``prompt_len`` bucket tokens (real ``lengths``), then decode ``steps`` tokens; returns the outputs
    ``[B, Hq, steps, D]`` and the final state."""
    cfg = model_cfg()
    st = method.init(cfg, q.shape[0], Capacity(prompt_len, steps), 0, jnp.float32)
    if kernels is not None:
        st = st.replace(kernels=kernels)
    lengths = jnp.asarray(lengths, jnp.int32)
    st = jax.jit(method.prefill, static_argnums=1)(
        st,
        0,
        jnp.asarray(q[:, :, :prompt_len]),
        jnp.asarray(k[:, :, :prompt_len]),
        jnp.asarray(v[:, :, :prompt_len]),
        lengths,
    )
    dec = jax.jit(method.decode, static_argnums=1)
    outs = []
    for i in range(steps):
        t = prompt_len + i
        o, st = dec(st, 0, jnp.asarray(q[:, :, t]), jnp.asarray(k[:, :, t]), jnp.asarray(v[:, :, t]), lengths + i)
        outs.append(np.asarray(o))
    return np.stack(outs, 2), st


def test_kernel_maps_match_numpy_and_warm_start():
    p = strong_kernels()
    q, k = rand((3, HQ, 5, D), 1), rand((3, HKV, 5, D), 2)
    phq, psk = np.asarray(phi_jit(p, jnp.asarray(q))), np.asarray(psi_jit(p, jnp.asarray(k)))
    assert phq.shape == (3, HQ, 5, 4) and psk.shape == (3, HKV, 5, 4)
    assert (phq >= 0).all() and (psk >= 0).all()
    pn = {n: np.asarray(a) for n, a in p.items()}
    np.testing.assert_allclose(phq[1, :, 2], ref.phi(pn, q[1, :, 2]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(psk[2, :, 4], ref.psi(pn, k[2, :, 4]), rtol=1e-5, atol=1e-6)
    fresh = L.init_kernels(model_cfg(), jax.random.PRNGKey(0), rank=8, hidden=512)  # defaults
    assert fresh["q_w1"].shape == (HQ, D, 512) and fresh["k_w3"].shape == (HKV, 8, 8)
    np.testing.assert_array_equal(np.asarray(fresh["k_s1"]), np.full((HKV, 8), 1e-4, np.float32))
    # dropout is active only when not deterministic
    mod = L.module_for(p)
    a = jax.jit(lambda p, x: mod.apply({"params": p}, x, False, method="phi", rngs={"dropout": jax.random.PRNGKey(1)}))(
        p, jnp.asarray(q)
    )
    assert not np.allclose(np.asarray(a), phq)


@pytest.mark.parametrize("policy", POLICIES)
def test_zero_state_equals_sparse_policy_exactly(policy):
    t, steps = 24, 10
    q, k, v = rand((B, HQ, t + steps, D), 3), rand((B, HKV, t + steps, D), 4), rand((B, HKV, t + steps, D), 5)
    zero = lambda kern, x: jnp.zeros(x.shape[:-1] + (4,), jnp.float32)  # noqa: E731  ψ ≡ 0 keeps H = z = 0
    m = L.Less(policy=policy, budget=9, rank=4, hidden=16, psi_fn=zero)
    out, st = run(m, strong_kernels(), q, k, v, t, [t, 17], steps)
    sparse = m.sparse
    cfg = model_cfg()
    s = sparse.init(cfg, B, Capacity(t, steps), 0, jnp.float32)
    s = sparse.prefill(
        s, 0, jnp.asarray(q[:, :, :t]), jnp.asarray(k[:, :, :t]), jnp.asarray(v[:, :, :t]), jnp.asarray([t, 17])
    )
    dec = jax.jit(sparse.decode, static_argnums=1)
    for i in range(steps):
        o, s = dec(
            s,
            0,
            jnp.asarray(q[:, :, t + i]),
            jnp.asarray(k[:, :, t + i]),
            jnp.asarray(v[:, :, t + i]),
            jnp.asarray([t, 17]) + i,
        )
        np.testing.assert_array_equal(out[:, :, i], np.asarray(o))
    np.testing.assert_array_equal(np.asarray(st.sparse.pos), np.asarray(s.pos))
    assert not np.asarray(st.H).any() and not np.asarray(st.z).any()


@pytest.mark.parametrize("fold_chunk", [2048, 5])
@pytest.mark.parametrize("policy", POLICIES)
def test_state_is_sum_over_evicted_set_and_outputs_match_eq3(policy, fold_chunk):
    """Prefill evicts in bulk, then decode; H, z, and every output against the NumPy reference (Eqs. 3-6).
    ``fold_chunk=5``: the prefill fold runs in 4 steps over the 16-token bucket (the last one ragged)."""
    t, steps, budget, lengths = 16, 8, 7, [16, 11]
    q, k, v = rand((B, HQ, t + steps, D), 6), rand((B, HKV, t + steps, D), 7), rand((B, HKV, t + steps, D), 8)
    p = strong_kernels()
    m = L.Less(policy=policy, budget=budget, rank=4, hidden=16, fold_chunk=fold_chunk)
    out, st = run(m, p, q, k, v, t, lengths, steps)
    pn = {n: np.asarray(a, np.float64) for n, a in p.items()}
    recent = m.sparse.recent_tokens(budget) if policy == "h2o" else 0
    for b in range(B):
        seq = ref.LessSeq(policy, HQ, HKV, budget, recent, 4, pn)
        n = lengths[b]
        seq.prefill(q[b], k[b], v[b], n)
        ref_out = []
        for i in range(steps):  # bucket positions beyond n are padding; decode positions continue at n + i
            ref_out.append(seq.decode(q[b, :, t + i], k[b, :, t + i], v[b, :, t + i], n + i))
        np.testing.assert_allclose(out[b], np.stack(ref_out, 1), rtol=2e-4, atol=2e-5)
        hs, zs = seq.state()
        for h in range(HKV):
            assert hs[h] is not None  # something was evicted in every head
            np.testing.assert_allclose(np.asarray(st.H[b, h]), hs[h], rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(np.asarray(st.z[b, h]), zs[h], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("policy", POLICIES)
def test_decode_equals_parallel_form(policy):
    """Token-by-token decode (1-token prompt) = row i of the parallel masked form used in training; the
    parallel form and its H2O mask against the NumPy reference."""
    s = 20
    q, k, v = rand((B, HQ, s, D), 9), rand((B, HKV, s, D), 10), rand((B, HKV, s, D), 11)
    p = strong_kernels()
    m = L.Less(policy=policy, budget=7, rank=4, hidden=16)
    out, _ = run(m, p, q, k, v, 1, [1, 1], s - 1)
    mask = m.parallel_mask(jnp.asarray(q), jnp.asarray(k))
    phq, psk = phi_jit(p, jnp.asarray(q)), psi_jit(p, jnp.asarray(k))
    par = np.asarray(jax.jit(L.parallel_attention)(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, phq, psk))
    np.testing.assert_allclose(out, par[:, :, 1:], rtol=1e-4, atol=1e-5)
    mask = np.asarray(mask)
    if policy == "h2o":
        np.testing.assert_array_equal(mask[0], ref.h2o_rows(q[0], k[0], 7, m.sparse.recent_tokens(7)))
    held = 8 if policy == "h2o" else 7  # H2O: budget + the current token; Λ: budget slots, current included
    assert (mask.sum(-1) == np.minimum(np.arange(s) + 1, held)).all()
    np.testing.assert_allclose(
        par[1], ref.parallel(q[1], k[1], v[1], mask[1], np.asarray(phq[1]), np.asarray(psk[1])), rtol=1e-4, atol=1e-5
    )


def _oracle(kappa):
    """φ(q)_m = exp(q·κ_m/√D) and ψ(k) = one-hot(id of k among κ): φ(q)·ψ(k) = exp(q·k/√D) exactly."""

    def phi_fn(kern, x):
        return jnp.exp(jnp.einsum("...d,md->...m", x.astype(jnp.float32), kern["kappa"]) / math.sqrt(D))

    def psi_fn(kern, x):
        d2 = jnp.sum(jnp.square(x.astype(jnp.float32)[..., None, :] - kern["kappa"]), -1)
        return jax.nn.one_hot(jnp.argmin(d2, -1), kern["kappa"].shape[0], dtype=jnp.float32)

    return phi_fn, psi_fn


@pytest.mark.parametrize("policy", POLICIES)
def test_exact_kernel_recovers_full_attention(policy):
    mm, t, steps = 5, 12, 9
    kappa = rand((mm, D), 12) * 0.7
    ids = np.random.default_rng(13).integers(0, mm, (B, HKV, t + steps))
    q, v = rand((B, HQ, t + steps, D), 14) * 0.7, rand((B, HKV, t + steps, D), 15)
    k = kappa[ids]
    phi_fn, psi_fn = _oracle(jnp.asarray(kappa))
    m = L.Less(policy=policy, budget=6, rank=mm, hidden=4, phi_fn=phi_fn, psi_fn=psi_fn)
    out, _ = run(m, {"kappa": jnp.asarray(kappa)}, q, k, v, t, [t, t], steps)
    g = HQ // HKV
    for i in range(steps):
        n = t + i + 1
        for qh in range(HQ):
            s = np.einsum("bd,bsd->bs", q[:, qh, n - 1], k[:, qh // g, :n]) / math.sqrt(D)
            p = np.exp(s - s.max(-1, keepdims=True))
            full = np.einsum("bs,bsd->bd", p / p.sum(-1, keepdims=True), v[:, qh // g, :n])
            np.testing.assert_allclose(out[:, qh, i], full, rtol=1e-4, atol=1e-5)
    # the parallel form too, on the whole sequence
    mask = m.parallel_mask(jnp.asarray(q), jnp.asarray(k))
    kap = {"kappa": jnp.asarray(kappa)}
    par = jax.jit(L.parallel_attention)(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, phi_fn(kap, jnp.asarray(q)), psi_fn(kap, jnp.asarray(k))
    )
    full = kvjax.model.causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    np.testing.assert_allclose(np.asarray(par), np.asarray(full), rtol=1e-4, atol=1e-5)


def test_engine_generates_without_retrace_and_reports_memory():
    cfg = model_cfg(layers=2)
    params = kvjax.model.random_params(cfg, jax.random.PRNGKey(0), scale=0.3)
    model = kvjax.Model(cfg, params, None, "tiny")
    m = methods.get("less", policy="h2o", budget=6, rank=4, hidden=16)
    assert isinstance(m, L.Less)
    prompts = [list(range(1, 14)), list(range(3, 9))]
    engine.TRACE_COUNTS.clear()
    res = engine.generate(model, prompts, m, max_new_tokens=6, driver="python", stop_at_eos=False)
    assert engine.TRACE_COUNTS["decode_step"] == 1 and all(len(t) == 6 for t in res.tokens)
    st = m.init(cfg, 2, Capacity(32, 6), 0, jnp.float32)
    sparse = m.sparse.init(cfg, 2, Capacity(32, 6), 0, jnp.float32)
    assert m.memory_bytes(st) == (sum(x.nbytes for x in jax.tree.leaves(sparse)) + 2 * HKV * 4 * (D + 1) * 4)
    # fresh kernels start at the 1e-4 warm start: LESS ~ the sparse policy
    base = engine.generate(
        model, prompts, methods.get("h2o", budget=6), max_new_tokens=6, driver="python", stop_at_eos=False
    )
    assert res.tokens == base.tokens


def _write_kernels(folder, cfg, rank=4, hidden=16):
    arrays = {
        n: np.stack([np.asarray(a)] * cfg.num_layers)
        for n, a in L.init_kernels(cfg, jax.random.PRNGKey(0), rank, hidden).items()
    }
    arrays["k_s1"] = arrays["k_s1"] * 0 + 0.5
    folder.mkdir()
    np.savez(folder / L.KERNELS_FILE, **arrays)
    (folder / L.CONFIG_FILE).write_text(json.dumps({"format": L.FORMAT, "model": L.model_identity(cfg, "tiny")}))


def test_loading_kernels_and_refusing_other_layouts(tmp_path):
    cfg = model_cfg(layers=2)
    _write_kernels(tmp_path / "k", cfg)
    m = methods.get("less", policy="lambda", budget=8, kernels=str(tmp_path / "k"))
    st = m.init(cfg, 1, Capacity(16, 4), 1, jnp.float32)
    assert st.H.shape == (1, HKV, 4, D)
    np.testing.assert_array_equal(np.asarray(st.kernels["k_s1"]), np.full((HKV, 4), 0.5, np.float32))
    with pytest.raises(ValueError, match="head layout.*num_kv_heads"):
        m.init(model_cfg(hq=4, hkv=4, layers=2), 1, Capacity(16, 4), 0, jnp.float32)
    with pytest.raises(ValueError, match="num_layers"):
        m.init(model_cfg(layers=3), 1, Capacity(16, 4), 0, jnp.float32)
    with pytest.raises(FileNotFoundError, match="kvjax-train-less"):
        methods.get("less", kernels=str(tmp_path / "missing"))


def test_bad_input():
    with pytest.raises(ValueError, match="policy='tova'"):
        methods.get("less", policy="tova")
    with pytest.raises(ValueError, match="budget"):
        methods.get("less", budget=0)
    with pytest.raises(ValueError, match="fraction"):
        L.Less(budget=0.1).parallel_mask(jnp.zeros((1, 2, 4, 2)), jnp.zeros((1, 1, 4, 2)))


def test_model_defaults_are_the_shipped_kernels_and_quiet_only_their_budget_warning():
    """``eval.cli.model_defaults("less", model)`` (the command line's registry of per-method model defaults, which
    ``kvjax-eval main`` reads instead of a special case for ``"less"``): the kernels shipped for an embedded model,
    and a warning pattern that silences their trained-at-another-budget warning, not a policy mismatch; none
    elsewhere."""
    import warnings

    from eval.cli import model_defaults
    from kvjax.loading import assets

    assert model_defaults("less", "no/such-model") == ({}, ())
    assert all(model_defaults(n, assets.SMOLLM2_NAME) == ({}, ()) for n in methods.names() if n != "less")
    for model, shipped in assets.LESS_KERNELS.items():
        defaults, expected = model_defaults("less", model)
        assert defaults == {"kernels": str(shipped)} and len(expected) == 1
        for budget, policy, quiet in ((0.3, "h2o", True), (77, "h2o", True), (0.3, "lambda", False)):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                warnings.filterwarnings("ignore", message=expected[0])
                methods.get("less", budget=budget, policy=policy, **defaults)
            assert (not seen) == quiet, (model, budget, policy, [str(w.message) for w in seen])
