"""The mutation check (``scripts/mutations.py``, docs/testing.md) stays runnable: every mutant's original snippet
occurs exactly once in its file and its test files exist (no JAX work, under a second). ``.ci/run`` runs the
fixed subset itself (``--subset ci``); the full run's report is ``benchmarks/results/mutations.md``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("kvjax_mutations", ROOT / "scripts" / "mutations.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_every_mutant_applies_and_names_existing_tests():
    mut = _script()
    assert len(mut.MUTANTS) >= 30 and set(mut.CI) <= {m.id for m in mut.MUTANTS}
    assert mut.main(["--check"]) == 0
    assert all(not m.equivalent for m in mut.MUTANTS if m.id in mut.CI)  # the subset must be killed
