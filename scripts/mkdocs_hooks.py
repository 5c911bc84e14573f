"""mkdocs hook (mkdocs.yml's ``hooks``): links from docs/ to the rest of the repository.

The pages link to files outside docs/ with relative paths (``../kvjax/methods/base.py``,
``../benchmarks/results/roofline_cpu_32k.txt``, ``../colab/01_quickstart.ipynb``), which work on GitHub. On the
site they would be broken, so each such link is checked to name an existing path of the repository (a missing one
is an error: the strict build fails) and rewritten to that path on GitHub. Links inside docs/ are mkdocs's own
(validated by mkdocs.yml's ``validation``); links in code spans and fenced blocks are left alone.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.exceptions import PluginError

REPO_URL = "https://github.com/kvjax/kvjax"
LINK = re.compile(r"(!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\()\s*<?([^)\s>]+)>?(\s+[\"'][^)]*[\"'])?\s*\)")
FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def _rewrite(line: str, page_dir: Path, docs_dir: Path, root: Path, source: str) -> str:
    def fix(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return m.group(0)
        path, _, anchor = target.partition("#")
        resolved = (page_dir / path).resolve()
        try:
            resolved.relative_to(docs_dir)
            return m.group(0)  # inside docs/: mkdocs checks it
        except ValueError:
            pass
        try:
            rel = resolved.relative_to(root).as_posix()
        except ValueError:
            raise PluginError(f"{source}: link {target!r} points outside the repository") from None
        if not resolved.exists():
            raise PluginError(f"{source}: link {target!r}: {rel} does not exist in the repository")
        kind = "tree" if resolved.is_dir() else "blob"
        url = f"{REPO_URL}/{kind}/main/{rel}" + (f"#{anchor}" if anchor else "")
        return f"{m.group(1)}{url}{m.group(3) or ''})"

    # Code spans are set aside (a link's text may hold one; a link inside one is not a link), then put back.
    spans: list[str] = []

    def hide(m: re.Match) -> str:
        spans.append(m.group(0))
        return f"\x00{len(spans) - 1}\x00"

    hidden = LINK.sub(fix, CODE_SPAN.sub(hide, line))
    return re.sub(r"\x00(\d+)\x00", lambda m: spans[int(m.group(1))], hidden)


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs_dir = Path(config["docs_dir"]).resolve()
    root = Path(config["config_file_path"]).resolve().parent
    page_dir = (docs_dir / page.file.src_path).parent
    lines, fence = [], None
    for line in markdown.split("\n"):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
            fence = None
        elif fence is None:
            line = _rewrite(line, page_dir, docs_dir, root, page.file.src_path)
        lines.append(line)
    return "\n".join(lines)
