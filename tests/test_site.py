"""The documentation site is a front door: ``mkdocs build --strict`` (mkdocs.yml) succeeds, so a broken link or
anchor, a page missing from the nav or a docstring of the API reference that does not render fails the suite; then

- every link and image of every built page resolves to a file of the built site (files outside docs/ are copied in
  under ``_repo/`` by scripts/mkdocs_hooks.py; nothing points to a repository that does not exist);
- the home page is the README's introduction, install, quickstart, methods table and results with their figures
  (taken from README.md at build time, so the two cannot drift), and the rest of the docs' index;
- the API reference renders: no raw Sphinx role, its doctest examples are code blocks, the registry's ``get`` and
  ``register`` come first on their page, and test-only hooks (``small_options``, ``small_variants``) are not in it;
- a headless browser visits every page (one browser, the pages one after another in a frame: fast) and finds no
  console error, no image that did not load, no raw reST in the text, no page wider than the window and no table,
  code block or image wider than its column (they scroll inside it); a screenshot of the home page and of a method
  page is written.

Skipped with the reason where mkdocs is not installed (``pip install -e ".[docs]"``, which scripts/install.sh
does) or where no browser is (Playwright's Python package with a system Chromium or its own, or the ``chromium``
command from the system packages). No downloads: a browser is never installed here. The build takes about 15 s.
"""

from __future__ import annotations

import functools
import html
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.docs
PAGES = {"home": "", "method": "methods/chelsea/"}
SYSTEM_CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome", "chrome")) if p), None
)
RAW_ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|attr|data|obj|exc|const):(?:`|<code)")


def _mkdocs_missing() -> str | None:
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed: pip install -e '.[docs]' (scripts/install.sh installs it)"
    return None


def build(site: Path, config: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    if config is not None:
        cmd += ["--config-file", str(config)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    reason = _mkdocs_missing()
    if reason:
        pytest.skip(reason)
    site = tmp_path_factory.mktemp("site")
    out = build(site)
    warnings = [line for line in (out.stdout + out.stderr).splitlines() if "WARNING" in line or "ERROR" in line]
    assert out.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(warnings or [out.stderr[-4000:]])
    return site


def pages(site: Path) -> list[Path]:
    return sorted(site.rglob("index.html"))


def url_of(site: Path, page: Path) -> str:
    rel = page.parent.relative_to(site).as_posix()
    return "" if rel == "." else rel + "/"


def unresolved(site: Path) -> list[str]:
    """Every ``href``/``src`` of every page that is relative and names no file of the built site, or that points to
    kvjax on GitHub or Colab (it has no public repository)."""
    problems = []
    for page in pages(site):
        base = "http://site/" + url_of(site, page)
        for attr, target in re.findall(r'\b(href|src)="([^"]*)"', page.read_text(encoding="utf-8")):
            target = html.unescape(target)
            if not target or target.startswith(("#", "mailto:", "data:", "javascript:")):
                continue
            url = urlparse(urljoin(base, target))
            if url.netloc != "site":  # another site (a paper, the theme's): only kvjax's own files must be here
                if "kvjax" in url.path and url.netloc in ("github.com", "colab.research.google.com"):
                    problems.append(f"{url_of(site, page) or '/'}: {attr}={target!r}: a repository that does not exist")
                continue
            path = site / unquote(url.path).lstrip("/")
            if not (path.is_file() or (path / "index.html").is_file()):
                problems.append(f"{url_of(site, page) or '/'}: {attr}={target!r} does not resolve")
    return problems


def test_the_site_builds_strictly_with_the_api_reference(site):
    assert (site / "index.html").is_file()
    for page in ("kvjax", "methods", "interface", "engine", "budget", "eval", "eval-tasks", "train_less"):
        html_ = (site / "api" / page / "index.html").read_text(encoding="utf-8")
        assert html_.count('class="doc doc-heading"') >= 3, f"api/{page}: too few rendered docstrings"
    engine = (site / "api" / "engine" / "index.html").read_text(encoding="utf-8")
    assert "decode_step" in engine and "run_loop" in engine


def test_every_link_and_image_resolves_inside_the_site(site):
    problems = unresolved(site)
    assert not problems, "links and images of the built site that resolve to nothing:\n" + "\n".join(problems)
    # the code a page links to and the figures it shows are in the site itself
    chelsea = (site / "methods" / "chelsea" / "index.html").read_text(encoding="utf-8")
    assert 'href="../../_repo/kvjax/methods/chelsea/__init__.py"' in chelsea
    assert (site / "_repo" / "kvjax" / "methods" / "chelsea" / "__init__.py").is_file()
    performance = (site / "performance" / "index.html").read_text(encoding="utf-8")
    figures = re.findall(r'<img[^>]*src="([^"]+\.png)"', performance)
    assert figures, "the performance page shows no figure"
    for src in figures:
        data = (site / "performance" / src).resolve().read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", f"performance: {src} is not a PNG"


def test_a_broken_link_fails_the_check(site, tmp_path):
    """The link check above can fail: a copy of the built site with one image removed and one page's link cut."""
    broken = tmp_path / "site"
    shutil.copytree(site, broken)
    (broken / "_repo" / "benchmarks" / "results" / "roofline_cpu_32k.png").unlink()
    home = broken / "index.html"
    home.write_text(home.read_text(encoding="utf-8").replace('href="usage/"', 'href="no-such-page/"', 1))
    problems = "\n".join(unresolved(broken))
    assert "roofline_cpu_32k.png" in problems and "no-such-page/" in problems, problems


def _text(html_: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", html_))


def test_the_home_page_is_the_readme(site):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    home = (site / "index.html").read_text(encoding="utf-8")
    article = home.split('<article class="md-content__inner md-typeset">', 1)[1].split("</article>", 1)[0]
    text = " ".join(_text(article).split())
    intro = readme.split("\n## ", 1)[0].split("\n", 1)[1].strip()
    first_sentence = " ".join(re.sub(r"[`*]", "", intro.split(". ")[0]).split())
    assert first_sentence in text, "the home page does not open with the README's introduction"
    for section in ("Install", "Quickstart", "Methods", "Results"):
        assert re.search(rf"<h2 id=\"[^\"]*\">{section}\b", article), f"the home page has no '{section}' section"
    install = re.search(r"## Install\n.*?```bash\n(.*?)```", readme, re.S).group(1)
    quickstart = re.search(r"## Quickstart\n.*?```python\n(.*?)```", readme, re.S).group(1)
    code = [_text(c) for c in re.findall(r"<code[^>]*>(.*?)</code>", article, re.S)]
    for block, name in ((install, "install"), (quickstart, "quickstart")):
        assert any(block.strip() == c.strip() for c in code), f"the home page's {name} differs from the README's"
    table = readme.split("## Methods", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| \[?`([a-z_0-9]+)`", table, re.M)
    home_rows = re.findall(r"<tr>\s*<td>(?:<a [^>]*>)?<code>([a-z_0-9]+)</code>", article)
    assert home_rows == rows, f"the home page's methods table {home_rows}, the README's {rows}"
    results = readme.split("## Results", 1)[1].split("\n## ", 1)[0]
    figures = [Path(f).name for f in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", results)]
    assert figures and all(f in article for f in figures), f"the home page lacks the README's figures {figures}"


def test_a_name_in_a_table_cell_is_never_split_mid_word():
    """The stylesheet keeps code in table cells whole (``streaming_llm`` on one line; the table scrolls instead)."""
    css = (ROOT / "docs" / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    rule = re.search(r"\.md-typeset td code,\s*\.md-typeset th code\s*\{([^}]*)\}", css)
    assert rule and "white-space: nowrap" in rule.group(1) and "word-break: keep-all" in rule.group(1)


def test_the_api_reference_renders_as_markdown(site):
    problems = []
    for page in pages(site):
        body = page.read_text(encoding="utf-8")
        article = body.split('<article class="md-content__inner md-typeset">', 1)[-1]
        for m in RAW_ROLE.finditer(article):
            problems.append(f"{url_of(site, page)}: raw role {article[m.start() : m.start() + 40]!r}")
        outside_pre = re.sub(r"<pre.*?</pre>", "", article, flags=re.S)
        if "&gt;&gt;&gt;" in outside_pre:
            problems.append(f"{url_of(site, page)}: a doctest line outside a code block")
    assert not problems, "\n".join(problems)
    methods = (site / "api" / "methods" / "index.html").read_text(encoding="utf-8")
    examples = [p for p in re.findall(r"<pre.*?</pre>", methods, re.S) if "kvjax.methods.get(" in _text(p)]
    assert examples and ">>> kvjax.methods.get(" in _text(examples[0]), "kvjax.methods' examples are not a code block"
    order = [methods.find(f'id="kvjax.methods.{name}"') for name in ("get", "register", "SnapKV")]
    assert -1 not in order and order == sorted(order), f"get, register, then the methods: positions {order}"
    for page in (site / "api").rglob("index.html"):
        for hook in ("small_options", "small_variants", "kvjax.methods.small", "kvjax.methods.cover"):
            assert f'id="{hook}' not in page.read_text(encoding="utf-8").replace("base.Method.", ""), (
                f"{page.parent.name}: the test-only {hook} is in the API reference"
            )


# ---- the browser ----------------------------------------------------------------------------------------------

CHECKER = """<!doctype html><meta charset="utf-8"><title>every page</title>
<iframe id="f" style="width:1280px;height:900px;border:0"></iframe>
<script>
const pages = %s;
const raw = /:(?:py:)?(?:func|meth|class|mod|attr|data|obj|exc):`?[A-Za-z_~]/;
let i = 0, bad = 0;
const frame = document.getElementById("f");
function check() {
  const url = pages[i], doc = frame.contentDocument, win = frame.contentWindow;
  for (const img of doc.images) {
    if (!img.complete || img.naturalWidth === 0) {
      bad++; console.error("Error: broken image on /" + url + ": " + img.src);
    }
  }
  const article = doc.querySelector("article") || doc.body;
  const walker = doc.createTreeWalker(article, NodeFilter.SHOW_TEXT);
  let text = "";
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (!n.parentElement.closest("pre")) text += n.textContent;
  }
  if (raw.test(text)) { bad++; console.error("Error: raw reST role on /" + url + ": " + text.match(raw)[0]); }
  if (text.includes(">>>")) { bad++; console.error("Error: a doctest line outside a code block on /" + url); }
  const wide = doc.documentElement.scrollWidth - win.innerWidth;
  if (wide > 1) { bad++; console.error("Error: /" + url + " is " + wide + " px wider than the window"); }
  // the content column (the theme lets a table's scroll box reach into its padding), and the right edge of what
  // is seen of an element: every scrolling ancestor clips it
  const column = (article.closest(".md-content") || article).getBoundingClientRect().right;
  const shownRight = (el) => {
    let right = el.getBoundingClientRect().right;
    for (let a = el.parentElement; a && a !== doc.body; a = a.parentElement) {
      if (["auto", "scroll", "hidden"].includes(win.getComputedStyle(a).overflowX)) {
        right = Math.min(right, a.getBoundingClientRect().right);
      }
    }
    return right;
  };
  for (const el of article.querySelectorAll("table, pre, img")) {
    const over = shownRight(el) - column;
    if (over > 1) {
      bad++; console.error("Error: a " + el.tagName + " on /" + url + " overflows its column by " + over + " px");
      break;
    }
  }
  next();
}
function next() {
  if (i + 1 >= pages.length && frame.src) {
    console.log("VISITED " + pages.length + " pages, " + bad + " problems"); return;
  }
  if (frame.src) i++;
  frame.onload = () => setTimeout(check, 50);
  frame.src = "/" + pages[i];
}
next();
</script>"""


@pytest.fixture(scope="module")
def served(site):
    urls = [url_of(site, p) for p in pages(site)]
    (site / "__every_page__.html").write_text(CHECKER % json.dumps(urls), encoding="utf-8")
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/", len(urls)
    server.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _playwright_console(url: str, shot: Path, budget_ms: int) -> tuple[list[str], list[str]]:
    from playwright.sync_api import Error, sync_playwright

    errors: list[str] = []
    logs: list[str] = []
    with sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=SYSTEM_CHROMIUM, args=["--no-sandbox"])
        except Error as e:
            pytest.skip(f"Playwright has no browser to launch (no system Chromium, none installed for it): {e}")
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: (errors if m.type == "error" else logs).append(m.text))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url, wait_until="networkidle")
        if url.endswith("__every_page__.html"):
            for _ in range(100):
                if any("VISITED" in line for line in logs):
                    break
                page.wait_for_timeout(budget_ms // 100)
        page.screenshot(path=str(shot))
        browser.close()
    return errors, logs


def _chromium_console(url: str, shot: Path, budget_ms: int) -> tuple[list[str], list[str]]:
    cmd = [
        SYSTEM_CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr",
        "--v=0", "--window-size=1300,950", f"--screenshot={shot}", f"--virtual-time-budget={budget_ms}", url,
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert shot.is_file(), f"chromium wrote no screenshot:\n{out.stderr[-3000:]}"
    # console messages: '... CONSOLE(12)] "Uncaught TypeError: ...", source: http://... (12)'
    lines = [line for line in out.stderr.splitlines() if "CONSOLE" in line]
    errors = [line for line in lines if re.search(r"Uncaught|Error|Failed to load", line)]
    return errors, lines


def _browser():
    try:
        import playwright  # noqa: F401

        return _playwright_console
    except ImportError:
        pass
    if SYSTEM_CHROMIUM:
        return _chromium_console
    pytest.skip("no headless browser: install Playwright (pip) with a Chromium, or chromium from the system packages")


@pytest.mark.parametrize("name", sorted(PAGES))
def test_pages_open_without_console_errors(served, name, tmp_path):
    console = _browser()
    url, _ = served
    shot = Path(os.environ.get("KVJAX_SITE_SCREENSHOTS", tmp_path)) / f"site_{name}.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    errors, _ = console(url + PAGES[name], shot, 5000)
    assert shot.is_file() and shot.stat().st_size > 10_000, f"no screenshot of {name} ({shot})"
    assert not errors, f"console errors on {url + PAGES[name]}:\n" + "\n".join(errors)


def test_a_browser_visits_every_page(served, tmp_path):
    console = _browser()
    url, n = served
    errors, logs = console(url + "__every_page__.html", tmp_path / "every_page.png", 200_000)
    visited = [line for line in logs if "VISITED" in line]
    assert visited and f"VISITED {n} pages" in visited[-1], f"the browser did not visit all {n} pages:\n" + "\n".join(
        logs[-20:]
    )
    assert not errors, "problems found in the browser:\n" + "\n".join(errors)
