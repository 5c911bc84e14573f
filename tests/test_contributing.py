"""CONTRIBUTING.md's checklists match the code, so they cannot rot:

- every backticked file path it names exists (``<method>``-style placeholders aside), and every backticked dotted
  name under ``kvjax.`` or ``kernels_pallas.`` imports;
- every kernel in the tree went through the kernel checklist: a reference, its interpret-mode test, an entry in
  ``PLATFORM_IMPLS`` and ``VERIFYING_TESTS`` (whose tests exist in ``tests/accelerator``), an export test and a
  section in docs/kernels.md;
- every supported ``model_type`` went through the family checklist: a name in ``FAMILIES``, a row in
  docs/architecture.md's table, and its transformers class in a test under ``tests/kvjax``.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from kernels_pallas import impl_choice
from kvjax import config

ROOT = Path(__file__).resolve().parent.parent
GUIDE = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
TICKED = re.findall(r"`([^`\s]+)`", GUIDE)
FOLDER_KERNELS = sorted(p.name for p in (ROOT / "kernels_pallas").iterdir() if (p / "__init__.py").is_file())


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_the_paths_it_names_exist():
    paths = [t for t in TICKED if "/" in t and "<" not in t and not t.startswith(("http", "--"))]
    assert paths, "the guide names no files?"
    missing = [p for p in paths if not list(ROOT.glob(p.split("#")[0].split("::")[0]))]  # a glob names one or more
    assert not missing, f"CONTRIBUTING.md names files that do not exist: {missing}"


def test_the_names_it_names_import():
    names = [t for t in TICKED if re.fullmatch(r"(kvjax|kernels_pallas)(\.\w+)+", t)]
    assert len(names) >= 10, names
    missing = [n for n in names if not resolves(n)]
    assert not missing, f"CONTRIBUTING.md names what does not exist: {missing}"


def test_the_name_check_can_fail():
    assert resolves("kvjax.config.SUPPORTED_MODEL_TYPES")
    assert not resolves("kvjax.config.NO_SUCH_TABLE") and not resolves("kvjax.no_such_module.x")


@pytest.mark.parametrize("kernel", FOLDER_KERNELS + ["prefill_attention"])
def test_every_kernel_went_through_the_checklist(kernel):
    assert kernel in impl_choice.PLATFORM_IMPLS, f"{kernel}: no PLATFORM_IMPLS entry"
    for prefix in impl_choice.VERIFYING_TESTS.get(kernel, ()):
        file, name = prefix.split("::")
        text = (ROOT / "tests" / "accelerator" / file).read_text(encoding="utf-8")
        assert f"def {name}" in text, f"{kernel}: VERIFYING_TESTS names {prefix}, which tests/accelerator lacks"
    assert impl_choice.VERIFYING_TESTS.get(kernel), f"{kernel}: no VERIFYING_TESTS entry"
    export = (ROOT / "tests" / "kernels_pallas" / "test_export.py").read_text(encoding="utf-8")
    assert f"def test_{kernel}_" in export, f"{kernel}: no export test in tests/kernels_pallas/test_export.py"
    if kernel in FOLDER_KERNELS:
        assert (ROOT / "kernels_pallas" / kernel / "reference.py").is_file(), f"{kernel}: no reference.py"
        assert (ROOT / "tests" / "kernels_pallas" / f"test_{kernel}.py").is_file(), f"{kernel}: no test file"
        assert f"## `{kernel}`" in (ROOT / "docs" / "kernels.md").read_text(encoding="utf-8"), kernel


@pytest.mark.parametrize("model_type", config.SUPPORTED_MODEL_TYPES)
def test_every_family_went_through_the_checklist(model_type):
    transformers = pytest.importorskip("transformers")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert model_type in config.FAMILIES
    table = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").split("### Model families", 1)[1]
    assert f"`{model_type}`" in table.split("\n\n", 2)[1], f"{model_type}: no row in the model families table"
    cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    assert hasattr(transformers, cls)
    tested = [p.name for p in (ROOT / "tests" / "kvjax").glob("test_*.py") if cls in p.read_text(encoding="utf-8")]
    assert tested, f"{model_type}: no test under tests/kvjax builds a {cls} to compare against"
