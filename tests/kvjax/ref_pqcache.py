"""Independent NumPy reference for PQCache (paper §3.1; method note ``docs/notes/pqcache.md`` §2.2-2.6).

Written from the note's pseudo-code in float64 with plain loops over sequences and KV heads; nothing here
imports kvjax. One sequence at a time: q ``[Hq, D]`` per step, keys/values ``[Hkv, n, D]``. Query head ``qh``
belongs to KV head ``qh // G``. Sub-space ``i`` of a key is dims ``[i*D/m, (i+1)*D/m)``.

Unlike kvjax (which encodes every new key when written), this reference follows the paper literally: a
generated token gets its PQ codes only when it leaves the local window (note §2.5, the authors' ring
buffer), so agreement also checks that encode-at-write equals encode-at-eviction with frozen centroids.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np


def kmeans(x: np.ndarray, init_idx: np.ndarray, iters: int):
    """Lloyd K-means on rows ``x [N, d]`` from centroids ``x[init_idx]``: ``iters`` steps of (assign each row
    to the nearest centroid by squared Euclidean distance, lowest index on ties; move every non-empty
    centroid to its members' mean; keep empty ones), then a final assignment. Returns (C [K, d], labels [N])."""
    x = np.asarray(x, np.float64)
    c = x[np.asarray(init_idx)].copy()
    for _ in range(iters):
        lab = encode(x, c)
        for j in range(c.shape[0]):
            members = x[lab == j]
            if len(members):
                c[j] = members.mean(axis=0)
    return c, encode(x, c)


def encode(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Nearest centroid of each row of ``x [N, d]`` among ``c [K, d]`` (first index on ties)."""
    d2 = ((np.asarray(x, np.float64)[:, None, :] - c[None, :, :]) ** 2).sum(-1)
    return np.argmin(d2, axis=1)


def inertia(x, c, lab) -> float:
    return float(((np.asarray(x, np.float64) - c[lab]) ** 2).sum())


def build_pq(keys: np.ndarray, length: int, sink: int, m: int, init_idx: np.ndarray, iters: int):
    """PQ of one KV head: keys ``[n, D]`` (rows ``[sink, length)`` are fitted, ``init_idx`` are positions).
    Returns centroids ``[m, K, D/m]`` and a dict position -> codes ``(m,)`` for every fitted position."""
    d = keys.shape[-1]
    dm = d // m
    rows = np.arange(sink, length)
    cents, codes = [], {}
    labs = []
    for i in range(m):
        xi = keys[rows, i * dm : (i + 1) * dm]
        local = np.searchsorted(rows, init_idx)  # init rows are positions; map to fitted-row indices
        c, lab = kmeans(xi, local, iters)
        cents.append(c)
        labs.append(lab)
    for j, p in enumerate(rows):
        codes[int(p)] = np.array([labs[i][j] for i in range(m)])
    return np.stack(cents), codes


def pq_score(qvec: np.ndarray, cents: np.ndarray, code: np.ndarray) -> float:
    """``q · k_hat``: sum over sub-spaces of ``q_i · C_i[code_i]``."""
    m, _, dm = cents.shape
    return float(sum(np.dot(qvec[i * dm : (i + 1) * dm], cents[i, code[i]]) for i in range(m)))


def split(length: int, sink: int, budget, local_ratio: float):
    """(W, k) of the authors' code: W = int((L - S) r lr), k = int((L - S) r (1 - lr)), in exact rational
    arithmetic with r and lr read as the decimals they are written as (0.3 is 3/10); an int budget is W + k."""
    n = max(length - sink, 0)
    lr = Fraction(repr(float(local_ratio)))
    if isinstance(budget, float):
        r = Fraction(repr(budget))
        return math.floor(n * r * lr), math.floor(n * r * (1 - lr))
    w = math.floor(budget * lr)
    return w, budget - w


def softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def select(qgroup: np.ndarray, cents, codes: dict, t: int, sink: int, w: int, k: int) -> list[int]:
    """Retrieved positions of one KV head at the step whose new token is at position ``t``.

    Candidates ``[sink, t - w)``; per query head softmax(q·k_hat / sqrt(D)) over the candidates, summed over
    the group (G = 1: the raw scores); the top ``k`` (ties to the lower position)."""
    cand = list(range(sink, max(t - w, sink)))
    if not cand or k == 0:
        return []
    d = qgroup.shape[-1]
    s = np.array([[pq_score(qv, cents, codes[p]) for p in cand] for qv in qgroup]) / math.sqrt(d)
    agg = s[0] if len(qgroup) == 1 else sum(softmax(row) for row in s)
    order = np.argsort(-agg, kind="stable")[:k]
    return sorted(cand[i] for i in order)


def attend(qvec, keys, values):
    p = softmax(keys @ qvec / math.sqrt(qvec.shape[-1]))
    return p @ values


class Sequence:
    """PQCache on one sequence (all KV heads): ``prefill`` then ``step`` per generated token. A prompt with
    ``length - sink <= 2^bits`` attends to every token (``dense_short``)."""

    def __init__(self, k, v, length, *, m, bits, sink, budget, local_ratio, iters, init_idx, dense_short=True):
        self.k = [np.asarray(k[h, :length], np.float64) for h in range(k.shape[0])]
        self.v = [np.asarray(v[h, :length], np.float64) for h in range(v.shape[0])]
        self.length, self.sink, self.m = length, sink, m
        self.w, self.kk = split(length, sink, budget, local_ratio)
        self.dense = dense_short and length - sink <= 2**bits  # the authors' short-prompt fallback (note A11)
        self.pq = [build_pq(self.k[h], length, sink, m, init_idx, iters) for h in range(len(self.k))]
        # Paper §3.1: prompt tokens are all coded at prefill; generated ones only when they leave the window.
        self.selected: list[list[list[int]]] = []
        self.attended: list[list[list[int]]] = []  # per step, per KV head: positions attended, new token excluded

    def step(self, q, knew, vnew):
        """q ``[Hq, D]``, knew/vnew ``[Hkv, D]`` -> output ``[Hq, D]``. Position of the new token: len(keys)."""
        hkv = len(self.k)
        g = q.shape[0] // hkv
        t = self.k[0].shape[0]
        outs, sel, att = [], [], []
        for h in range(hkv):
            cents, codes = self.pq[h]
            dm = self.k[h].shape[1] // self.m
            for p in range(max(self.length, self.sink), t - self.w):  # generated tokens out of the window
                if p not in codes:
                    codes[p] = np.array(
                        [encode(self.k[h][p : p + 1, i * dm : (i + 1) * dm], cents[i])[0] for i in range(self.m)]
                    )
            if self.dense:
                keep = list(range(t))
                sel.append(None)
            else:
                chosen = select(q[h * g : (h + 1) * g], cents, codes, t, self.sink, self.w, self.kk)
                sel.append(chosen)
                window = list(range(max(t - self.w, self.sink), t))
                keep = sorted(set(range(min(self.sink, t))) | set(window) | set(chosen))
            att.append(list(keep))
            keys = np.concatenate([self.k[h][keep], knew[h][None]], axis=0)
            vals = np.concatenate([self.v[h][keep], vnew[h][None]], axis=0)
            for qv in q[h * g : (h + 1) * g]:
                outs.append(attend(np.asarray(qv, np.float64), keys, vals))
            self.k[h] = np.concatenate([self.k[h], np.asarray(knew[h], np.float64)[None]], axis=0)
            self.v[h] = np.concatenate([self.v[h], np.asarray(vnew[h], np.float64)[None]], axis=0)
        self.selected.append(sel)
        self.attended.append(att)
        return np.stack(outs)
