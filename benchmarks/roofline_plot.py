"""The roofline's plot (``benchmarks/roofline.py``): speed-up against context per variant, measured beside its
bytes-ratio ideal; one panel per (batch, dtype)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import context_label  # noqa: E402

#: The plot's markers (with 28 colours: every variant of the default grid gets its own colour).
MARKERS = "os^vDP*Xh<>"


def plot(rows: list[dict], path: Path, title: str = "") -> str:
    """Speed-up vs context per variant (solid), its bytes-ratio ideal (dashed, same colour and hollow marker); one
    panel per (batch, dtype); the legend outside the panels. Returns what was done."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.ticker import FuncFormatter, NullLocator
    except ImportError:
        return "plot skipped: matplotlib is not importable"
    ok = [r for r in rows if r.get("status") == "ok" and r["label"] != "full"]
    panels = list(dict.fromkeys((r["batch"], r["dtype"]) for r in ok))
    if not panels:
        return "plot skipped: no rows besides full"
    labels = list(dict.fromkeys(r["label"] for r in ok))
    t20 = list(plt.cm.tab20.colors)
    colours = t20[0::2] + t20[1::2] + list(plt.cm.tab20b.colors[0::4]) + list(plt.cm.tab20b.colors[2::4])  # dark first
    style = {lab: (colours[i % len(colours)], MARKERS[i % len(MARKERS)]) for i, lab in enumerate(labels)}
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5), squeeze=False)
    for ax, (b, dt) in zip(axes[0], panels):
        for lab in labels:
            pts = sorted(
                (r["context"], r["speedup"], 1 / r["bytes_ratio"])
                for r in ok
                if (r["batch"], r["dtype"], r["label"]) == (b, dt, lab)
            )
            if not pts:
                continue
            c, m = style[lab]
            xs = [p[0] for p in pts]
            ax.plot(xs, [p[1] for p in pts], color=c, marker=m, lw=1.5)
            ax.plot(xs, [p[2] for p in pts], color=c, marker=m, mfc="none", ls="--", lw=1, alpha=0.7)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ctx = sorted({r["context"] for r in ok if (r["batch"], r["dtype"]) == (b, dt)})
        ax.set_xticks(ctx, [context_label(c) for c in ctx])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
        ax.axhline(1.0, color="grey", lw=0.7)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("decode-step speed-up vs full")
        ax.set_title(f"batch {b}, {dt}")
    handles = [Line2D([], [], color=style[lab][0], marker=style[lab][1], label=lab) for lab in labels]
    handles += [
        Line2D([], [], color="k", label="solid: measured"),
        Line2D([], [], color="k", ls="--", marker="o", mfc="none", label="dashed: bytes-ratio ideal"),
    ]
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.suptitle(title or "attention + cache only, Llama-3.1-8B attention shapes", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return f"wrote {path}"
