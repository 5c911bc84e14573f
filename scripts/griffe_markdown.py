"""Griffe extension (mkdocs.yml's mkdocstrings ``extensions``): kvjax's docstrings as the API reference renders them.

The docstrings are written for reading in the source and in ``help()``: Sphinx roles name other objects
(``:func:`generate```, ``:meth:`~kvjax.methods.base.Method.held```) and examples are doctest lines (``>>> ...``).
Markdown knows neither, so the reference would print the roles raw and run the examples together into one
paragraph. :func:`to_markdown` turns a role into a code span of the name (``~`` keeps its last part, as Sphinx
does) and a run of doctest lines (with their ``...`` continuations and output) into a fenced Python block.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|attr|data|obj|exc|const|type):`(~?)([^`]+)`")


def _role(m: re.Match) -> str:
    name = m.group(2).strip()
    if m.group(1):
        name = name.rsplit(".", 1)[-1]
    return f"`{name}`"


def to_markdown(text: str) -> str:
    """``text`` with Sphinx roles as code spans and doctest runs as fenced ``python`` blocks."""
    text = ROLE.sub(_role, text)
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(">>>"):
            indent = line[: len(line) - len(line.lstrip())]
            block = []
            while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
                block.append(lines[i][len(indent) :])
                i += 1
            if out and out[-1].strip():
                out.append("")
            out += [indent + "```python", *(indent + b for b in block), indent + "```"]
            if i < len(lines) and lines[i].strip():
                out.append("")
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


class SphinxToMarkdown(griffe.Extension):
    """Rewrite every loaded object's docstring with :func:`to_markdown`."""

    def on_instance(self, *, node, obj, agent, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
