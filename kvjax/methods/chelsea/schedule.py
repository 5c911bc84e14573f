"""Chelsea's re-compression schedule (Hu et al., 2025, §5.1, Alg. 1 and App. C.2; spec §2.3-2.4, §2.7): the ratio
of each CSM round of a Chelsea call, ``r_i = max(r_init - alpha min(m, i), r_floor)``, and the host-side plans of
the rounds a call runs at prefill and during decode, for every prompt length of a bucket at once.

A plan is a tuple of :class:`kvjax.methods.chelsea.csm.Round` ``(r_q, max_merges, out_slots)``: round ``i``'s quantised
ratio, the largest merge count any prompt length needs in it and the largest occupancy after it; the traced rounds
(:func:`kvjax.methods.chelsea.merge.compress`) take their static sizes from it. Host arrays are numpy int64 over
the prompt lengths ``0..bucket``: ``start`` (occupancy when the call starts), ``target`` (``B_b``,
:func:`kvjax.methods.chelsea.budget.target`), ``sink``/``recent`` (the windows under it).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.methods.chelsea.csm import Round, merges_for, quantise_ratio

#: Ratio schedules ``(r_init, alpha, m)`` of App. C.2 (and D.1 for the needle test: constant 0.25).
PRESETS = {"llama2": (0.45, 0.05, 3), "llama3": (0.35, 0.1, 2), "qwen2": (0.2, 0.1, 2), "niah": (0.25, 0.0, 0)}


def check_schedule(schedule: str | tuple, r_floor: float) -> None:
    """A ValueError naming the option unless ``schedule`` is a ``PRESETS`` name or ``(r_init, alpha, m)`` with
    ``0 < r_init <= 0.5``, ``alpha >= 0`` and an integer ``m >= 0``, and ``0 < r_floor <= 0.5``."""
    if isinstance(schedule, str) and schedule not in PRESETS:
        raise ValueError(
            f"schedule={schedule!r} is not a preset; choose one of {sorted(PRESETS)} or pass (r_init, alpha, m)"
        )
    if not isinstance(schedule, str):
        if not (isinstance(schedule, tuple) and len(schedule) == 3):
            raise ValueError(f"schedule={schedule!r} must be a preset name or a tuple (r_init, alpha, m)")
        r_init, alpha, m = schedule
        if not 0.0 < r_init <= 0.5:
            raise ValueError(
                f"schedule r_init={r_init} must be in (0, 0.5]: one CSM round removes at most half of the middle (§5.1)"
            )
        if alpha < 0 or not isinstance(m, int) or m < 0:
            raise ValueError(f"schedule alpha={alpha}, m={m!r} must be alpha >= 0 and an integer m >= 0")
    if not 0.0 < r_floor <= 0.5:
        raise ValueError(f"r_floor={r_floor} must be in (0, 0.5] (the ratio must stay > 0, App. C.2)")


def ratio(schedule: str | tuple, r_floor: float, i: int) -> float:
    """Ratio of CSM round ``i`` of a call (App. C.2): ``max(r_init - alpha min(m, i), r_floor)``."""
    r_init, alpha, m = PRESETS[schedule] if isinstance(schedule, str) else schedule
    return max(r_init - alpha * min(m, i), r_floor)


def ratio_table(schedule: str | tuple, r_floor: float) -> tuple[int, ...]:
    """Quantised ratios of rounds ``0..m`` (round ``i`` uses entry ``min(i, m)``)."""
    m = (PRESETS[schedule] if isinstance(schedule, str) else schedule)[2]
    return tuple(quantise_ratio(ratio(schedule, r_floor, i)) for i in range(m + 1))


def simulate(start, target, sink, recent, active, table, idle) -> tuple[Round, ...]:
    """Host simulation (``merges_for`` on numpy int64) of one Chelsea call for every prompt length at once:
    ``Round(r_q, largest merge count, largest occupancy after the round)``; inactive elements keep their
    occupancy ``idle`` (so it bounds them too)."""
    s = np.where(active, start, idle).astype(np.int64)
    rounds, i = [], 0
    while np.any(active & (s > target)):
        r_q = table[min(i, len(table) - 1)]
        m = np.where(active, merges_for(s, target, sink, recent, r_q), 0)
        s = s - m
        rounds.append(Round(int(r_q), int(m.max()), int(s.max())))
        i += 1
    return tuple(rounds)


def round_plans(ns, target, sink, recent, table, interval: int, gamma: int, slots: int):
    """``(prefill rounds, decode rounds)``: the worst cases over the prompt lengths ``ns`` (``0..bucket``) with
    budgets ``target``, windows ``sink``/``recent`` and the quantised ratio ``table``. At prefill a prompt with
    ``n >= B_b + g`` compresses from ``n`` slots; during decode a sequence that reaches its trigger ``B_b + g``
    (an over-approximation: some decode step of a ``Gamma``-step run) compresses from ``B_b + g``, and a decode
    round's output keeps the cache's ``slots``."""
    pre_active = ns >= target + interval
    dec_active = target + interval <= ns + gamma - 1  # reaches its trigger during decode (over-approximation)
    pre = simulate(ns, target, sink, recent, pre_active, table, idle=ns)
    dec = simulate(target + interval, target, sink, recent, dec_active, table, idle=0 * ns)
    return pre, tuple(dataclasses.replace(r, out_slots=slots) for r in dec)
