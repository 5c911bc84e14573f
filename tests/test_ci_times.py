"""The times and counts a newcomer meets are the measured ones: ``benchmarks/results/ci_times.json`` (written by
``python3 benchmarks/ci_times.py``, every line of ``.ci/run`` and the smoke check timed on a 2-core machine) is the
source; docs/testing.md's table is its rendering, the README's "about N minutes" are within a quarter of it, and
it timed exactly the commands ``.ci/run`` runs today (a changed ``.ci/run`` asks for a new measurement); the
README's own commands (quickstart, ``kvjax generate``, ``kvjax demo``, ``kvjax-train-less``) are timed beside."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import ci_times  # noqa: E402

JSON = ROOT / "benchmarks" / "results" / "ci_times.json"
REMEASURE = "measure again: python3 benchmarks/ci_times.py --out benchmarks/results/ci_times.json (about an hour)"
#: What the README states, the step it times and the unit of its number.
README_TIMES = (
    (r"the main job \(about (\d+) minutes on 2 cores\)", "main job", 60),
    (r"the tests and the notebooks \(both CPU cores, about (\d+) minutes\)", "default line", 60),
    (r"-m smoke` \(.*?; about (\d+) s\)", "smoke", 1),
    (r"# The answer is: .*?\(about (\d+) s on 2 CPU cores, compilation included\)", "quickstart", 1),
    (r"streams to the terminal \(~(\d+) s\)", "kvjax generate", 1),
    (r"# full and four compressed caches answer one question \(~([\d.]+) min\)", "kvjax demo", 60),
    (r"# LESS kernels in about ([\d.]+) minutes on 2 CPU cores", "kvjax-train-less", 60),
)


@pytest.fixture(scope="module")
def measured() -> dict:
    return json.loads(JSON.read_text(encoding="utf-8"))


def _steps(data: dict) -> list[dict]:
    return data["steps"] + data.get("readme", {}).get("steps", [])


def test_every_step_passed_on_a_two_core_machine(measured):
    for run in (measured, measured.get("readme")):
        assert run, f"the README's commands are not timed: {REMEASURE} --readme"
        assert run["machine"]["cpus"] == 2, f"measured on {run['machine']['cpus']} cores; {REMEASURE}"
    assert all(s["rc"] == 0 for s in _steps(measured)), f"a step failed in the measured run; {REMEASURE}"
    assert [s["command"] for s in measured["readme"]["steps"]] == [c for _, c in ci_times.README_COMMANDS]


def test_it_timed_what_ci_runs_today(measured):
    todo = ci_times.steps(ROOT / ".ci" / "run")
    ran = [(s["name"], s["command"]) for s in measured["steps"] if s["name"] != "smoke"]
    assert ran == todo, f".ci/run runs {todo}, the measured run timed {ran}; {REMEASURE}"


def test_the_docs_table_is_the_measured_one(measured):
    text = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    table = re.search(r"<!-- ci_times -->\n(.*?)\n<!-- /ci_times -->", text, re.S)
    assert table, "docs/testing.md has no <!-- ci_times --> ... <!-- /ci_times --> table"
    assert table.group(1).strip() == ci_times.render(measured).strip(), (
        "docs/testing.md's table differs from benchmarks/results/ci_times.json: paste "
        "`python3 benchmarks/ci_times.py --render benchmarks/results/ci_times.json` between its marks"
    )


@pytest.mark.parametrize("pattern,name,unit", README_TIMES, ids=[n for _, n, _ in README_TIMES])
def test_the_readme_states_the_measured_time(measured, pattern, name, unit):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.search(pattern, readme, re.S)
    assert found, f"README.md no longer states the {name}'s time as {pattern!r}"
    stated = float(found.group(1)) * unit
    seconds = next(s for s in _steps(measured) if s["name"] == name)["seconds"]
    assert abs(stated - seconds) <= max(0.25 * seconds, 30), (
        f"README.md says about {found.group(1)} {'minutes' if unit == 60 else 's'} for the {name}; it took "
        f"{ci_times.minutes(seconds)} (benchmarks/results/ci_times.json): say so, or {REMEASURE}"
    )


def test_the_script_reads_ci_and_pytest_as_written(tmp_path):
    ci = tmp_path / "run"
    ci.write_text(
        "set -e\ncd x\nexport A=1\n# a comment\nbash scripts/install.sh && kvjax-eval main\n"
        "python3 -m pytest -q a.py --runslow \\\n    b.py\npython3 scripts/mutations.py --subset ci\n"
    )
    assert ci_times.steps(ci) == [
        ("install", "bash scripts/install.sh"),
        ("main job", "kvjax-eval main"),
        ("slow line", "python3 -m pytest -q a.py --runslow b.py"),
        ("mutants (ci subset)", "python3 scripts/mutations.py --subset ci"),
    ]
    out = "....\n=== 1 failed, 1559 passed, 290 skipped, 45 warnings in 724.69s (0:12:04) ===\n"
    assert ci_times.counts(out) == {"failed": 1, "passed": 1559, "skipped": 290, "warnings": 45}
    assert ci_times.counts("no summary") == {}
    assert ci_times.minutes(125.4) == "2 min 05 s" and ci_times.minutes(40) == "40 s"
