"""The roofline's ratios and projection (``benchmarks/roofline.py``): each row's ratios to the ``full`` row it was
timed beside (efficiency, speed-up, TTFT ratios), and an 8B model's TPOT projected from them on published bandwidths
(:func:`projection` states what it assumes), beside the papers' figures (``e2e.PAPERS``). Pure arithmetic on rows:
nothing is measured here."""

from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import context_label  # noqa: E402
from e2e import PAPERS  # noqa: E402

#: The projection's model: Llama-3.1-8B, bfloat16 weights (embedding + 32 layers + head), 32 layers.
WEIGHTS_8B_BF16 = 16.06e9
MODEL_LAYERS = 32
#: Published memory bandwidth, bytes/s.
PROJECTION_DEVICES = {"H100": 3.35e12, "TPU v5e": 819e9}


def add_ratios(rows: list[dict], full_index: int) -> None:
    """Ratios of ``rows`` (one group of one configuration, full first) to the full row at ``full_index`` of the
    run's row list (``rows[0]``)."""
    full = rows[0]
    for r in rows:
        r["full_row"] = full_index
        r["speedup"] = full["step_s"] / r["step_s"]
        r["time_ratio"] = r["step_s"] / full["step_s"]
        r["bytes_ratio"] = r["bytes_read"] / full["bytes_read"]
        r["efficiency"] = r["time_ratio"] / r["bytes_ratio"]
        if r.get("ttft_s") is not None and full.get("ttft_s") is not None:
            r["ttft_ratio"] = r["ttft_s"] / full["ttft_s"]
            r["compress_share"] = (r["ttft_s"] - full["ttft_s"]) / r["ttft_s"]
        else:
            r["ttft_ratio"] = r["compress_share"] = None
        dense = r["layers"] * r["dense_s"] if r.get("dense_s") is not None else None
        r["model_ttft_ratio"] = (
            (dense + r["ttft_s"]) / (dense + full["ttft_s"]) if dense is not None and r["ttft_ratio"] else None
        )


def projection(
    rows: list[dict], weights: float = WEIGHTS_8B_BF16, layers: int = MODEL_LAYERS, devices: dict | None = None
) -> list[dict]:
    """Projected TPOT of an 8B model per method and context (batch 1), from this run's ratios.

    Assumes a decode step reads the weights once and each layer's KV bytes once, at the device's published
    bandwidth, with nothing else (no compute, launch or host overhead): full's TPOT = ``(W + KV_full) / BW`` with
    ``KV_full`` = full's measured bytes read per step, per layer, x ``layers``, at bfloat16 (from the bfloat16 row
    if the run has one, else the float32 row / 2: full reads only K/V); a method's TPOT = ``(W + KV_m * eff) / BW``
    with ``KV_m = bytes_ratio * KV_full`` and ``eff`` its measured efficiency (the row's dtype: bfloat16 where run,
    else float32; ``measured_dtype``), i.e. its KV part costs what its measured time ratio says. The bandwidth
    cancels in the speed-up, which is therefore the same on every device under this model; the TPOTs differ.
    ``ideal_speedup`` takes ``eff = 1``."""
    devices = PROJECTION_DEVICES if devices is None else devices
    ok = [r for r in rows if r.get("status") == "ok" and r["batch"] == 1]
    out = []
    for n in sorted({r["context"] for r in ok}):
        at_n = [r for r in ok if r["context"] == n]
        dt = "bfloat16" if any(r["dtype"] == "bfloat16" for r in at_n) else at_n[0]["dtype"]
        sel = [r for r in at_n if r["dtype"] == dt]
        full = next((r for r in sel if r["label"] == "full"), None)
        if full is None:
            continue
        kv_full = full["bytes_read"] / full["layers"] * layers * 2 / jnp.dtype(dt).itemsize
        for r in sel:
            if r["label"] == "full":
                continue
            kv_m = r["bytes_ratio"] * kv_full
            p = {
                "context": n,
                "label": r["label"],
                "method": r["method"],
                "budget": r["budget"],
                "measured_dtype": dt,
                "efficiency": r["efficiency"],
                "bytes_ratio": r["bytes_ratio"],
                "weights_bytes": weights,
                "kv_full_bytes": kv_full,
                "kv_bytes": kv_m,
                "speedup": (weights + kv_full) / (weights + kv_m * r["efficiency"]),
                "ideal_speedup": (weights + kv_full) / (weights + kv_m),
            }
            for dev, bw in devices.items():
                p[f"tpot_full_s[{dev}]"] = (weights + kv_full) / bw
                p[f"tpot_s[{dev}]"] = (weights + kv_m * r["efficiency"]) / bw
            out.append(p)
    return out


def _paper_figure(p: dict) -> str:
    """The papers' figure at this projection's (method, budget, context), from ``e2e.PAPERS``, else ''."""
    ch, ck, cu = PAPERS["chelsea"], PAPERS["clusterkv"], PAPERS["chunkkv"]
    if p["label"] == f"chelsea@{ch['budget']}" and p["context"] in ch["tpot_speedup_by_context"]:
        return f"Chelsea Table 3: TPOT {ch['tpot_speedup_by_context'][p['context']]:.2f}x"
    if p["label"] == f"clusterkv@{ck['budget']}" and p["context"] == ck["context"]:
        return f"ClusterKV Fig. 12: e2e latency {ck['e2e_speedup']:.1f}x (decode + prefill)"
    if p["method"] == "chunkkv" and p["context"] == cu["context"]:
        return (
            f"ChunkKV Table 8: throughput +{cu['throughput_gain_reuse_vs_full']:.1%} (reuse; budget not "
            f"stated), i.e. {1 + cu['throughput_gain_reuse_vs_full']:.3f}x"
        )
    return ""


def projection_text(proj: list[dict], weights: float = WEIGHTS_8B_BF16, layers: int = MODEL_LAYERS) -> str:
    devs = sorted(
        {k[k.index("[") + 1 : -1] for p in proj for k in p if k.startswith("tpot_s[")},
        key=lambda d: list(PROJECTION_DEVICES).index(d) if d in PROJECTION_DEVICES else 99,
    )
    lines = [
        "\n== PROJECTION (not a measurement): Llama-3.1-8B TPOT, batch 1, bfloat16 ==",
        f"TPOT = (weights {weights / 1e9:.2f} GB + KV bytes read per step over {layers} layers) / bandwidth "
        f"({', '.join(f'{d} {PROJECTION_DEVICES.get(d, 0) / 1e9:.0f} GB/s' for d in devs)}); a method's KV "
        "part x its efficiency measured above (its time ratio on this CPU, attention + cache only). Assumes "
        "the step is bandwidth-bound with no compute, launch or host overhead; the speed-up is then the same "
        "on every device (the bandwidth cancels). 'ideal' takes efficiency 1. The papers' figures are "
        "end-to-end on their own stacks.",
    ]
    if not proj:
        return "\n".join(lines + ["(no batch-1 rows with a full row: nothing to project)"])
    head = f"{'context':>7s} {'method':20s} {'eff':>5s} {'KV GB':>6s}"
    for d in devs:
        head += f" {d + ' full ms':>14s} {d + ' ms':>10s}"
    lines.append(head + f" {'speedup':>7s} {'ideal':>6s}  paper")
    for p in proj:
        line = f"{context_label(p['context']):>7s} {p['label']:20s} {p['efficiency']:5.2f} {p['kv_bytes'] / 1e9:6.2f}"
        for d in devs:
            line += f" {p[f'tpot_full_s[{d}]'] * 1e3:14.2f} {p[f'tpot_s[{d}]'] * 1e3:10.2f}"
        lines.append(line + f" {p['speedup']:6.2f}x {p['ideal_speedup']:5.2f}x  {_paper_figure(p)}")
    return "\n".join(lines)
