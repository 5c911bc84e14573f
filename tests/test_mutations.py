"""The mutation check (``scripts/mutations.py``, docs/testing.md) stays runnable: every mutant's original snippet
occurs exactly once in its file and its test files exist (no JAX work, under a second). ``.ci/run`` runs the
fixed subset itself (``--subset ci``); the full run's report is ``benchmarks/results/mutations.md``."""

from __future__ import annotations

from repo_scripts import load_script


def _script():
    return load_script("scripts/mutations.py", "kvjax_mutations")


def test_every_mutant_applies_and_names_existing_tests():
    mut = _script()
    assert len(mut.MUTANTS) >= 30 and set(mut.CI) <= {m.id for m in mut.MUTANTS}
    assert mut.main(["--check"]) == 0
    assert all(not m.equivalent for m in mut.MUTANTS if m.id in mut.CI)  # the subset must be killed
