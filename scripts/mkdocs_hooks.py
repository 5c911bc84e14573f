"""mkdocs hook (mkdocs.yml's ``hooks``): the repository inside the site, and the README on its home page.

**Files outside docs/.** The pages link to files outside docs/ with relative paths (``../kvjax/methods/base.py``,
``../benchmarks/results/roofline_cpu_32k.png``, ``../colab/01_quickstart.ipynb``), which work in a clone and in any
repository browser. The site has no repository to link to, so every such file is copied into it under ``_repo/``
(:func:`on_files`; a Markdown file becomes a page there, a directory a page listing its files) and the link is
rewritten to that copy, so every link and image resolves inside the built site and mkdocs validates it like any
other (``--strict`` fails on a missing one). A link to a path that does not exist, or outside the repository, is an
error. ``../README.md`` is the home page. Links in code spans and fenced blocks are left alone.

**The home page** (docs/README.md) holds ``<!-- README: Section, Section -->``: the hook puts there the README's
introduction (its text before the first section) and the named sections, links re-rooted, so the site's front door
and the README are one text (tests/test_site.py checks the built page against the README).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, InclusionLevel

REPO_DIR = "_repo"
LINK = re.compile(r"(!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\()\s*<?([^)\s>]+)>?(\s+[\"'][^)]*[\"'])?\s*\)")
FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
README_MARK = re.compile(r"^<!-- README: (.*?) -->$", re.M)


def _is_url(target: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target)) or target.startswith(("#", "/"))


def _lines_outside_fences(markdown: str):
    """``(line, outside)`` for every line: ``outside`` is False inside a fenced block (and on its fences)."""
    fence = None
    for line in markdown.split("\n"):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            yield line, False
        elif fence is not None:
            if line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
                fence = None
            yield line, False
        else:
            yield line, True


def _targets(markdown: str):
    """Every link target of ``markdown`` outside code spans and fenced blocks."""
    for line, outside in _lines_outside_fences(markdown):
        if outside:
            for m in LINK.finditer(CODE_SPAN.sub("", line)):
                yield m.group(2)


class _Repo:
    """Where each file of the repository lives in the site: docs/ files where they are, the others under _repo/."""

    def __init__(self, config):
        self.docs = Path(config["docs_dir"]).resolve()
        self.root = Path(config["config_file_path"]).resolve().parent
        self.copied: dict[str, Path] = {}  # site path (under _repo/) -> the file it copies
        self.listings: dict[str, Path] = {}  # site path of a directory's listing page -> the directory

    def resolve(self, target: str, real_dir: Path, source: str) -> tuple[Path, str] | None:
        """``(real path, anchor)`` of a relative link from a file in ``real_dir``; None for a URL or an anchor."""
        if _is_url(target):
            return None
        path, _, anchor = target.partition("#")
        resolved = (real_dir / path).resolve()
        try:
            resolved.relative_to(self.root)
        except ValueError:
            raise PluginError(f"{source}: link {target!r} points outside the repository") from None
        if not resolved.exists():
            rel = resolved.relative_to(self.root).as_posix()
            raise PluginError(f"{source}: link {target!r}: {rel} does not exist in the repository")
        return resolved, anchor

    def site_path(self, real: Path) -> Path:
        """The path, as if under docs/, of the site's copy of ``real`` (registering it to be copied)."""
        try:
            real.relative_to(self.docs)
            return real
        except ValueError:
            pass
        rel = real.relative_to(self.root).as_posix()
        if rel == "README.md":
            return self.docs / "README.md"  # the home page
        if real.is_dir():
            listing = f"{REPO_DIR}/{rel}/index.md"
            self.listings[listing] = real
            for child in sorted(real.iterdir()):
                if child.is_file() and not child.name.startswith("."):
                    self.copied.setdefault(f"{REPO_DIR}/{rel}/{child.name}", child)
            return self.docs / listing
        self.copied.setdefault(f"{REPO_DIR}/{rel}", real)
        return self.docs / REPO_DIR / rel

    def rewrite(self, markdown: str, real_dir: Path, page_dir: Path, source: str) -> str:
        """``markdown`` (from a file in ``real_dir``, shown on a page in ``page_dir`` under docs/) with every
        relative link pointing at the site's copy of its target, relative to the page."""

        def fix(m: re.Match) -> str:
            found = self.resolve(m.group(2), real_dir, source)
            if found is None:
                return m.group(0)
            real, anchor = found
            link = os.path.relpath(self.site_path(real), page_dir).replace(os.sep, "/")
            return f"{m.group(1)}{link}{'#' + anchor if anchor else ''}{m.group(3) or ''})"

        out = []
        for line, outside in _lines_outside_fences(markdown):
            if outside:
                spans: list[str] = []

                def hide(m: re.Match) -> str:
                    spans.append(m.group(0))
                    return f"\x00{len(spans) - 1}\x00"

                line = LINK.sub(fix, CODE_SPAN.sub(hide, line))
                line = re.sub(r"\x00(\d+)\x00", lambda m: spans[int(m.group(1))], line)
            out.append(line)
        return "\n".join(out)

    def real_dir_of(self, src_uri: str) -> Path:
        """The directory of the repository file a page shows (a copied page: the original's)."""
        if src_uri.startswith(REPO_DIR + "/"):
            original = self.copied.get(src_uri)
            if original is not None:
                return original.parent
            return self.listings[src_uri]
        return (self.docs / src_uri).parent


_repo: _Repo | None = None


def readme_sections(readme: str, names: list[str]) -> str:
    """The README's introduction (before its first ``## ``) without its title, then the sections ``names``."""
    intro, *rest = re.split(r"^(?=## )", readme, flags=re.M)
    sections = {re.match(r"## ([^\n(]*)", s).group(1).strip(): s for s in rest}
    missing = [n for n in names if n not in sections]
    if missing:
        raise PluginError(f"docs/README.md asks for README sections {missing}; it has {sorted(sections)}")
    intro = re.sub(r"^# [^\n]*\n", "", intro).strip()
    return "\n\n".join([intro] + [sections[n].strip() for n in names])


def on_files(files, config):
    """Register every file outside docs/ that a page links to (and, for a copied Markdown page, what it links to)."""
    global _repo
    _repo = repo = _Repo(config)
    readme = (repo.root / "README.md").read_text(encoding="utf-8")
    todo = []
    for f in files.documentation_pages():
        text = Path(f.abs_src_path).read_text(encoding="utf-8")
        m = README_MARK.search(text)
        if m:
            todo.append((readme_sections(readme, [s.strip() for s in m.group(1).split(",")]), repo.root, "README.md"))
        todo.append((text, Path(f.abs_src_path).parent, f.src_uri))
    seen: set[str] = set()
    while todo:
        text, real_dir, source = todo.pop()
        for target in _targets(text):
            found = repo.resolve(target, real_dir, source)
            if found is not None:
                repo.site_path(found[0])
        for uri, real in list(repo.copied.items()):  # a copied Markdown page: what it links to is copied too
            if uri not in seen and real.suffix == ".md":
                seen.add(uri)
                todo.append((real.read_text(encoding="utf-8"), real.parent, real.relative_to(repo.root).as_posix()))
    for uri, real in repo.copied.items():
        files.append(File.generated(config, uri, abs_src_path=str(real), inclusion=InclusionLevel.NOT_IN_NAV))
    for uri, folder in repo.listings.items():
        rel = folder.relative_to(repo.root).as_posix()
        names = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
        body = f"# `{rel}/`\n\nThe files of `{rel}/` in the repository:\n\n" + "\n".join(
            f"- [`{n}`]({n})" for n in names
        )
        files.append(File.generated(config, uri, content=body + "\n", inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    repo = _repo
    src = page.file.src_uri
    page_dir = (repo.docs / src).parent
    m = README_MARK.search(markdown)
    if m:
        readme = (repo.root / "README.md").read_text(encoding="utf-8")
        part = readme_sections(readme, [s.strip() for s in m.group(1).split(",")])
        part = repo.rewrite(part, repo.root, page_dir, "README.md")
        before, after = markdown[: m.start()], markdown[m.end() :]
        return repo.rewrite(before, page_dir, page_dir, src) + part + repo.rewrite(after, page_dir, page_dir, src)
    return repo.rewrite(markdown, repo.real_dir_of(src), page_dir, src)
