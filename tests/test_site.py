"""The documentation site: ``mkdocs build --strict`` (mkdocs.yml) succeeds, so a broken link or anchor, a page missing
from the nav or a docstring of the API reference that does not render fails the suite; then a headless browser
opens the built home page and one method page, finds no console error, and writes a screenshot of each.

Skipped with the reason where mkdocs is not installed (``pip install -e ".[docs]"``, which scripts/install.sh
does) or where no browser is (Playwright's Python package with a system Chromium or its own, or the ``chromium``
command from the system packages). No downloads: a browser is never installed here. The build takes about 10 s.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.docs
PAGES = {"home": "", "method": "methods/chelsea/"}
SYSTEM_CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome", "chrome")) if p), None
)


def _mkdocs_missing() -> str | None:
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed: pip install -e '.[docs]' (scripts/install.sh installs it)"
    return None


def build(site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
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


def test_the_site_builds_strictly_with_the_api_reference(site):
    assert (site / "index.html").is_file()
    for page in ("kvjax", "methods", "engine", "eval", "train_less"):
        html = (site / "api" / page / "index.html").read_text(encoding="utf-8")
        assert html.count('class="doc doc-heading"') >= 5, f"api/{page}: too few rendered docstrings"
    engine = (site / "api" / "engine" / "index.html").read_text(encoding="utf-8")
    assert "decode_step" in engine and "run_loop" in engine
    # a link from docs/ to the code becomes a link to the repository
    chelsea = (site / "methods" / "chelsea" / "index.html").read_text(encoding="utf-8")
    assert "https://github.com/kvjax/kvjax/blob/main/kvjax/methods/chelsea.py" in chelsea


@pytest.fixture(scope="module")
def served(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _playwright_console(url: str, shot: Path) -> list[str]:
    from playwright.sync_api import Error, sync_playwright

    errors: list[str] = []
    with sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=SYSTEM_CHROMIUM, args=["--no-sandbox"])
        except Error as e:
            pytest.skip(f"Playwright has no browser to launch (no system Chromium, none installed for it): {e}")
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url, wait_until="networkidle")
        page.screenshot(path=str(shot))
        browser.close()
    return errors


def _chromium_console(url: str, shot: Path) -> list[str]:
    cmd = [
        SYSTEM_CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr",
        "--v=0", "--window-size=1280,900", f"--screenshot={shot}", "--virtual-time-budget=5000", url,
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shot.is_file(), f"chromium wrote no screenshot:\n{out.stderr[-3000:]}"
    # console messages: '... CONSOLE(12)] "Uncaught TypeError: ...", source: http://... (12)'
    return [
        line
        for line in out.stderr.splitlines()
        if "CONSOLE" in line and re.search(r"Uncaught|Error|Failed to load", line)
    ]


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
    shot = Path(os.environ.get("KVJAX_SITE_SCREENSHOTS", tmp_path)) / f"site_{name}.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    errors = console(served + PAGES[name], shot)
    assert shot.is_file() and shot.stat().st_size > 10_000, f"no screenshot of {name} ({shot})"
    assert not errors, f"console errors on {served + PAGES[name]}:\n" + "\n".join(errors)
