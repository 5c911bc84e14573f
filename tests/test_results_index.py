"""benchmarks/results/ has an index, and what cites a result names one that exists.

- Every file under ``benchmarks/results/`` (``archive/`` included) has a row in ``benchmarks/results/README.md``.
- Every file a row of the index names exists (``name.json``, ``.txt``, ``.png`` in a cell: the same stem).
- Every ``benchmarks/results/...`` path cited in README.md, docs/**/*.md and the notebooks exists (``{a,b}`` and
  ``*`` expanded as a shell would), so a renamed or archived result cannot leave a dangling reference.

Plain text parsing, no JAX work.
"""

from __future__ import annotations

import glob
import re

from test_docs import ROOT, notebook_text, rel, repo_files

RESULTS = ROOT / "benchmarks" / "results"
INDEX = RESULTS / "README.md"
CITED = re.compile(r"benchmarks/results/([\w./{},*-]*[\w}*])")
# Output folders, not results: where scripts/accelerator.sh writes its files when $OUT is not set, and where
# scripts/accelerator_steps.sh writes a GPU run's JSON (empty, so absent from a clean checkout, until a GPU run).
OUTPUT_DIRS = {"device", "gpu"}


def index_names(text: str) -> set[str]:
    """The files the index's tables name: the backticked names of each row's first cell, where ``.ext`` after a
    name means the same stem with that extension."""
    names: set[str] = set()
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        stem = None
        for item in re.findall(r"`([^`]+)`", first):
            if item.startswith(".") and stem is not None:
                names.add(stem + item)
            else:
                names.add(item)
                stem = item.rsplit(".", 1)[0]
    return names


def result_files() -> set[str]:
    return {
        p.relative_to(RESULTS).as_posix()
        for p in RESULTS.rglob("*")
        if p.is_file() and p != INDEX and "__" not in p.name
    }


def expand(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m:
        return [x for alt in m.group(1).split(",") for x in expand(pattern[: m.start()] + alt + pattern[m.end() :])]
    return [pattern]


def test_index_parser():
    text = "| `a.json`, `.txt`; `archive/b.json`, `.png` | x | y |\n| `c/d.md` | e |\nnot | `e.json` |"
    assert index_names(text) == {"a.json", "a.txt", "archive/b.json", "archive/b.png", "c/d.md"}
    assert expand("x.{json,txt}") == ["x.json", "x.txt"]


def test_every_result_file_is_in_the_index():
    missing = sorted(result_files() - index_names(INDEX.read_text(encoding="utf-8")))
    assert not missing, (
        "files in benchmarks/results/ without a row in benchmarks/results/README.md (say what each is and the "
        "command that reproduces it, or remove superseded runs):\n" + "\n".join(missing)
    )


def test_every_indexed_file_exists():
    missing = sorted(index_names(INDEX.read_text(encoding="utf-8")) - result_files())
    assert not missing, "benchmarks/results/README.md names files that do not exist:\n" + "\n".join(missing)


def test_cited_results_exist():
    docs = [p for p in repo_files(".md", ".ipynb") if rel(p) == "README.md" or rel(p).startswith(("docs/", "colab/"))]
    problems = []
    for path in docs:
        text = notebook_text(path) if path.suffix == ".ipynb" else path.read_text(encoding="utf-8")
        for m in CITED.finditer(text):
            cited = m.group(1).rstrip(".,")
            if not cited or cited.endswith("/") or cited in OUTPUT_DIRS:
                continue
            for one in expand(cited):
                if not glob.glob(str(RESULTS / one)):
                    problems.append(f"{rel(path)}: benchmarks/results/{one} does not exist")
    assert not problems, "cited results that do not exist (moved to archive/? renamed?):\n" + "\n".join(problems)
