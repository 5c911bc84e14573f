"""The documentation, the scripts and the code speak of kvjax alone: what it does, how to run it, what was measured
(file, command, commit). No word of how its work was organised: leases of a machine, work sessions, tool calls,
carry limits, issue numbers.

Scanned: README.md, CONTRIBUTING.md, docs/**/*.md, scripts/*, benchmarks/results/README.md and the Python code of
kvjax/, eval/, benchmarks/, kernels_pallas/ and train_less/. Not scanned: benchmarks/results/archive/ and the
generated result files (benchmarks/results/**: JSON, logs, XML, tables), which record runs as they were.

Plain text, no JAX work.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("kvjax", "eval", "benchmarks", "kernels_pallas", "train_less")

# (name, pattern): every match is a hit unless ``allowed`` says otherwise.
RULES = [
    ("lease", re.compile(r"\blease[sd]?\b", re.I)),
    ("session", re.compile(r"\bsessions?\b", re.I)),
    ("issue number", re.compile(r"\bissues?\s*#?\s*\d+", re.I)),
    ("carry limit", re.compile(r"\bcarry[\s_-]+limits?\b", re.I)),
    ("tool call", re.compile(r"\btool[\s_-]+calls?\b", re.I)),
    ("device tool", re.compile(r"\bdevice[\s_-]+tool\b", re.I)),
    ("lent", re.compile(r"\blent\b", re.I)),
    ("the issue", re.compile(r"\b(?:the|this|that|an?|our)\s+(?:[a-z-]+\s+)?issue(?:'s)?\b", re.I)),
]

# A session that is not a work session: pytest's "test session", an HTTP/serving/client session, or a ``Session``
# object in code (``requests.Session()``, ``tf.Session``).
_OTHER_SESSION = re.compile(r"(?:\b(?:test|http|https|serving|client|server|inference)[\s_-]+|\.)$", re.I)


def allowed(rule: str, line: str, m: re.Match) -> bool:
    if rule != "session":
        return False
    if _OTHER_SESSION.search(line[: m.start()]):
        return True
    return m.group(0) == "Session" and line[m.end() : m.end() + 1] == "("


def scanned_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "results" / "README.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    files += sorted(p for p in (ROOT / "scripts").iterdir() if p.is_file())
    for d in CODE_DIRS:
        files += sorted(p for p in (ROOT / d).rglob("*.py") if "results" not in p.relative_to(ROOT).parts)
    return [p for p in files if p.is_file()]


def hits(path: Path) -> list[str]:
    out = []
    rel = path.relative_to(ROOT).as_posix()
    for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        for rule, pattern in RULES:
            for m in pattern.finditer(line):
                if not allowed(rule, line, m):
                    out.append(f"{rel}:{lineno}: {rule} ({m.group(0)!r}): {line.strip()[:120]}")
    return out


def test_rules_flag_what_they_should():
    def flagged(line):
        tmp = [(r, m) for r, p in RULES for m in p.finditer(line) if not allowed(r, line, m)]
        return [r for r, _ in tmp]

    assert flagged("the next lease retakes them") == ["lease"]
    assert flagged("two GPU leases") == ["lease"]
    assert flagged("until a session with a device runs it") == ["session"]
    assert flagged("three helper sessions' tests") == ["session"]
    assert flagged("(issue 58)") == ["issue number"]
    assert flagged("see issue #17") == ["issue number"]
    assert flagged("over the device tool's 64 MiB carry limit") == ["carry limit", "device tool"]
    assert flagged("at most 8 files per tool call") == ["tool call"]
    assert flagged("the time a task is lent") == ["lent"]
    assert flagged("Populated by the evaluation issue.") == ["the issue"]
    assert flagged("(the issue's +10%)") == ["the issue"]
    # legitimate uses
    assert flagged("============ test session starts ============") == []
    assert flagged("an HTTP session per client, a serving session") == []
    assert flagged("s = requests.Session()") == []
    assert flagged("release the buffers; please; silent; lenticular; Leased_x") == []


def test_scanned_files_exist():
    names = {p.relative_to(ROOT).as_posix() for p in scanned_files()}
    assert {"README.md", "docs/performance.md", "scripts/accelerator_steps.sh", "kvjax/engine/__init__.py"} <= names
    assert not any(n.startswith("benchmarks/results/") and n != "benchmarks/results/README.md" for n in names)


def test_docs_and_code_speak_of_kvjax_alone():
    problems = [h for p in scanned_files() for h in hits(p)]
    assert not problems, (
        "the docs, scripts and code speak of kvjax alone (what it does, how to run it, what was measured: file, "
        "command, commit), not of leases, work sessions, tool calls, carry limits or issue numbers:\n"
        + "\n".join(problems)
    )
