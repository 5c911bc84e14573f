"""The method written in docs/interface.md ("Writing your own method") runs as printed: its first two code blocks
are executed in one namespace (the sketch subclasses ``SlotMethod``; the second block generates with it and checks
its tokens held against its own ``held``), so the doc cannot drift from the interface. The third, the one-score
method, is ``docs/examples/knorm.py``'s class as the file has it (tests/kvjax/test_new_method.py runs the file)."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "interface.md"


def _example_blocks() -> list[str]:
    text = DOC.read_text()
    section = text[text.index("## Writing your own method") :]
    section = section[: section.index("\n## ", 3)] if "\n## " in section[3:] else section
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_documented_method_runs_as_printed():
    blocks = _example_blocks()
    assert len(blocks) == 3, "the section should hold the method, its use and the one-score method"
    ns = {"__name__": "interface_example"}
    exec(compile(blocks[0], "interface.md: the method", "exec"), ns)  # noqa: S102
    from kvjax.methods import SlotMethod

    assert issubclass(ns["RecentOnly"], SlotMethod) and len(blocks[0].splitlines()) <= 45
    exec(compile(blocks[1], "interface.md: its use", "exec"), ns)  # noqa: S102 (asserts held() inside)
    assert ns["st"]["tokens_held"] == 15


def test_the_one_score_method_is_the_example_file():
    knorm = (DOC.parent / "examples" / "knorm.py").read_text()
    block = _example_blocks()[2]
    lines = [line for line in block.splitlines() if line.strip()]
    assert lines[0] == "@register" and "class Knorm(ScoringMethod):" in block
    file_lines = [line for line in knorm.splitlines() if line.strip()]
    start = file_lines.index(lines[0])
    code = [line for line in file_lines[start:] if not line.strip().startswith('"""')]  # the class docstring aside
    assert code == lines, "docs/interface.md's Knorm is not docs/examples/knorm.py's class"
