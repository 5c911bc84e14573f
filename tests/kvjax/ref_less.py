"""NumPy (float64) reference for LESS (Dong et al. 2024, §3; method note docs/notes/less.md), written
independently of ``kvjax.methods.less``: the kernel MLPs with an erf GELU, Eq. (3) attention over an explicit
cache plus H, z, Eqs. (4)-(5) as explicit sums over an explicit evicted set, and the parallel form row by row.
The sparse policies' keep/evict decisions come from ``ref_baselines`` (H2O) and a plain list (Λ)."""

from __future__ import annotations

import math

import numpy as np

import ref_baselines as rb

_erf = np.vectorize(math.erf)


def gelu(x):
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def phi(p, q):
    """``q [Hq, D]`` -> ``[Hq, R]``: |gelu(gelu(q W1) W2)| per head."""
    w1, w2 = (np.asarray(p[n], np.float64) for n in ("q_w1", "q_w2"))
    return np.stack([np.abs(gelu(gelu(q[h] @ w1[h]) @ w2[h])) for h in range(q.shape[0])])


def psi(p, k):
    """``k [Hkv, D]`` -> ``[Hkv, R]``: u = |s1| gelu(gelu(k W1) W2); |u + (u W3) s2| per head."""
    w1, w2, w3, s1, s2 = (np.asarray(p[n], np.float64) for n in ("k_w1", "k_w2", "k_w3", "k_s1", "k_s2"))
    out = []
    for h in range(k.shape[0]):
        u = np.abs(s1[h]) * gelu(gelu(k[h] @ w1[h]) @ w2[h])
        out.append(np.abs(u + (u @ w3[h]) * s2[h]))
    return np.stack(out)


def eq3(qv, phq, keys, values, H, z):
    """Eq. (3) for one query: (φ H + Σ exp(q·k/√D) v) / (φ·z + Σ exp(q·k/√D))."""
    d = keys.shape[-1]
    s = keys @ qv / math.sqrt(d)
    c = s.max()
    e = np.exp(s - c)
    return (e @ values + np.exp(-c) * (phq @ H)) / (e.sum() + np.exp(-c) * (phq @ z))


class LambdaHead:
    """Λ-masking / StreamingLLM head: first ``sinks`` positions plus the last ``slots - sinks``."""

    def __init__(self, slots: int, sinks: int):
        self.slots, self.sinks = slots, sinks
        self.keys: dict[int, np.ndarray] = {}
        self.values: dict[int, np.ndarray] = {}

    def add(self, pos, kv, vv):
        """Store ``pos``; return the positions evicted by it (before attending)."""
        self.keys[pos], self.values[pos] = np.asarray(kv, np.float64), np.asarray(vv, np.float64)
        ring = [p for p in self.keys if p >= self.sinks]
        gone = [p for p in ring if p <= pos - (self.slots - self.sinks)]
        return gone


class LessSeq:
    """One sequence under LESS: per KV head, the sparse head, the evicted set, and H, z from it (Eq. 6)."""

    def __init__(self, policy, hq, hkv, budget, recent, sinks, kernels, phi_fn=phi, psi_fn=psi):
        self.policy, self.g, self.hkv = policy, hq // hkv, hkv
        self.kernels, self.phi_fn, self.psi_fn = kernels, phi_fn, psi_fn
        self.heads = [rb.H2OHead(budget, recent) if policy == "h2o" else LambdaHead(budget, sinks) for _ in range(hkv)]
        self.evicted: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(hkv)]
        self.all_kv: list[dict[int, tuple]] = [{} for _ in range(hkv)]

    def state(self):
        """(H [Hkv, R, D], z [Hkv, R]) recomputed from the evicted pairs: H = Σ ψ(k)ᵀ v, z = Σ ψ(k)."""
        hs, zs = [], []
        for h in range(self.hkv):
            if not self.evicted[h]:
                hs.append(None)
                zs.append(None)
                continue
            ks = np.stack([kv[0] for kv in self.evicted[h]])
            vs = np.stack([kv[1] for kv in self.evicted[h]])
            ps = np.stack([self.psi_fn(self.kernels, ks[i : i + 1].repeat(self.hkv, 0))[h] for i in range(len(ks))])
            hs.append(ps.T @ vs)
            zs.append(ps.sum(0))
        return hs, zs

    def prefill(self, q, k, v, length):
        """Full-attention prompt; the policy keeps its set and every other prompt token is evicted."""
        for h in range(self.hkv):
            for p in range(length):
                self.all_kv[h][p] = (np.asarray(k[h, p], np.float64), np.asarray(v[h, p], np.float64))
            if self.policy == "h2o":
                scores = rb.accumulated_attention(q[:, :length], k[:, :length], length)[h]
                self.heads[h].prefill(scores, k[h], v[h], length)
                kept = set(self.heads[h].held)
            else:
                kept = set(rb.streaming_keep(length, self.heads[h].slots, self.heads[h].sinks))
                for p in kept:
                    self.heads[h].keys[p] = np.asarray(k[h, p], np.float64)
                    self.heads[h].values[p] = np.asarray(v[h, p], np.float64)
            self.evicted[h] = [self.all_kv[h][p] for p in range(length) if p not in kept]

    def decode(self, q, k, v, pos):
        """Eq. (3) outputs ``[Hq, D]`` for token ``pos``, then the cache update."""
        out = np.zeros((q.shape[0], q.shape[1]))
        phq = self.phi_fn(self.kernels, np.asarray(q, np.float64))
        for h in range(self.hkv):
            head = self.heads[h]
            self.all_kv[h][pos] = (np.asarray(k[h], np.float64), np.asarray(v[h], np.float64))
            if self.policy == "lambda":
                gone = head.add(pos, k[h], v[h])
                for p in gone:
                    self.evicted[h].append((head.keys.pop(p), head.values.pop(p)))
            else:
                before = set(head.held) | {pos}
            hs, zs = self.state()
            H = hs[h] if hs[h] is not None else 0.0
            z = zs[h] if zs[h] is not None else 0.0
            if self.policy == "lambda":
                order = sorted(head.keys)
                keys = np.stack([head.keys[p] for p in order])
                vals = np.stack([head.values[p] for p in order])
            else:
                order = sorted(before)
                keys = np.stack([head.keys.get(p, k[h]) for p in order])
                vals = np.stack([head.values.get(p, v[h]) for p in order])
            for gi in range(self.g):
                qh = h * self.g + gi
                out[qh] = eq3(
                    np.asarray(q[qh], np.float64),
                    phq[qh],
                    keys,
                    vals,
                    H if np.ndim(H) else np.zeros((phq.shape[1], keys.shape[1])),
                    z if np.ndim(z) else np.zeros(phq.shape[1]),
                )
            if self.policy == "h2o":
                head.decode(q[h * self.g : (h + 1) * self.g], k[h], v[h], pos)
                for p in sorted(before - set(head.held)):
                    self.evicted[h].append(self.all_kv[h][p])
        return out


def h2o_rows(q, k, budget, recent):
    """Rows of kvjax's parallel H2O mask from ``ref_baselines.H2OHead`` fed one token at a time.
    q ``[Hq, S, D]``, k ``[Hkv, S, D]`` -> ``[Hkv, S, S]`` bool."""
    hq, s, _ = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    out = np.zeros((hkv, s, s), bool)
    for h in range(hkv):
        head = rb.H2OHead(budget, recent)
        v = np.zeros_like(k[h])
        for i in range(s):
            _, attended = head.decode(q[h * g : (h + 1) * g, i], k[h, i], v[i], i)
            out[h, i, attended] = True
    return out


def parallel(q, k, v, mask, phq, psk):
    """Parallel LESS row by row: row i attends ``mask[i]`` exactly and the other j <= i through φ_i·ψ_j.
    q ``[Hq, S, D]``, k/v ``[Hkv, S, D]``, mask ``[Hkv, S, S]``, phq ``[Hq, S, R]``, psk ``[Hkv, S, R]``."""
    hq, s, d = q.shape
    g = hq // k.shape[0]
    out = np.zeros((hq, s, d))
    for qh in range(hq):
        h = qh // g
        for i in range(s):
            sp = [j for j in range(i + 1) if mask[h, i, j]]
            ev = [j for j in range(i + 1) if not mask[h, i, j]]
            num = sum(math.exp(q[qh, i] @ k[h, j] / math.sqrt(d)) * v[h, j] for j in sp)
            den = sum(math.exp(q[qh, i] @ k[h, j] / math.sqrt(d)) for j in sp)
            for j in ev:
                w = float(phq[qh, i] @ psk[h, j])
                num = num + w * v[h, j]
                den += w
            out[qh, i] = num / den
    return out
