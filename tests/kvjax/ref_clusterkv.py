"""Float64 numpy reference of ClusterKV (Liu et al., DAC'25), written from the paper and the method note
(``docs/notes/clusterkv.md``), one sequence and one KV head at a time with plain loops: the oracle
``tests/kvjax/test_clusterkv.py`` compares the JAX method against.

- ``cosine_kmeans`` (paper §III-B): Lloyd iterations under cosine distance; centroids are the mean of the raw
  keys of their members, an empty cluster keeps its centroid, stop when no label changes or after ``iters``
  updates, then a last assignment (note §2.3).
- ``csr`` (paper §IV-C, Fig. 8): sizes, starts and the token order sorted by cluster, positions ascending inside
  a cluster.
- ``select`` (paper §III-C): rank clusters by ``q·mu`` (inner product), take whole clusters until ``bsel``
  tokens, cut the last one keeping its earliest positions (note §2.5).
- ``ClusterKVRef``: one layer of one sequence through prefill and decode (sinks, prompt clusters, a recent
  window clustered into ``c_plus`` clusters every ``window`` steps), giving the attended positions and the
  softmax attention output of every decode step.

Random init rows are an input (the JAX method's seeded draw, exposed for this purpose): the reference checks
everything downstream of the draw.
"""

from __future__ import annotations

import numpy as np


def _assign(x: np.ndarray, mu: np.ndarray) -> np.ndarray:
    """Nearest centroid by cosine similarity, ties to the lowest index. x [L, D], mu [C, D] -> [L] int."""
    xn = x / (np.linalg.norm(x, axis=1, keepdims=True) + 1e-8)
    cn = mu / (np.linalg.norm(mu, axis=1, keepdims=True) + 1e-8)
    return np.argmax(xn @ cn.T, axis=1)


def cosine_kmeans(x: np.ndarray, init: np.ndarray, iters: int):
    """x [L, D] keys, init [C] row indices of the initial centroids -> (mu [C, D], labels [L])."""
    x = x.astype(np.float64)
    mu = x[init].copy()
    prev = None
    for _ in range(iters):
        labels = _assign(x, mu)
        if prev is not None and np.array_equal(labels, prev):
            break
        for c in range(len(mu)):
            members = x[labels == c]
            if len(members):
                mu[c] = members.mean(axis=0)
        prev = labels
    return mu, _assign(x, mu)


def csr(labels: np.ndarray, num_clusters: int):
    """(size [C], start [C] exclusive prefix sums, order [L]: row indices grouped by cluster, ascending inside)."""
    size = np.bincount(labels, minlength=num_clusters)
    start = np.cumsum(size) - size
    order = np.concatenate([np.flatnonzero(labels == c) for c in range(num_clusters)]).astype(int)
    return size, start, order


def select(q: np.ndarray, clusters: list[tuple[np.ndarray, np.ndarray]], bsel: int) -> list[int]:
    """Positions one query selects. q [D]; clusters: (mu [D], member positions ascending) in cluster-id order;
    ranked by ``q·mu`` descending (ties: lower id first), whole clusters until ``bsel``, the last one cut."""
    nonempty = [(i, mu, pos) for i, (mu, pos) in enumerate(clusters) if len(pos)]
    ranked = sorted(nonempty, key=lambda c: (-float(q @ c[1]), c[0]))
    out: list[int] = []
    for _, _, pos in ranked:
        if len(out) >= bsel:
            break
        out.extend(int(p) for p in pos[: bsel - len(out)])
    return out


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """softmax(q k^T / sqrt(D)) v for one query over rows k, v [N, D]."""
    s = k @ q / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max())
    return (p / p.sum()) @ v


class ClusterKVRef:
    """One compressed layer of one sequence, one KV head with its ``g`` query heads.

    k, v: ``[T, D]`` every token's key/value by position (the prompt's ``n`` first, then the decoded ones);
    ``sink``, ``bsel``: sinks and tokens taken from clusters for this sequence; ``gqa``: ``"query"`` (each query
    head selects) or ``"group_mean"`` (the group's mean query selects for all).
    """

    def __init__(self, k, v, n: int, sink: int, bsel: int, window: int, iters: int, gqa: str = "query"):
        self.k, self.v = np.asarray(k, np.float64), np.asarray(v, np.float64)
        self.n, self.sink, self.bsel, self.window, self.iters, self.gqa = n, sink, bsel, window, iters, gqa
        self.clusters: list[tuple[np.ndarray, np.ndarray]] = []
        self.clustered_end = n  # positions [sink, clustered_end) are in clusters

    def add_clusters(self, lo: int, hi: int, init: np.ndarray) -> None:
        """Cluster the keys of positions ``[lo, hi)`` into ``len(init)`` clusters (init: row offsets)."""
        x = self.k[lo:hi]
        mu, labels = cosine_kmeans(x, init, self.iters)
        for c in range(len(init)):
            self.clusters.append((mu[c], lo + np.flatnonzero(labels == c)))

    def attended(self, qs: np.ndarray, t: int) -> list[list[int]]:
        """Positions attended by each query head (qs [G, D]) at the step whose new token is at ``t``."""
        rest = list(range(min(self.sink, t))) + list(range(self.clustered_end, t + 1))
        if self.gqa == "group_mean":
            sel = select(qs.mean(axis=0), self.clusters, self.bsel)
            return [sorted(sel + rest)] * len(qs)
        return [sorted(select(q, self.clusters, self.bsel) + rest) for q in qs]

    def step(self, qs: np.ndarray, t: int):
        """(outputs [G, D], attended positions per head) of the decode step writing position ``t``."""
        att = self.attended(qs, t)
        outs = np.stack([attend(q, self.k[a], self.v[a]) for q, a in zip(qs, att)])
        return outs, att

    def after_step(self, t: int, init_fn) -> None:
        """Cluster the window once it holds ``window`` tokens (after the step writing ``t`` attended them)."""
        if t + 1 - self.clustered_end == self.window:
            self.add_clusters(self.clustered_end, t + 1, init_fn(self.clustered_end, t + 1))
            self.clustered_end = t + 1
