"""benchmarks/chelsea_slot_spread.py's decomposition of Chelsea's attention error, against loops over slots."""

from __future__ import annotations

import math

import numpy as np
import pytest
from repo_scripts import load_script

SLOTS = [[0], [1, 2], [3, 4, 5], [6]]  # prompt tokens per slot; an empty slot is appended as n = 0


@pytest.fixture(scope="module")
def ss():
    return load_script("benchmarks/chelsea_slot_spread.py", "bench_chelsea_slot_spread", beside=True)


def _case(rng, equal_keys=False):
    d, t = 4, 7
    q, k, v = rng.normal(size=(2, 3, d)) * 2, rng.normal(size=(t, d)), rng.normal(size=(t, d))
    if equal_keys:
        for s in SLOTS:
            k[s] = k[s[0]]
    member = np.zeros((len(SLOTS) + 1, t))
    for i, s in enumerate(SLOTS):
        member[i, s] = 1
    n = member.sum(1)
    k_hat = np.array([k[s].mean(0) for s in SLOTS] + [np.zeros(d)])
    return q, k, v, member, k_hat, n


def _reference(q, k, v, slot_keys):
    """Loops over queries and slots: the four outputs' relative errors and the mass-weighted Jensen gap."""
    d = q.shape[-1]
    errs, gaps = {"chelsea": [], "values_averaged": [], "masses_approximated": []}, []
    for qi in q.reshape(-1, d):
        logit = [qi @ k[i] / math.sqrt(d) for i in range(len(k))]
        w = np.exp(logit) / np.sum(np.exp(logit))
        exact = sum(w[i] * v[i] for i in range(len(k)))
        mass = [sum(w[i] for i in s) for s in slot_keys]
        eq2 = [qi @ k[s].mean(0) / math.sqrt(d) + math.log(len(s)) for s in slot_keys]
        m = np.exp(eq2) / np.sum(np.exp(eq2))
        outs = {
            "chelsea": sum(m[j] * v[s].mean(0) for j, s in enumerate(slot_keys)),
            "values_averaged": sum(mass[j] * v[s].mean(0) for j, s in enumerate(slot_keys)),
            "masses_approximated": sum(m[j] * sum(w[i] * v[i] for i in s) / mass[j] for j, s in enumerate(slot_keys)),
        }
        for name, o in outs.items():
            errs[name].append(np.linalg.norm(o - exact) / np.linalg.norm(exact))
        merged = [j for j, s in enumerate(slot_keys) if len(s) > 1]
        total = sum(mass[j] for j in merged)
        gaps.append(
            sum(mass[j] / total * (math.log(sum(math.exp(logit[i]) for i in slot_keys[j])) - eq2[j]) for j in merged)
        )
    return {f"err_{name}": np.mean(e) for name, e in errs.items()}, np.mean(gaps)


def test_decomposition_matches_loops_over_slots(ss):
    q, k, v, member, k_hat, n = _case(np.random.default_rng(0))
    row = ss.decompose(q, k, v, member, k_hat, n)
    errs, gap = _reference(q, k, v, SLOTS)
    for name, value in errs.items():
        assert row[name] == pytest.approx(value, rel=1e-9), name
    assert row["jensen_gap"] == pytest.approx(gap, rel=1e-9) and row["jensen_gap"] > 0
    assert row["key_check"] < 1e-12 and 0 < row["merged_mass"] < 1 and row["tv"] > 0


def test_equal_keys_within_a_slot_make_eq2_exact(ss):
    """Eq. 2 is exact for the masses when a slot's keys are equal: no Jensen gap, no mass error; what is left is
    the averaged values'."""
    row = ss.decompose(*_case(np.random.default_rng(1), equal_keys=True))
    assert row["jensen_gap"] == pytest.approx(0, abs=1e-12) and row["logit_spread"] == pytest.approx(0, abs=1e-6)
    assert row["tv"] == pytest.approx(0, abs=1e-12) and row["err_masses_approximated"] == pytest.approx(0, abs=1e-12)
    assert row["err_chelsea"] == pytest.approx(row["err_values_averaged"], rel=1e-9) and row["err_chelsea"] > 0
