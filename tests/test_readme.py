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
