"""Where Chelsea's attention error comes from: the slots' masses (Eq. 2's ``log N``) or their averaged values.

Chelsea (Hu et al., 2025) stands a merged slot of ``N`` tokens in by its mean key ``k̂`` and mean value ``v̂`` and
weights it by ``log N`` (Eq. 2): the slot's logit ``q·k̂/√d + log N`` is the log of ``N exp(mean_i q·k_i/√d)``, where
exact attention gives the slot ``log Σ_i exp(q·k_i/√d)``. By Jensen's inequality the exact one is never smaller; the
difference (the *Jensen gap*) grows with the spread of the query's logits within the slot. This script measures it
on real prompts, and splits the attention error of the state Chelsea holds after prefill into its two sources.

The perplexity task's windows (``eval.perplexity.build``, the same windows as ``kvjax-eval perplexity`` with the
same ``--sequences/--prefix/--continuation/--book``) run through the model with full attention; at each global
layer the prompt's K/V go through Chelsea's own prefill at each budget. Which prompt tokens a slot holds is read
by merging one-hot values (Chelsea matches on keys only, and a slot's value is the count-weighted mean of its
tokens', so slot ``s``'s one-hot value is ``1/N`` on its tokens). The continuation's queries (teacher-forced, the
tokens the perplexity run scores) then attend over the prompt, per query head:

- ``exact``: ``o = Σ_i w_i v_i`` with ``w = softmax(q K^T/√d)`` over the prompt; the slot masses ``M_s = Σ_{i∈s} w_i``;
- ``chelsea``: ``Σ_s m_s v̂_s`` with ``m = softmax(q K̂^T/√d + log N)`` (Eq. 2, the state after prefill);
- ``values averaged``: ``Σ_s M_s v̂_s``, the exact masses with Chelsea's mean values;
- ``masses approximated``: ``Σ_s m_s Σ_{i∈s} (w_i / M_s) v_i``, Chelsea's masses with the exact values within a slot.

Reported per budget and layer, averaged over windows, query heads and queries: each output's relative error
``||o - o_exact|| / ||o_exact||``; the total variation ``½ Σ_s |M_s - m_s|``; the exact mass in merged slots
(``N > 1``); and, weighted by the exact mass of each merged slot, the Jensen gap in nats and the standard deviation
of the query's logits within it::

    python benchmarks/chelsea_slot_spread.py --model gemma3-270m --budgets 0.1,0.4,0.65 --sequences 2 \\
        --prefix 4096 --continuation 64 --book essays --out benchmarks/results/chelsea_slot_spread_gemma3-270m-4k.json

Writes the JSON and a markdown table beside it."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_common as bc  # noqa: E402


def decompose(q, k, v, member, k_hat, n) -> dict:
    """One KV head. ``q [G, P, D]`` the group's queries (already scaled as the model scales them), ``k, v [T, D]``
    the prompt's keys and values, ``member [S, T]`` 1 where prompt token ``t`` sits in slot ``s``, ``k_hat [S, D]``
    and ``n [S]`` Chelsea's slot keys and counts (empty slots: ``n = 0``). Returns the means over ``G, P`` of the
    quantities in the module docstring (float64 throughout)."""
    q, k, v, k_hat = (np.asarray(x, np.float64) for x in (q, k, v, k_hat))
    live = n > 0
    member, k_hat, n = member[live], k_hat[live], n[live]
    scale = 1.0 / np.sqrt(q.shape[-1])
    logits = q @ k.T * scale  # [G, P, T]
    w = bc.softmax(logits)
    slot_of = member.argmax(0)  # [T]: every prompt token sits in exactly one slot
    mass = w @ member.T  # [G, P, S] exact slot masses
    v_hat = member @ v / n[:, None]  # the slots' mean values
    m = bc.softmax(q @ k_hat.T * scale + np.log(n))  # Eq. 2's slot weights
    exact = w @ v
    outputs = {
        "chelsea": m @ v_hat,
        "values_averaged": mass @ v_hat,
        "masses_approximated": (w * np.where(mass > 0, m / np.maximum(mass, 1e-300), 0.0)[..., slot_of]) @ v,
    }
    norm = np.linalg.norm(exact, axis=-1)
    row = {f"err_{name}": float(np.mean(np.linalg.norm(o - exact, axis=-1) / norm)) for name, o in outputs.items()}
    # per slot: log Σ exp(logits) and the logits' mean and spread within it (N = 1 slots: gap and spread 0)
    top = logits.max(-1, keepdims=True)
    log_mass = np.log(np.maximum(np.exp(logits - top) @ member.T, 1e-300)) + top  # [G, P, S]
    mean_logit = logits @ member.T / n
    spread = np.sqrt(np.maximum((logits**2) @ member.T / n - mean_logit**2, 0.0))
    gap = log_mass - (mean_logit + np.log(n))  # >= 0 (Jensen); k̂ is the mean key, so q·k̂ is the mean logit
    merged = n > 1
    merged_mass = mass[..., merged].sum(-1)
    weight = np.where(merged, mass, 0.0) / np.maximum(merged_mass[..., None], 1e-30)
    row.update(
        tv=float(np.mean(0.5 * np.abs(mass - m).sum(-1))),
        merged_mass=float(np.mean(merged_mass)),
        jensen_gap=float(np.mean((weight * gap).sum(-1))),
        logit_spread=float(np.mean((weight * spread).sum(-1))),
        key_check=float(np.abs(member @ k / n[:, None] - k_hat).max()),
    )
    return row


def markdown(data: dict) -> str:
    lines = [
        "| budget | layer | error: Chelsea | exact masses, mean values | Eq. 2 masses, exact values | mass TV "
        "| mass in merged slots | Jensen gap (nats) | logit spread |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['budget']} | {r['layer']} | {r['err_chelsea']:.3f} | {r['err_values_averaged']:.3f} | "
            f"{r['err_masses_approximated']:.3f} | {r['tv']:.3f} | {r['merged_mass']:.3f} | {r['jensen_gap']:.2f} | "
            f"{r['logit_spread']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=bc.parse_budgets, default=[0.1, 0.4, 0.65], help="Chelsea's budgets")
    bc.add_window_args(p, sequences=2)  # the continuation's queries attend over the prefix
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import kvjax
    from eval import harness, perplexity
    from kvjax import engine
    from kvjax.engine import prefilled as P
    from kvjax.methods.base import Capacity

    t0 = time.perf_counter()
    model = kvjax.load_model(args.model)
    cfg, n_prompt = model.config, args.prefix
    layers = list(cfg.global_layers)
    seqs = perplexity.build(model, args.sequences, args.prefix, args.continuation, args.book)

    cap, lengths = Capacity(n_prompt, args.continuation), jnp.full((1,), n_prompt, jnp.int32)
    prefill = {
        (budget, layer): jax.jit(
            lambda q, k, v, m=engine.as_run(cfg, harness.make_method("chelsea", budget)).at(layer), layer=layer: (
                m.prefill(m.init(cfg, 1, cap, layer, model.dtype), layer, q, k, v, lengths)
            )
        )
        for budget in args.budgets
        for layer in layers
    }
    d, group = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    per = {key: [] for key in prefill}
    for w, tokens in enumerate(seqs):
        # the model teacher-forced over prompt and continuation with full attention: every layer's q, k, v
        pre = P.prefill_once(model, tokens[None], [len(tokens)])
        for layer in layers:
            q, k, v = (np.asarray(x[layer, 0], np.float32) for x in (pre.q, pre.k, pre.v))  # [H, T, D]
            kp, qp = jnp.asarray(k[None, :, :n_prompt]), jnp.asarray(q[None, :, :n_prompt])
            for budget in args.budgets:
                member, st = None, None
                for start in range(0, n_prompt, d):  # one-hot values for prompt tokens [start, start + d)
                    width = min(d, n_prompt - start)
                    onehot = np.zeros((1, cfg.num_kv_heads, n_prompt, d), np.float32)
                    onehot[0, :, start : start + width, :width] = np.eye(width, dtype=np.float32)
                    st = prefill[budget, layer](qp, kp, jnp.asarray(onehot, model.dtype))
                    got = np.asarray(st.v[0, :, :, :width], np.float32)  # [Hkv, S, width]
                    member = got if member is None else np.concatenate([member, got], -1)
                member = (member > 0).astype(np.float64)  # [Hkv, S, T]
                n = np.asarray(st.n[0], np.float64)
                if not np.allclose(member.sum(1), 1) or not np.allclose(member.sum(-1), n):
                    raise RuntimeError("the one-hot merge did not place every prompt token in exactly one slot")
                k_hat = np.asarray(st.k[0], np.float64)
                for h in range(cfg.num_kv_heads):
                    qh = q[h * group : (h + 1) * group, n_prompt:]  # [G, P, D] the continuation's queries
                    per[budget, layer].append(
                        decompose(qh, k[h, :n_prompt], v[h, :n_prompt], member[h], k_hat[h], n[h])
                    )
            print(f"[chelsea_slot_spread] window {w + 1}/{len(seqs)} layer {layer}: {time.perf_counter() - t0:.0f} s")
    rows = [{"budget": budget, "layer": layer, **bc.mean_stats(rs, digits=4)} for (budget, layer), rs in per.items()]
    data = {
        **bc.window_fields(args),
        "chelsea": bc.CHELSEA_DEFAULTS,
        "rows": rows,
    }
    bc.write_measured(args.out, data, markdown, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
