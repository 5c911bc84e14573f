"""Independent NumPy reference for ChunkKV (Liu et al. 2025, Algorithms 1 and 2), float64, plain loops.

Written from the paper and the method note (``docs/notes/chunkkv.md`` §2.2-2.5, §6 A5/A6/A9/A17), not from
kvjax. Nothing here imports kvjax. One sequence at a time: ``q [Hq, T, D]``, ``k [Hkv, T, D]``; query head
``qh`` belongs to KV head ``qh // G``. Ties between chunks go to the lower chunk index
(``np.argsort(-x, kind="stable")``).
"""

from __future__ import annotations

import math

import numpy as np


def observation_votes(q, k, length: int, window: int) -> np.ndarray:
    """``A`` summed over the window queries: ``[Hkv, length]``.

    For each query ``i`` in ``[length - window, length)`` and each query head of the KV group: softmax over keys
    ``j <= i`` of ``q_i . k_j / sqrt(D)``; summed over the window queries, averaged over the group's query heads.
    """
    hq, _, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    out = np.zeros((hkv, length))
    for h in range(hkv):
        for qh in range(h * g, (h + 1) * g):
            for i in range(max(0, length - window), length):
                x = np.asarray(k[h, : i + 1], np.float64) @ np.asarray(q[qh, i], np.float64) / math.sqrt(d)
                e = np.exp(x - x.max())
                out[h, : i + 1] += e / e.sum()
        out[h] /= g
    return out


def chunk_scores(votes_h: np.ndarray, limit: int, chunk: int) -> np.ndarray:
    """``A_i`` = sum of the votes of chunk ``i``'s positions below ``limit`` (``C = ceil(limit / c)`` chunks)."""
    n = -(-limit // chunk)
    return np.array([votes_h[i * chunk : min((i + 1) * chunk, limit)].sum() for i in range(n)])


def top_chunks(scores: np.ndarray, n: int) -> list[int]:
    """The ``n`` best chunks (ties to the lower index), in original (increasing) order."""
    n = max(0, min(n, len(scores)))
    return sorted(int(i) for i in np.argsort(-scores, kind="stable")[:n])


def chunkkv_keep(
    q,
    k,
    length: int,
    window: int,
    chunk: int,
    budget_tokens: int,
    mode: str = "prefix_exclusive",
    votes=None,
    head_mode: str = "per_kv_head",
):
    """Kept positions per KV head **in storage order** (chunk tokens by position, then the window), the chunk
    scores per head and the number of chunks selected; ``(whole prompt, None, 0)`` when ``length <= budget``.

    prefix_exclusive (method note §2.4): chunks over the prefix ``[0, length - window)`` only, the one straddling
    the prefix end is cut there; ``(budget - window) // c`` chunks; then the window.
    paper_literal (Alg. 1 as written): chunks over all ``length`` keys; ``budget // c`` chunks; the first
    ``budget - window`` of their tokens; then the last ``window`` tokens (which may repeat chunk tokens).
    ``votes [Hkv, length]``: token scores from another scorer (default: :func:`observation_votes`).
    ``head_mode="shared"``: every KV head ranks the chunks by the votes summed over all KV heads (kvpress).
    """
    hkv = k.shape[0]
    if length <= budget_tokens:
        return [list(range(length)) for _ in range(hkv)], None, 0
    votes = observation_votes(q, k, length, window) if votes is None else votes
    if head_mode == "shared":
        total = sum(votes[h] for h in range(hkv))
        votes = np.stack([total for _ in range(hkv)])
    if mode == "prefix_exclusive":
        limit, n = length - window, (budget_tokens - window) // chunk
    elif mode == "paper_literal":
        limit, n = length, budget_tokens // chunk
    else:
        raise ValueError(mode)
    keep, scores = [], []
    for h in range(hkv):
        s = chunk_scores(votes[h], limit, chunk)
        toks = [t for i in top_chunks(s, n) for t in range(i * chunk, min((i + 1) * chunk, limit))]
        if mode == "paper_literal":
            toks = toks[: budget_tokens - window]
        keep.append(toks + list(range(length - window, length)))
        scores.append(s)
    return keep, scores, n


def reuse_leader(layer: int, reuse: int) -> int:
    """Algorithm 2: the layer whose indices ``layer`` uses (``floor(layer / N_reuse) * N_reuse``)."""
    return (layer // reuse) * reuse


def jaccard(a, b) -> float:
    a, b = set(a), set(b)
    return 1.0 if not (a | b) else len(a & b) / len(a | b)
