"""Independent NumPy references for the baseline KV-cache methods (full, StreamingLLM, H2O, SnapKV, PyramidKV).

Written from the papers' rules (``docs/notes/chunkkv.md`` section 4 and the method docstrings), in float64
with plain loops over batch elements and KV heads. Nothing here imports kvjax: the tests compare kvjax against
these functions, not against kvjax's own output.

Conventions shared by every function:

- One sequence at a time. ``q`` is ``[Hq, T, D]``, ``k``/``v`` are ``[Hkv, T, D]`` for that sequence (the
  right padding beyond ``length`` is never read). Query head ``qh`` belongs to KV head ``qh // G`` with
  ``G = Hq // Hkv`` (Hugging Face ``repeat_kv`` grouping).
- Kept sets are sorted lists of original token positions, one per KV head.
- Ties in top-k go to the lower position: ``np.argsort(-x, kind="stable")``.
- Budgets: a float ``b`` in (0, 1] is a fraction of each prompt (``ceil(b * length)`` tokens, at least 1),
  an int is a token count. The static slot count of a fixed-shape cache uses the prompt bucket ``T``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np


# ----------------------------------------------------------------------------------------------------------
# Small helpers


def softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def attend(qvec: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Softmax attention of one query ``[D]`` over ``keys, values [n, D]`` (scale ``1/sqrt(D)``), float64."""
    qvec = np.asarray(qvec, np.float64)
    keys = np.asarray(keys, np.float64)
    values = np.asarray(values, np.float64)
    p = softmax(keys @ qvec / math.sqrt(qvec.shape[-1]))
    return p @ values


def attend_sink(qvec: np.ndarray, keys: np.ndarray, values: np.ndarray, sink: float) -> np.ndarray:
    """:func:`attend` with a learned sink logit (gpt-oss): ``softmax([q·k/sqrt(D)..., sink])`` without the sink's
    own (zero) value, float64."""
    qvec, keys, values = (np.asarray(x, np.float64) for x in (qvec, keys, values))
    p = softmax(np.append(keys @ qvec / math.sqrt(qvec.shape[-1]), sink))
    return p[:-1] @ values


def window_keep(num_tokens: int, window: int) -> list[int]:
    """A sliding-window layer after ``num_tokens`` tokens: the positions ``t - s < window`` of the last token ``t``."""
    return list(range(max(0, num_tokens - window), num_tokens))


def group_of(hq: int, hkv: int) -> int:
    assert hq % hkv == 0
    return hq // hkv


def sequence_budget(budget, length: int) -> int:
    """Tokens a sequence of ``length`` may keep: ``ceil(b * length)`` computed on the exact decimal fraction
    (``Fraction("0.3") = 3/10``), clipped to ``[1, length]``, for a fraction; the count for an int."""
    if isinstance(budget, float):
        exact = Fraction(repr(budget)) * length
        return max(1, min(length, -(-exact.numerator // exact.denominator)))
    return int(budget)


def top_positions(scores: np.ndarray, n: int) -> list[int]:
    """The ``n`` positions with the largest ``scores`` (ties to the lower position), sorted by position."""
    n = max(0, min(n, len(scores)))
    order = np.argsort(-np.asarray(scores, np.float64), kind="stable")[:n]
    return sorted(int(i) for i in order)


# ----------------------------------------------------------------------------------------------------------
# Full and StreamingLLM


def full_keep(num_tokens: int) -> list[int]:
    """FullKV keeps every position."""
    return list(range(num_tokens))


def streaming_keep(num_tokens: int, slots: int, sinks: int) -> list[int]:
    """StreamingLLM (Xiao et al. 2024): the first ``sinks`` tokens plus the ``slots - sinks`` most recent ones.

    ``num_tokens`` counts every token seen so far (prompt plus generated; positions are contiguous).
    """
    if num_tokens <= slots:
        return list(range(num_tokens))
    sinks = min(sinks, slots - 1)  # a budget too small for the sinks keeps the most recent tokens first
    recent = slots - sinks
    return list(range(sinks)) + list(range(num_tokens - recent, num_tokens))


# ----------------------------------------------------------------------------------------------------------
# SnapKV / PyramidKV


def window_votes(q: np.ndarray, k: np.ndarray, length: int, window: int) -> np.ndarray:
    """SnapKV observation-window votes ``[Hkv, length]``.

    For each of the last ``window`` real queries ``i`` in ``[length - window, length)``: softmax over keys
    ``j <= i`` of ``q_i . k_j / sqrt(D)``; summed over the window queries; averaged over the group's query heads.
    """
    hq, _, d = q.shape
    hkv = k.shape[0]
    g = group_of(hq, hkv)
    votes = np.zeros((hkv, length), np.float64)
    for h in range(hkv):
        for gi in range(g):
            qh = h * g + gi
            for i in range(max(0, length - window), length):
                logits = np.asarray(k[h, : i + 1], np.float64) @ np.asarray(q[qh, i], np.float64) / math.sqrt(d)
                votes[h, : i + 1] += softmax(logits)
        votes[h] /= g
    return votes


def pool1d(x: np.ndarray, kernel: int, kind: str) -> np.ndarray:
    """Stride-1 'same' pooling like PyTorch ``avg_pool1d``/``max_pool1d`` with ``padding = kernel // 2``.

    Average: zero padding, divided by ``kernel`` (``count_include_pad=True``). Max: padding never wins.
    """
    if kernel == 1:
        return np.asarray(x, np.float64).copy()
    pad = kernel // 2
    n = len(x)
    out = np.zeros(n, np.float64)
    for i in range(n):
        lo, hi = max(0, i - pad), min(n, i + pad + 1)
        seg = np.asarray(x[lo:hi], np.float64)
        out[i] = seg.max() if kind == "max" else seg.sum() / kernel
    return out


def snapkv_prefix_scores(q, k, length: int, window: int, kernel: int, pool: str) -> np.ndarray:
    """Pooled votes ``[Hkv, length - window]`` of the prefix ``[0, length - window)`` (SnapKV Alg. 1: the
    window's own columns are cut off before pooling, so they never leak into the prefix scores)."""
    votes = window_votes(q, k, length, window)
    prefix = length - window
    return np.stack([pool1d(votes[h, :prefix], kernel, pool) for h in range(votes.shape[0])])


def snapkv_keep(q, k, length: int, window: int, budget_tokens: int, kernel: int, pool: str):
    """Kept positions per KV head and the prefix scores used (``None`` when the prompt is kept whole).

    ``budget_tokens`` includes the window. No compression when ``length <= budget_tokens``; otherwise the top
    ``budget_tokens - window`` prefix positions plus the window ``[length - window, length)``.
    """
    hkv = k.shape[0]
    if length <= budget_tokens:
        return [list(range(length)) for _ in range(hkv)], None
    window = min(window, budget_tokens)  # a budget below the window keeps the most recent tokens
    scores = snapkv_prefix_scores(q, k, length, window, kernel, pool)
    prefix = length - window
    keep = [top_positions(scores[h], budget_tokens - window) + list(range(prefix, length)) for h in range(hkv)]
    return keep, scores


def pyramid_schedule(total: int, length: int, layer: int, num_layers: int, window: int, beta: int) -> int:
    """PyramidKV's per-layer budget (window included), the KVCache-Factory integer schedule (spec section 4).

    ``min = (L - w) // beta``, ``max = 2 (L - w) - min``; if ``max >= T - w``: ``max = T - w`` and
    ``min = 2 (L - w) - max``; ``step = (max - min) // (N - 1)``; layer ``l`` keeps ``max - l * step`` prefix
    tokens plus the ``w`` window tokens.
    """
    base = total - window
    lo = base // beta
    hi = 2 * base - lo
    if hi >= length - window:
        hi = length - window
        lo = 2 * base - hi
    step = (hi - lo) // max(num_layers - 1, 1)
    return hi - layer * step + window


def pyramid_layer_budget(total: int, length: int, layer: int, num_layers: int, window: int, beta: int) -> int:
    """Tokens layer ``layer`` keeps in KVCache-Factory's ``PyramidKVCluster.update_kv`` (three branches):
    ``length < total``: every token; ``length < 2 (total - window)``: SnapKV with ``total``; else the pyramid
    schedule. ``window`` is already the kept window ``min(w, total)``."""
    if length < total:
        return length
    if length < 2 * (total - window):
        return total
    return pyramid_schedule(total, length, layer, num_layers, window, beta)


# ----------------------------------------------------------------------------------------------------------
# H2O


def accumulated_attention(q, k, length: int) -> np.ndarray:
    """H2O prefill scores ``[Hkv, length]``: column sums over all real queries of the causal softmax,
    averaged over the group's query heads."""
    hq, _, d = q.shape
    hkv = k.shape[0]
    g = group_of(hq, hkv)
    acc = np.zeros((hkv, length), np.float64)
    for h in range(hkv):
        for gi in range(g):
            qh = h * g + gi
            for i in range(length):
                logits = np.asarray(k[h, : i + 1], np.float64) @ np.asarray(q[qh, i], np.float64) / math.sqrt(d)
                acc[h, : i + 1] += softmax(logits)
        acc[h] /= g
    return acc


class H2OHead:
    """One sequence's KV head under H2O (Zhang et al. 2023): heavy hitters plus a recent window.

    ``held`` maps position -> accumulated score. ``keys``/``values`` map position -> vector.
    """

    def __init__(self, budget_tokens: int, recent: int):
        self.budget = budget_tokens
        self.recent = recent
        self.held: dict[int, float] = {}
        self.keys: dict[int, np.ndarray] = {}
        self.values: dict[int, np.ndarray] = {}

    def prefill(self, scores: np.ndarray, k: np.ndarray, v: np.ndarray, length: int):
        """Keep the last ``recent`` tokens and the top ``budget - recent`` older ones by accumulated score."""
        if length <= self.budget:
            kept = list(range(length))
        else:
            older = length - self.recent
            kept = top_positions(scores[:older], self.budget - self.recent) + list(range(older, length))
        for p in kept:
            self.held[p] = float(scores[p])
            self.keys[p] = np.asarray(k[p], np.float64)
            self.values[p] = np.asarray(v[p], np.float64)

    def decode(self, qs: np.ndarray, knew: np.ndarray, vnew: np.ndarray, pos: int):
        """Add token ``pos``; attend with the group's queries ``qs [G, D]``; accumulate; evict one if over budget.

        Returns (outputs ``[G, D]`` computed over every held token including the new one, the attended set).
        """
        self.held[pos] = 0.0
        self.keys[pos] = np.asarray(knew, np.float64)
        self.values[pos] = np.asarray(vnew, np.float64)
        order = sorted(self.held)
        keys = np.stack([self.keys[p] for p in order])
        values = np.stack([self.values[p] for p in order])
        d = keys.shape[-1]
        outs, probs = [], np.zeros(len(order))
        for qv in np.asarray(qs, np.float64):
            p = softmax(keys @ qv / math.sqrt(d))
            outs.append(p @ values)
            probs += p
        probs /= len(qs)
        for p, w in zip(order, probs):
            self.held[p] += float(w)
        attended = list(order)
        if len(self.held) > self.budget:
            cand = [p for p in order if p <= pos - self.recent]  # outside the recent window (pos - recent, pos]
            if cand:
                victim = min(cand, key=lambda p: (self.held[p], p))
                del self.held[victim], self.keys[victim], self.values[victim]
        return np.stack(outs), attended
