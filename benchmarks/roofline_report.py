"""The roofline's report (``benchmarks/roofline.py``): the printed table, its ``.txt`` with the projection and the
``.png`` plot beside a run's JSON, and several runs' JSONs merged into one (``--report a.json,b.json``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import context_label, fmt  # noqa: E402
from roofline_plot import plot  # noqa: E402
from roofline_project import projection, projection_text  # noqa: E402


def table(rows: list[dict]) -> str:
    """One block per (context, batch, dtype): every row of it (skipped rows with their reason)."""
    head = (
        f"{'method':22s} {'step ms':>8s} {'MiB/step':>9s} {'XLA MiB':>8s} {'GB/s':>6s} {'time/full':>9s} "
        f"{'bytes/full':>10s} {'eff':>5s} {'speedup':>7s} {'TTFT s':>8s} {'TTFT x':>6s} {'comp%':>6s}"
    )
    model = any(r.get("model_ttft_ratio") is not None for r in rows)
    head += f" {'model TTFT x':>12s}" if model else ""
    lines = []
    for key in dict.fromkeys((r["context"], r["batch"], r["dtype"]) for r in rows):
        block = [r for r in rows if (r["context"], r["batch"], r["dtype"]) == key]
        lines += [f"\n== {context_label(key[0])} tokens, batch {key[1]}, {key[2]} ==", head]
        for r in block:
            label = r["label"] + (f" (g{r['group']})" if r.get("group") else "")
            if r.get("status") != "ok":
                lines.append(f"{label:22s} {r['status']}: {r.get('skipped') or r.get('error', '')}")
                continue
            lines.append(
                f"{label:22s} {r['step_s'] * 1e3:8.2f} {r['bytes_read'] / 2**20:9.1f} "
                f"{fmt(r.get('xla_bytes') and r['xla_bytes'] / 2**20, '8.1f'):>8s} {r['gbs']:6.1f} "
                f"{r['time_ratio']:9.3f} {r['bytes_ratio']:10.3f} {r['efficiency']:5.2f} {r['speedup']:7.2f} "
                f"{fmt(r.get('ttft_s'), '8.2f'):>8s} {fmt(r.get('ttft_ratio'), '6.2f'):>6s} "
                f"{fmt(r.get('compress_share'), '6.1%'):>6s}"
                + (f" {fmt(r.get('model_ttft_ratio'), '12.3f'):>12s}" if model else "")
            )
        skipped_ttft = next((r.get("ttft_skipped") for r in block if r.get("ttft_skipped")), None)
        if skipped_ttft:
            lines.append(f"(TTFT not measured: {skipped_ttft})")
        dense = next((r["dense_s"] for r in block if r.get("dense_s") is not None), None)
        if dense is not None:
            lines.append(
                f"(model TTFT x: each layer adds {dense:.2f} s of projections and MLP, measured, to every method's "
                "attention-only TTFT)"
            )
    return "\n".join(lines)


def report(data: dict, out_path: Path) -> str:
    """Print the table and the projection of a run's JSON; write them as ``.txt`` and the plot as ``.png`` beside
    it. Returns the text."""
    rows = data["rows"]
    title = (
        f"roofline: {data['setting']}; {data.get('device_kind')} ({data.get('backend')}), jax "
        f"{data.get('jax_version')}, commit {(data.get('commit') or '?')[:10]}"
        f"{' (dirty)' if data.get('commit_dirty') else ''}; {data.get('layers')} layer(s) from "
        f"{data.get('first_layer')}; read {fmt(data.get('read_gbs'), '.1f')} GB/s, copy "
        f"{fmt(data.get('copy_gbs'), '.1f')} GB/s; load average {fmt(data.get('load_average_1min'), '.2f')}"
    )
    text = title + "\n" + table(rows) + "\n" + projection_text(projection(rows))
    print(text, flush=True)
    out_path.with_suffix(".txt").write_text(text + "\n")
    print(plot(rows, out_path.with_suffix(".png"), title=f"{data.get('device_kind')}: {data['setting']}"), flush=True)
    return text


def merge_runs(datas: list[dict], paths: list[str]) -> dict:
    """Several runs' JSONs as one (``--report a.json,b.json``): the first's header, every row (``full_row``
    re-indexed, ``source`` naming its file; each row's ratios stay those to its own run's full) and ``sources``
    (each run's file, commit, command, bandwidth and load average)."""
    keep = (
        "commit",
        "commit_dirty",
        "command",
        "jax_version",
        "device_kind",
        "read_gbs",
        "copy_gbs",
        "load_average_1min",
    )
    out = {
        **datas[0],
        "rows": [],
        "sources": [{"file": p, **{k: d.get(k) for k in keep}} for d, p in zip(datas, paths)],
    }
    for d, p in zip(datas, paths):
        off = len(out["rows"])
        for r in d["rows"]:
            out["rows"].append({**r, "source": p, **({"full_row": r["full_row"] + off} if "full_row" in r else {})})
    if len({d.get("commit") for d in datas}) > 1:
        out["commit"] = ",".join(dict.fromkeys(str(d.get("commit")) for d in datas))
    return out
