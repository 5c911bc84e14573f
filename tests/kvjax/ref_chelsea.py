"""Independent numpy reference of Chelsea's Chunked Soft Matching (paper §5.2–5.3; docs/notes/chelsea.md).

Written from the paper and the method note with explicit loops and Python sets, sharing no code with
``kvjax.methods.csm``. One head, one round:

- slots ``[0, length)`` occupied; sinks ``[0, n_sink)`` and recent ``[length - n_recent, length)`` untouched;
- middle chunks of ``c`` slots start at ``n_sink``; in a chunk, even offsets are A, odd offsets B;
- each A token's edge: the B token of its chunk with the highest cosine (first one on ties);
- the ``m`` best edges over all chunks (stable: higher score first, then lower A slot);
- every B token absorbs the A tokens whose kept edge points at it: count-weighted mean keys and values,
  counts added; A tokens merged away disappear, everything else keeps its order.
"""

from __future__ import annotations

import numpy as np


def cosine(a, b) -> float:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 or nb == 0:
        return 0.0
    return float(np.dot(a, b) / (na * nb))


def edges(K, length, n_sink, n_recent, chunk):
    """All A-token edges ``[(score, src, dst)]`` in slot order of ``src``."""
    end = length - n_recent
    out = []
    start = n_sink
    while start < end:
        members = list(range(start, min(start + chunk, end)))
        a_set = [s for s in members if (s - start) % 2 == 0]
        b_set = [s for s in members if (s - start) % 2 == 1]
        for a in a_set:
            best, arg = -np.inf, None
            for bb in b_set:
                c = cosine(K[a].astype(np.float64), K[bb].astype(np.float64))
                if c > best:
                    best, arg = c, bb
            if arg is not None:
                out.append((best, a, arg))
        start += chunk
    return out


def csm_round(K, V, N, length, m, n_sink, n_recent, chunk):
    """One round on one head. K, V ``[S, D]``, N ``[S]`` -> (pairs [(src, dst)], K', V', N') with ``length - m``
    rows (float64)."""
    es = edges(K, length, n_sink, n_recent, chunk)
    order = sorted(range(len(es)), key=lambda i: (-es[i][0], es[i][1]))
    kept = [es[i] for i in order[:m]]
    assert len(kept) == m, "fewer valid edges than merges"
    clusters: dict[int, set] = {}
    for _, src, dst in kept:
        clusters.setdefault(dst, set()).add(src)
    removed = {src for _, src, _ in kept}
    K2, V2, N2 = [], [], []
    for s in range(length):
        if s in removed:
            continue
        if s in clusters:
            members = [s] + sorted(clusters[s])
            w = np.array([N[i] for i in members], np.float64)
            K2.append(sum(w[j] * K[i].astype(np.float64) for j, i in enumerate(members)) / w.sum())
            V2.append(sum(w[j] * V[i].astype(np.float64) for j, i in enumerate(members)) / w.sum())
            N2.append(w.sum())
        else:
            K2.append(K[s].astype(np.float64))
            V2.append(V[s].astype(np.float64))
            N2.append(float(N[s]))
    pairs = sorted((src, dst) for _, src, dst in kept)
    return pairs, np.array(K2), np.array(V2), np.array(N2)


def attention_with_counts(q, K, V, N, use_log_counts=True):
    """``softmax(q K^T / sqrt(d) + log N) V`` for one query ``[D]`` (Eq. 2), float64."""
    s = K.astype(np.float64) @ q.astype(np.float64) / np.sqrt(K.shape[-1])
    if use_log_counts:
        s = s + np.log(N)
    p = np.exp(s - s.max())
    return (p / p.sum()) @ V.astype(np.float64)


def partition_objective(A, f) -> float:
    """Eq. (3): ``sum_{x in A, y in B} f(|x - y|)`` on positions ``1..2n`` (B the complement of A)."""
    two_n = len(f) + 1
    B = [y for y in range(1, two_n + 1) if y not in A]
    return float(sum(f[abs(x - y) - 1] for x in A for y in B))
