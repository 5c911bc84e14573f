"""The package a user installs: ``python -m build`` makes an sdist and a wheel (built from the sdist, so the sdist is
complete), and the wheel installed into a fresh virtual environment runs ``kvjax --help`` and a one-method
``kvjax generate`` on a tiny local model, with ``kvjax`` imported from the wheel, not from this checkout.

The virtual environment sees the system's site-packages (``--system-site-packages``) so that jax, torch and the
asset wheels are not downloaded again; the wheel is installed with ``--no-index``, so a dependency the wheel
declares but the environment lacks fails the install instead of downloading. The build runs without isolation
(``--no-isolation``: the installed setuptools, no download). Nothing here reaches the network, but for the last test:

Every ``pip install -e <spec>`` line of the README's "Install" section, and the ``.[test]`` and ``.[docs]`` extras it
names, resolves in a fresh virtual environment (``pip install --dry-run``: the accelerator extras' jax plugins are
resolved from the package index, not installed or run; the rest is already installed here).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tiny_models import save_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("build", reason="the build package is not installed (pip install -e '.[test]')")
pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _run(cmd, cwd, env=None, timeout=600):
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    )
    return out


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT], cwd=ROOT)
    return out


def test_build_makes_an_sdist_and_a_wheel_with_the_package_data(dist):
    wheels, sdists = list(dist.glob("*.whl")), list(dist.glob("*.tar.gz"))
    assert [w.name for w in wheels] == [f"kvjax-{VERSION}-py3-none-any.whl"], wheels
    assert [s.name for s in sdists] == [f"kvjax-{VERSION}.tar.gz"], sdists
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    for package in ("kvjax", "kernels_pallas", "train_less", "eval"):
        assert f"{package}/py.typed" in names, f"{package}/py.typed is not in the wheel"
    # LESS's kernels for the embedded models, read at run time (kvjax.loading.assets.LESS_KERNELS)
    for folder in ("less-smollm2", "less-gemma3-270m"):
        for f in (ROOT / "kvjax" / "data" / folder).iterdir():
            assert f"kvjax/data/{folder}/{f.name}" in names, f"{f} is not in the wheel"


def test_the_wheel_installs_and_generates(dist, tmp_path):
    (wheel,) = dist.glob("*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], cwd=tmp_path)
    py, bin_ = venv / "bin" / "python", venv / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(JAX_PLATFORMS="cpu", PATH=f"{bin_}{os.pathsep}{env.get('PATH', '')}", TOKENIZERS_PARALLELISM="false")
    pip = [sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-index", "--disable-pip-version-check"]
    _run([*pip, wheel], cwd=tmp_path, env=env)  # this pip, into the venv (no ensurepip needed)

    # Run outside the checkout, so that the current directory cannot put this tree's kvjax on sys.path.
    where = _run([py, "-c", "import kvjax; print(kvjax.__file__); print(kvjax.__version__)"], cwd=tmp_path, env=env)
    path, version = where.stdout.split()
    assert Path(path).resolve().is_relative_to(venv.resolve()), f"kvjax imported from {path}, not the wheel"
    assert version == VERSION

    assert "generate" in _run([bin_ / "kvjax", "--help"], cwd=tmp_path, env=env).stdout

    tiny = save_tiny_llama(
        tmp_path / "tiny", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    argv = ["generate", "--model", tiny, "--method", "snapkv", "--budget", "0.5", "--max-new-tokens", "4"]
    out = _run([bin_ / "kvjax", *argv, "--prompt", "Where is the Eiffel Tower? " * 4], cwd=tmp_path, env=env)
    assert "snapkv:" in out.stderr and "error:" not in out.stderr, out.stderr


def _readme_installs() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Install\n.*?```bash\n(.*?)```", readme, re.S).group(1)
    specs = re.findall(r"^pip install -e \"?(\.(?:\[[a-z0-9]+\])?)\"?", block, re.M)
    named = re.findall(r"`(\.\[[a-z0-9]+\])`", readme.split("## Install", 1)[1].split("\n## ", 1)[0])
    assert "." in specs and named, f"README's install section: {specs}, {named}"
    return list(dict.fromkeys(specs + named))


#: what resolving each extra must bring beyond the base install (the accelerator's jax plugin)
EXPECT = {".[cuda]": "jax-cuda12-plugin", ".[cuda13]": "jax-cuda13-plugin", ".[tpu]": "libtpu"}


@pytest.mark.parametrize("spec", _readme_installs() + [".[cuda13]"])
def test_every_install_line_of_the_readme_resolves(spec, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    report = tmp_path / "report.json"
    target = f"{ROOT}{spec[1:]}"
    cmd = [sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--dry-run", "-q"]
    _run([*cmd, "--no-build-isolation", "--report", report, "-e", target], cwd=tmp_path, env=env, timeout=900)
    names = {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}
    assert "kvjax" in names, names
    if spec in EXPECT:
        assert EXPECT[spec] in names, f"{spec} resolved without {EXPECT[spec]}: {sorted(names)}"
