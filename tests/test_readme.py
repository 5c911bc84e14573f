"""The README is the front door: short, its set-up commands are the ones CI runs, and its table names every method.

- at most 150 lines;
- the two set-up commands are, verbatim, the first two commands of ``.ci/run`` (which runs them on a clean clone);
- the table of methods has a row for every registered method (``kvjax.methods.names()``) and nothing else.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_readme_is_short():
    n = len(README.splitlines())
    assert n <= 150, f"README.md has {n} lines; move detail to docs/ (docs/usage.md, docs/performance.md#history)"


def test_the_setup_commands_are_what_ci_runs():
    ci = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith(("#", "set", "cd", "export"))
    ]
    block = re.search(r"## Set-up[^\n]*\n+```bash\n(.*?)```", README, re.S)
    assert block, "README.md has no '## Set-up' section with a bash block"
    readme = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert readme == [c.strip() for c in ci[:2]], f"README's set-up {readme} differs from .ci/run's {ci[:2]}"


def test_the_table_of_methods_names_every_method():
    from kvjax import methods

    section = README.split("## Methods", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| \[?`([a-z_0-9]+)`", section, re.M)
    assert sorted(rows) == sorted(methods.names()), f"table rows {sorted(rows)}, registered {sorted(methods.names())}"


# ---- every number of the README comes from the file it cites -------------------------------------------------

RESULTS = ROOT / "benchmarks" / "results"
NAMES = {
    "full": "full",
    "StreamingLLM": "streaming_llm",
    "H2O": "h2o",
    "SnapKV": "snapkv",
    "PyramidKV": "pyramidkv",
    "ChunkKV": "chunkkv",
    "Chelsea": "chelsea",
    "PQCache": "pqcache",
    "ClusterKV": "clusterkv",
    "Quest": "quest",
    "LESS": "less",
}


def _paragraph(start: str) -> str:
    """The README paragraph that starts with ``start`` (up to the next blank line)."""
    i = README.index(start)
    return README[i:].split("\n\n", 1)[0].replace("\n", " ")


def _range(text: str) -> tuple[float, float]:
    lo, hi = re.split(r"[-–]", text)
    return float(lo), float(hi)


def _table(md: str, section: str) -> dict[str, list[str]]:
    """``method -> cells`` of the rows at budget 0.2 (and full's) of a results.md table."""
    part = md.split(f"### {section}", 1)[1].split("\n### ", 1)[0]
    rows = {}
    for line in part.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 2 and cells[1] in ("-", "0.2") and cells[0] in NAMES.values():
            rows[cells[0]] = cells
    return rows


def test_the_main_job_figures_come_from_its_results():
    md = (RESULTS / "eval-main" / "results.md").read_text(encoding="utf-8")
    quality = _paragraph("**Quality: the main job**")
    assert "(benchmarks/results/eval-main/results.md)" in quality
    version = re.search(r"kvjax (\d+\.\d+\.\d+) at commit `([0-9a-f]+)`", quality)
    assert version, "the main job's paragraph names no kvjax version and commit"
    from kvjax import __version__

    assert version.group(1) == __version__, f"the main job's results are of kvjax {version.group(1)}, not {__version__}"
    assert f"kvjax {version.group(1)}" in md and f"commit `{version.group(2)}" in md, "results.md: another run"
    needle, ppl = _table(md, "needle"), _table(md, "perplexity")
    accuracies = re.findall(r"\b(" + "|".join(NAMES) + r") (\d+)%", quality.split("passkey accuracy", 1)[1])
    assert len(accuracies) >= 4, quality
    for name, pct in accuracies:
        got = float(needle[NAMES[name]][2].split()[0])
        assert round(got) == int(pct), f"README: {name} {pct}% passkey accuracy; results.md: {got}"
    deltas = re.findall(r"\b(" + "|".join(NAMES) + r") ([0-9.]+)\b", quality.split("ΔNLL", 1)[1])
    assert len(deltas) >= 3, quality
    for name, value in deltas:
        cell = ppl[NAMES[name]][4]
        mean, lo, hi = map(float, re.findall(r"-?[0-9.]+", cell))
        assert f"{mean:.2f}" == value, f"README: {name} ΔNLL {value}; results.md: {cell}"
        assert lo <= 0 <= hi or "including 0" not in quality, f"{name}: {cell} excludes 0"
    for figure in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README):
        assert (ROOT / figure).is_file(), f"README shows {figure}, which is not in the repository"
        assert figure.startswith(("benchmarks/results/", "docs/images/")), figure


EVICTING = ("streaming_llm", "h2o", "snapkv", "pyramidkv", "chunkkv", "less")


def test_the_leaderboard_figures_come_from_its_results():
    """Every number of the leaderboard's paragraph is the committed run's: answers a cell (and "partial" while the
    run is), full's average, "<methods> N% at r" and "evicting methods <= N%" (at 0.25)."""
    import json

    para = _paragraph("**Quality at 4k tokens: the leaderboard**")
    data = json.loads((RESULTS / "leaderboard-gemma3-270m" / "leaderboard.json").read_text())
    assert "(benchmarks/results/leaderboard-gemma3-270m/leaderboard.md)" in para
    avg = {(e["method"], e["ratio"]): e["average"] for e in data["summary"]}
    n, total = avg[("full", 0.0)]["n"], data["config"]["contexts"] * len(data["config"]["tasks"])
    cell = re.search(r"(?:(\d+) of )?(\d+) answers a cell", para)
    assert cell, "the leaderboard paragraph does not say how many answers a cell holds"
    partial = data.get("partial") or {}
    if partial.get("batches_done", 0) < partial.get("batches", 0):
        assert "partial" in para and (int(cell.group(1)), int(cell.group(2))) == (n, total), cell.group(0)
    else:
        assert "partial" not in para and cell.group(1) is None and int(cell.group(2)) == n == total, cell.group(0)
    full = re.search(r"\bfull (\d+)%", para)
    assert full and int(full.group(1)) == round(avg[("full", 0.0)]["value"]), full and full.group(0)
    claims = re.findall(
        r"((?:(?:" + "|".join(NAMES) + r")(?:, | and )?)+) (\d+)% at (0\.\d+)", para
    )  # "Quest and Chelsea 28% at 0.25"
    assert claims, para
    for names, pct, ratio in claims:
        for name in re.findall("|".join(NAMES), names):
            got = avg[(NAMES[name], float(ratio))]["value"]
            assert round(got) == int(pct), f"README: {name} {pct}% at {ratio}; leaderboard.json: {got:.1f}"
    bound = re.search(r"evicting methods ≤ ?(\d+)%", para)
    if bound:
        worst = max(avg[(m, 0.25)]["value"] for m in EVICTING)
        assert round(worst) <= int(bound.group(1)), f"an evicting method reaches {worst:.1f}% at 0.25"


def test_the_speed_figures_come_from_the_roofline_they_cite():
    import json

    speed = _paragraph("**Speed**").split("**The roofline**", 1)[1]
    data = json.loads((RESULTS / "roofline_cpu_32k.json").read_text())
    assert f"commit `{data['commit'][:7]}`" in speed, "the roofline paragraph names another commit"
    assert (
        "--lengths 32k --batch 1 --dtypes float32" in speed
        and "--lengths 32k --batch 1 --dtypes float32" in (data["command"])
    )
    rows = [r for r in data["rows"] if r["label"] != "full" and r["status"] == "ok"]
    step = re.search(r"one attention layer.*?is ([0-9.]+[-–][0-9.]+)× faster", speed)
    assert step, "the speed headline does not say it measures one attention layer"
    lo, hi = _range(step.group(1))
    assert (lo, hi) == (round(min(r["speedup"] for r in rows), 1), round(max(r["speedup"] for r in rows), 1))
    eff = {r["label"].split("@")[0]: [] for r in rows}
    for r in rows:
        eff[r["label"].split("@")[0]].append(r["efficiency"])
    for names, value in re.findall(r"((?:(?:" + "|".join(NAMES) + r")(?:, | and )?)+) ([0-9.]+(?:[-–][0-9.]+)?)\b",
                                    speed.split("efficiency", 1)[1]):  # fmt: skip
        group = [NAMES[n] for n in re.findall("|".join(NAMES), names)]
        values = [e for n in group for e in eff[n]]
        lo, hi = _range(value) if re.search("[-–]", value) else (float(value), float(value))
        assert (lo, hi) == (round(min(values), 2), round(max(values), 2)), f"{names}: README {value}, data {values}"


def test_the_whole_model_speed_comes_from_the_gpu_run_it_cites():
    """The 8B model's figures (the paragraph before the roofline) are the 32k rows of the committed end-to-end JSON:
    kvjax's full against transformers', SnapKV against kvpress's, and each method's TPOT ratio to kvjax's full."""
    import json

    speed = _paragraph("**Speed**").split("**The roofline**", 1)[0]
    data = json.loads((RESULTS / "e2e_8b_b1_h200.json").read_text())
    assert f"jax {data['jax_version']}" in speed and "scripts/gpu_e2e.sh" in speed
    tpot = {r["label"]: r["tpot_s"] for r in data["rows"] if r["context"] == 32768 and r["status"] == "ok"}
    full, hf = tpot["full"], tpot["transformers"]
    assert f"{hf / full:.1f}× faster than transformers'" in speed
    assert f"({full * 1e3:.2f} against {hf * 1e3:.2f} ms a token)" in speed
    assert f"SnapKV {tpot['kvpress_snapkv@0.2'] / tpot['snapkv@0.2']:.1f}× faster than kvpress's" in speed
    method = lambda label: label.split("@")[0].replace("_reuse", "")  # noqa: E731  (chunkkv_reuse is ChunkKV)
    ratio = {k: full / v for k, v in tpot.items() if k not in ("full", "transformers") and not k.startswith("kvpress")}
    groups = {"PQCache": ["pqcache"], "Quest": ["quest"]}
    groups["every other method"] = sorted({method(k) for k in ratio} - {"pqcache", "quest"})
    for name, value in re.findall(r"(PQCache|Quest|every other method) (?:is )?([0-9.]+[-–][0-9.]+)×", speed):
        values = [v for k, v in ratio.items() if method(k) in groups[name]]
        assert _range(value) == (round(min(values), 2), round(max(values), 2)), f"{name}: README {value}"
        groups.pop(name)
    assert set(groups) == set(), f"no figure for {sorted(groups)}"


def test_the_gpu_column_is_what_the_leases_logged():
    methods_log = (RESULTS / "accelerator_methods_h200_3.log").read_text()
    embedded_log = (RESULTS / "accelerator_embedded_h200_3.log").read_text()
    section = README.split("## Methods", 1)[1].split("\n## ", 1)[0]
    assert "accelerator_methods_h200_3.log" in section and "accelerator_embedded_h200_3.log" in section
    for row in re.findall(r"^\| \[?`([a-z_0-9]+)`.*$", section, re.M):
        line = next(l for l in section.splitlines() if l.startswith((f"| [`{row}`]", f"| `{row}`")))
        gpu = [c.strip() for c in line.strip("|").split("|")][5].split(" / ")[1]

        def outcome(log: str, test: str) -> str:
            m = re.search(rf"(PASSED|FAILED) tests/accelerator/{test}\[{row}\]", log)
            return {"PASSED": "✓", "FAILED": "✗"}[m.group(1)] if m else "not finished"

        kernels = outcome(methods_log, "test_methods.py::test_method_with_kernels_matches_reference")
        model = outcome(embedded_log, "test_embedded.py::test_device_matches_cpu")
        assert gpu == f"kernels {kernels}, model {model}", f"{row}: README's GPU cell {gpu!r}"
