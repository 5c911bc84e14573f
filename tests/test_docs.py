"""The repository explains itself: every documentation link resolves inside it, and nothing points outside.

- Relative markdown links ``[text](path)`` / ``[text](path#anchor)`` in README.md, CHANGELOG.md, docs/**/*.md,
  the results index (benchmarks/results/README.md) and the markdown cells of colab/*.ipynb resolve to a file or
  folder of the repository; an anchor must match a heading of the target (GitHub's slug rule) or an HTML
  ``id``/``name``.
- No file names a repository URL for kvjax: it has no public repository, so an install or a link through one
  (``github.com/<owner>/kvjax``, a Colab ``/github/`` link) cannot work; a clone installs with ``pip install -e .``.
- Every ``docs/....md`` path (with its ``#anchor``, if any) named in a .py file exists.
- No py, md, toml, sh or ipynb file mentions the pre-publication design files that lived outside the repository.

No JAX work: plain text parsing, fast.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {
    ".git",
    ".venv",
    "venv",
    "build",
    "dist",
    "runs",
    "results",
    "node_modules",
    "__pycache__",
    ".pytest_cache",
    ".ipynb_checkpoints",
}

# Assembled with + so that this file does not name them itself.
UNREACHABLE = ("github.com/" + "kvjax/kvjax", "colab.research.google.com/" + "github/kvjax")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'][^)]*[\"'])?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+[\"'].*[\"'])?\s*$", re.M)
DOCS_PATH = re.compile(r"(?<![\w/.-])(docs/(?:[\w-]+/)*[\w-]+\.md)(#[\w-]+)?")
# Assembled with + so that this file does not trip its own check (ruff format joins implicit concatenations).
FORBIDDEN = ("../" + "shared", "shared" + "/specs", "DES" + "IGN" + ".md")


def repo_files(*suffixes: str) -> list[Path]:
    """Files of the working tree with these suffixes: git's view (tracked + untracked, not ignored) when
    available, else a walk that skips build and virtual-environment folders."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        paths = [ROOT / p for p in out]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in ROOT.rglob("*") if not (set(p.relative_to(ROOT).parts[:-1]) & SKIP_DIRS)]
    return sorted(p for p in paths if p.is_file() and p.name.endswith(suffixes))


def rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


# ---------------------------------------------------------------------------------------------------------------
# Markdown: code stripping, headings and GitHub's anchor slugs.


def strip_code_blocks_only(text: str) -> str:
    """Markdown with fenced code blocks blanked (line numbers kept; headings keep their inline code, which GitHub
    renders as text)."""
    out, fence = [], None
    for line in text.splitlines():
        m = re.match(r"^\s{0,3}(`{3,}|~{3,})", line)
        if fence is None and m:
            fence = m.group(1)
            out.append("")
            continue
        if fence is not None:
            if line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
                fence = None
            out.append("")
            continue
        out.append(line)
    return "\n".join(out)


def strip_code(text: str) -> str:
    """Markdown without fenced code blocks and inline code spans (links there are not links)."""
    return "\n".join(re.sub(r"(`+)(?:(?!\1).)+?\1", "", line) for line in strip_code_blocks_only(text).splitlines())


def github_slug(heading: str) -> str:
    """GitHub's heading anchor: the rendered text, lower-cased, punctuation other than ``-`` and ``_`` dropped,
    spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images -> their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(text: str) -> set[str]:
    """Anchors a markdown text defines: heading slugs (duplicates numbered ``-1``, ``-2`` as GitHub does) and
    HTML ``id``/``name`` attributes."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    body = strip_code_blocks_only(text)
    for line in body.splitlines():
        m = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    out |= set(re.findall(r"<[^>]+\b(?:id|name)=[\"']([^\"']+)[\"']", text))
    return out


def notebook_markdown(path: Path) -> str:
    cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
    return "\n\n".join(
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        for c in cells
        if c.get("cell_type") == "markdown"
    )


def notebook_text(path: Path) -> str:
    cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
    return "\n".join("".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells)


def markdown_of(path: Path) -> str:
    return notebook_markdown(path) if path.suffix == ".ipynb" else path.read_text(encoding="utf-8")


def links(text: str) -> list[str]:
    body = strip_code(text)
    return INLINE_LINK.findall(body) + REFERENCE_DEF.findall(body)


def check_target(source: str, link: str, base: Path) -> str | None:
    """None if ``link`` (a path relative to ``base``, optionally ``#anchor``) resolves inside the repository,
    else what is missing."""
    path, _, anchor = link.partition("#")
    target = (base / path).resolve() if path else None
    if target is not None:
        try:
            target.relative_to(ROOT)
        except ValueError:
            return f"{source}: link {link!r} points outside the repository ({target})"
        if not target.exists():
            return f"{source}: link {link!r}: {target.relative_to(ROOT).as_posix()} does not exist"
    # Anchors are checked in markdown pages and notebooks; same-page anchors (no path) by the caller.
    if anchor and target is not None and target.is_file() and target.suffix in (".md", ".ipynb"):
        known = anchors_of(markdown_of(target))
        if anchor not in known:
            return (
                f"{source}: link {link!r}: {rel(target)} has no heading with anchor #{anchor} "
                f"(its anchors: {', '.join(sorted(known)) or 'none'})"
            )
    return None


DOC_FILES = [
    p
    for p in repo_files(".md", ".ipynb")
    if rel(p) in ("README.md", "CHANGELOG.md", "benchmarks/results/README.md")
    or rel(p).startswith("docs/")
    or (rel(p).startswith("colab/") and p.suffix == ".ipynb")
]


@pytest.mark.parametrize("path", DOC_FILES, ids=rel)
def test_relative_links_resolve(path):
    text = markdown_of(path)
    problems = []
    own = anchors_of(text)
    for link in links(text):
        if not link or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", link):  # http:, https:, mailto:, ...
            continue
        if link.startswith("#"):
            if link[1:] not in own:
                problems.append(f"{rel(path)}: link {link!r}: no heading with anchor {link} in this file")
            continue
        if link.startswith("/"):
            problems.append(f"{rel(path)}: link {link!r} is absolute; use a path relative to {rel(path.parent) or '.'}")
            continue
        problem = check_target(rel(path), link, path.parent)
        if problem:
            problems.append(problem)
    assert not problems, "broken documentation links:\n" + "\n".join(problems)


def test_no_file_names_an_unreachable_repository():
    problems = []
    for path in repo_files(".md", ".ipynb", ".py", ".toml", ".sh", ".yml", ".yaml", ".cfg", ".txt"):
        for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            problems += [f"{rel(path)}:{lineno}: {bad}" for bad in UNREACHABLE if bad in line]
    assert not problems, (
        "kvjax has no public repository; install from the clone (pip install -e .) and link relatively:\n"
        + "\n".join(problems)
    )


def test_docs_paths_named_in_python_exist():
    problems = []
    for path in repo_files(".py"):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in DOCS_PATH.finditer(line):
                doc, anchor = m.group(1), (m.group(2) or "")[1:]
                target = ROOT / doc
                if not target.is_file():
                    problems.append(f"{rel(path)}:{lineno}: {doc} does not exist")
                elif anchor and anchor not in anchors_of(target.read_text(encoding="utf-8")):
                    problems.append(f"{rel(path)}:{lineno}: {doc} has no heading with anchor #{anchor}")
    assert not problems, "documentation paths in source files that do not resolve:\n" + "\n".join(problems)


def test_nothing_points_outside_the_repository():
    problems = []
    for path in repo_files(".py", ".md", ".toml", ".sh", ".ipynb"):
        text = path.read_text(encoding="utf-8")
        for lineno, line in enumerate(text.splitlines(), 1):
            for bad in FORBIDDEN:
                if bad in line:
                    problems.append(f"{rel(path)}:{lineno}: mentions {bad!r}: {line.strip()[:100]}")
    assert not problems, (
        "files point outside the repository (use docs/architecture.md, docs/interface.md or "
        "docs/notes/<method>.md):\n" + "\n".join(problems)
    )


def test_github_slug_rule():
    assert github_slug("Fixed shapes") == "fixed-shapes"
    assert github_slug("Measure, don't assume") == "measure-dont-assume"
    assert github_slug("`decode_attention`") == "decode_attention"
    assert github_slug("Multi-device (not yet implemented)") == "multi-device-not-yet-implemented"
    assert github_slug("The [budget](x.md) contract") == "the-budget-contract"
    assert anchors_of("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


NOTES_TO_OURSELVES = re.compile(r"\bissues? #?\d+\b|\bmoved (?:here )?from\b|\(moved\b", re.I)


def test_user_docs_hold_no_notes_to_ourselves():
    """The README, the changelog and docs/ speak to a user: no "the goal of issue N", no "moved here from the
    README, 2026-11-27" (the history of the project's own work belongs to git)."""
    problems = []
    for path in [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in NOTES_TO_OURSELVES.finditer(line):
                problems.append(f"{rel(path)}:{lineno}: {m.group(0)!r}: {line.strip()[:100]}")
    assert not problems, "notes to ourselves in the user documentation:\n" + "\n".join(problems)


def layout_section(layout: str, parts: list[str]) -> str | None:
    """The lines of the layout's tree under the folder ``parts`` (``["kvjax", "methods", "core"]``): its own line and
    the more deeply indented lines below it; None where a folder of the path has no line of its own."""
    lines, lo, hi, depth = layout.splitlines(), 0, None, -1
    for part in parts:
        for i in range(lo, len(lines) if hi is None else hi):
            line = lines[i]
            indent = len(line) - len(line.lstrip())
            if indent > depth and line.strip().startswith(f"{part}/"):
                end = i + 1
                while end < len(lines) and (
                    not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent
                ):
                    end += 1
                lo, hi, depth = i, end, indent
                break
        else:
            return None
    return "\n".join(lines[lo:hi])


def test_the_architecture_layout_names_every_module():
    """docs/architecture.md's layout names every package and module of ``kvjax/``, each under its own package's line
    (``kvjax/methods/core/select.py`` as ``select.py`` below ``core/`` below ``methods/``), and every kernel of
    ``kernels_pallas/`` (a module added without a line there fails)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    layout = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    missing = []
    for path in sorted((ROOT / "kvjax").rglob("*.py")):
        parts = list(path.relative_to(ROOT).parts)
        section = layout_section(layout, parts[:-1])
        if path.name == "__init__.py":  # a package: its folder's line
            if section is None:
                missing.append("/".join(parts[:-1]) + "/")
        elif section is None or not re.search(rf"(?<![\w/.]){re.escape(path.name)}\b", section):
            missing.append("/".join(parts))
    kernels = [p.name for p in (ROOT / "kernels_pallas").iterdir() if (p / "__init__.py").is_file()]
    missing += [k for k in kernels if k not in layout]
    assert not missing, f"docs/architecture.md's layout does not name {missing}"
    # the check can fail: a module named only under another package is missing from its own
    assert layout_section(layout, ["kvjax", "methods", "core"]) is not None
    assert "core.py" in layout and "core.py" not in layout_section(layout, ["kvjax", "methods"])
