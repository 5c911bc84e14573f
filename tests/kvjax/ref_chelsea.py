"""Independent numpy reference of Chelsea's Chunked Soft Matching (paper §5.2–5.3; docs/notes/chelsea.md).

Written from the paper and the method note with explicit loops and Python sets, sharing no code with
``kvjax.methods.chelsea.csm``. One head, one round:

- slots ``[0, length)`` occupied; sinks ``[0, n_sink)`` and recent ``[length - n_recent, length)`` untouched;
- middle chunks of ``c`` slots start at ``n_sink``; in a chunk, even offsets are A, odd offsets B;
- each A token's edge: the B token of its chunk with the highest cosine (first one on ties);
- the ``m`` best edges over all chunks (stable: higher score first, then lower A slot);
- every B token absorbs the A tokens whose kept edge points at it: count-weighted mean keys and values,
  counts added; A tokens merged away disappear, everything else keeps its order.
"""

from __future__ import annotations

import math
from fractions import Fraction

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


#: The ``llama3`` schedule of App. C.2: ``(r_init, alpha, m)``, ratio of round ``i`` ``max(r_init - alpha min(m, i),
#: r_floor)`` with ``r_floor = 0.05``.
LLAMA3 = (Fraction(35, 100), Fraction(1, 10), 2)


def chelsea_call(K, V, N, budget, n_sink, n_recent, chunk, schedule=LLAMA3, r_floor=Fraction(5, 100)):
    """One Chelsea call (Alg. 1) on one head: CSM rounds until at most ``budget`` rows remain; round ``i`` merges
    ``min(max(floor(r_i M), 1), length - budget)`` pairs, ``M = length - n_sink - n_recent`` the middle."""
    r_init, alpha, m_sched = schedule
    i = 0
    while len(K) > budget:
        r = max(r_init - alpha * min(m_sched, i), r_floor)
        mid = len(K) - n_sink - n_recent
        m = min(max(math.floor(r * mid), 1), len(K) - budget)
        _, K, V, N = csm_round(K, V, N, len(K), m, n_sink, n_recent, chunk)
        i += 1
    return K, V, N


class Sequence:
    """Chelsea on one sequence, per KV head (float64): the prompt merged to ``B = floor(R (n + Gamma))`` rows when
    ``n >= B + g``; each decode step appends the token with count 1, attends every query head of the KV head's
    group over the rows with the ``log N`` bias (Eq. 2), then merges back to ``B`` once ``B + g`` rows are held.
    ``outliers``: KV heads that keep every token (count 1, plain attention)."""

    def __init__(self, K, V, budget, gamma, n_sink, n_recent, chunk, interval, outliers=()):
        n = K.shape[1]  # K, V [Hkv, n, D]
        self.B = math.floor(Fraction(budget).limit_denominator(10000) * (n + gamma))
        self.cfg = (n_sink, n_recent, chunk)
        self.g, self.outliers = interval, set(outliers)
        self.heads = []
        for h in range(K.shape[0]):
            k, v, c = K[h].astype(np.float64), V[h].astype(np.float64), np.ones(n)
            if h not in self.outliers and n >= self.B + self.g:
                k, v, c = chelsea_call(k, v, c, self.B, *self.cfg)
            self.heads.append([k, v, c])

    def step(self, q, k, v):
        """q ``[Hq, D]``, k, v ``[Hkv, D]`` -> attention output ``[Hq, D]``."""
        hkv = len(self.heads)
        g = q.shape[0] // hkv
        out = []
        for h, head in enumerate(self.heads):
            head[0] = np.concatenate([head[0], k[h][None].astype(np.float64)])
            head[1] = np.concatenate([head[1], v[h][None].astype(np.float64)])
            head[2] = np.concatenate([head[2], [1.0]])
            for j in range(g):
                out.append(attention_with_counts(q[h * g + j], *head))
            if h not in self.outliers and len(head[0]) >= self.B + self.g:
                head[:] = chelsea_call(*head, self.B, *self.cfg)
        return np.stack(out)
