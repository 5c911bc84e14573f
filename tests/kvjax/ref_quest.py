"""Independent NumPy reference for Quest (Tang et al., ICML 2024, §3; kvjax's resolutions: docs/methods/quest.md).

Written from the description in float64 with plain loops over KV heads and pages; nothing here imports kvjax.
One sequence at a time: q ``[Hq, D]`` per step, keys/values per KV head ``[t, D]`` (position = row). Query head
``qh`` belongs to KV head ``qh // G``. Page ``j`` holds positions ``[j P, (j+1) P)``.

Unlike kvjax (which keeps per-page min/max and updates the current page incrementally), this reference
recomputes every page's min/max from the stored keys at every step, so agreement also checks the update.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np


def token_budget(budget, n: int) -> int:
    """``B``: ``ceil(b n)`` (b read as the decimal it is written as, at least 1, at most n) or the count."""
    if isinstance(budget, float):
        f = Fraction(repr(budget)) * n
        return max(min(n, math.ceil(f)), min(1, n))
    return int(budget)


def page_bounds(keys: np.ndarray, page_size: int):
    """Per-page per-channel ``(kmin, kmax)`` of ``keys [t, D]``: ``[ceil(t / P), D]`` each (the last page may be
    partial: over its rows only)."""
    keys = np.asarray(keys, np.float64)
    n_pages = -(-keys.shape[0] // page_size)
    lo = np.stack([keys[j * page_size : (j + 1) * page_size].min(axis=0) for j in range(n_pages)])
    hi = np.stack([keys[j * page_size : (j + 1) * page_size].max(axis=0) for j in range(n_pages)])
    return lo, hi


def upper_bound(qvec: np.ndarray, kmin: np.ndarray, kmax: np.ndarray) -> np.ndarray:
    """Quest's criticality of each page for one query: ``sum_d max(q_d kmin_d, q_d kmax_d)`` -> ``[pages]``."""
    q = np.asarray(qvec, np.float64)
    return np.maximum(q * kmin, q * kmax).sum(axis=-1)


def softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def attend(qvec, keys, values):
    return softmax(keys @ qvec / math.sqrt(qvec.shape[-1])) @ values


def choose_pages(qgroup: np.ndarray, keys: np.ndarray, t: int, page_size: int, budget_tokens: int) -> list[int]:
    """Pages one KV head attends at the step whose new token is at position ``t`` (``keys`` holds rows
    ``[0, t]``, the new one included), sorted. The current page ``t // P`` always; if the ``t + 1`` live tokens
    fit the budget or the live pages fit ``pages_b = max(B // P, 1)``, every page; else the ``pages_b - 1``
    complete pages before it with the largest group-mean upper bound (ties: the lower page)."""
    cur = t // page_size
    pages_b = max(budget_tokens // page_size, 1)
    if t + 1 <= budget_tokens or cur + 1 <= pages_b:
        return list(range(cur + 1))
    lo, hi = page_bounds(keys[: cur * page_size], page_size)  # the complete pages [0, cur)
    score = np.mean([upper_bound(qv, lo, hi) for qv in qgroup], axis=0)
    order = np.argsort(-score, kind="stable")[: pages_b - 1]
    return sorted(int(j) for j in order) + [cur]


def attended_rows(pages: list[int], t: int, page_size: int, budget_tokens: int) -> list[int]:
    """Positions the step whose new token is at ``t`` attends, the new token included: the live rows of
    ``pages``; when ``B < P`` only the most recent ``B`` of them (at least the new token).

    Quest (§3.2) always attends the whole current page, so a budget below one page would attend up to ``P`` tokens;
    kvjax's budget contract (docs/interface.md#the-budget-contract: a method never attends more than its budget
    and shrinks its unit instead) cuts the page: with ``B < P``, ``pages_b = 1`` and ``pages`` is the current page
    alone, whose most recent ``min(B, t mod P + 1)`` tokens are kept.
    """
    rows = [p for p in range(t + 1) if p // page_size in pages]
    if budget_tokens < page_size:
        rows = rows[-max(budget_tokens, 1) :]
    return rows


class Sequence:
    """Quest on one sequence (all KV heads) of one compressed layer: ``step`` per generated token."""

    def __init__(self, k, v, length: int, *, page_size: int, budget):
        self.k = [np.asarray(k[h, :length], np.float64) for h in range(k.shape[0])]
        self.v = [np.asarray(v[h, :length], np.float64) for h in range(v.shape[0])]
        self.page_size = page_size
        self.budget_tokens = token_budget(budget, length)
        self.pages: list[list[list[int]]] = []  # per step, per KV head: the pages attended
        self.attended: list[list[int]] = []  # per step, per KV head: the tokens attended (new one included)

    def positions(self, q) -> list[list[int]]:
        """Per query head: the positions the next step attends (its new token excluded), for ``q [Hq, D]``."""
        hkv = len(self.k)
        g = q.shape[0] // hkv
        t = self.k[0].shape[0]
        out = []
        for qh in range(q.shape[0]):
            h = qh // g
            pages = choose_pages(q[h * g : (h + 1) * g], self.k[h], t, self.page_size, self.budget_tokens)
            rows = attended_rows(pages, t, self.page_size, self.budget_tokens)
            out.append([p for p in rows if p != t])  # the new token (position t) excluded
        return out

    def step(self, q, knew, vnew):
        """q ``[Hq, D]``, knew/vnew ``[Hkv, D]`` -> output ``[Hq, D]``; the new token's position is ``len(keys)``."""
        hkv = len(self.k)
        g = q.shape[0] // hkv
        t = self.k[0].shape[0]
        outs, chosen, counts = [], [], []
        for h in range(hkv):
            self.k[h] = np.concatenate([self.k[h], np.asarray(knew[h], np.float64)[None]], axis=0)
            self.v[h] = np.concatenate([self.v[h], np.asarray(vnew[h], np.float64)[None]], axis=0)
            pages = choose_pages(q[h * g : (h + 1) * g], self.k[h], t, self.page_size, self.budget_tokens)
            chosen.append(pages)
            rows = attended_rows(pages, t, self.page_size, self.budget_tokens)
            counts.append(len(rows))
            for qv in q[h * g : (h + 1) * g]:
                outs.append(attend(np.asarray(qv, np.float64), self.k[h][rows], self.v[h][rows]))
        self.pages.append(chosen)
        self.attended.append(counts)
        return np.stack(outs)
