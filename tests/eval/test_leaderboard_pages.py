"""The method pages' "On the leaderboard" sections quote the committed leaderboard run: every percentage, full's
score and the answers a cell equal ``benchmarks/results/leaderboard-gemma3-270m/leaderboard.json`` (rounded)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = json.loads((ROOT / "benchmarks/results/leaderboard-gemma3-270m/leaderboard.json").read_text())
PAGES = sorted(p for p in (ROOT / "docs/methods").glob("*.md") if "## On the leaderboard" in p.read_text())


def test_every_papers_method_page_has_a_section():
    assert {p.stem for p in PAGES} >= {"chelsea", "clusterkv", "pqcache", "chunkkv", "less", "quest", "baselines"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_the_section_quotes_the_run(page):
    section = page.read_text().split("## On the leaderboard", 1)[1].split("\n## ", 1)[0]
    avg = {(e["method"], e["ratio"]): e["average"] for e in DATA["summary"]}
    ratios = DATA["config"]["ratios"]
    full = avg[("full", 0.0)]
    assert re.search(rf"against full's {round(full['value'])}%", section), section[:400]
    answers = re.search(r"(\d+) answers (?:per|a) cell", section)
    assert answers and int(answers.group(1)) == full["n"], answers and answers.group(0)
    partial = DATA.get("partial") or {}
    unfinished = partial.get("batches_done", 0) < partial.get("batches", 0)
    assert ("partial" in section) == unfinished, "the section and the run disagree on 'partial'"
    lines = re.findall(r"^- `([a-z_0-9]+)`: ((?:\d+%(?:, )?)+)$", section, re.M)
    assert lines, section[:400]
    for name, cells in lines:
        quoted = [int(x) for x in re.findall(r"(\d+)%", cells)]
        assert quoted == [round(avg[(name, r)]["value"]) for r in ratios], f"{page.name}: {name} {quoted}"
