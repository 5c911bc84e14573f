"""Independent NumPy reference for a decode budget (kvjax.methods.core.bounded): SnapKV and ChunkKV re-compressed every
``every`` decode steps to ``D`` tokens from a ring of their last ``window`` queries. Float64, plain loops, one layer;
nothing here imports kvjax.

Written from the rule as kvpress's ``DecodingPress(SnapKVPress)`` states it (compress every ``compression_interval``
steps to ``target_size`` with the press's own scores over the held keys, the recent queries voting) and the
SnapKV/ChunkKV references beside it: the held tokens in position order are the sequence; the last ``w`` held tokens
are the window (kept), the ring's queries vote over the held keys they may see (position ``<= `` the query's), SnapKV
pools the votes of the rest and keeps the best ``D - w``; ChunkKV sums them over chunks of ``c`` consecutive held
tokens and keeps the best ``(D - w) // c`` chunks whole (the one cut by the window kept up to it).

With a threshold ``tau`` (as kvpress's ``DMSPress`` states it: evict the tokens whose score is below ``tau``, the
window protected), a re-compression's budget is the window plus the tokens before it whose score divided by the
ring's queries (SnapKV: pooled, kvpress's ``SnapKVPress`` score) is at least ``tau``, at most ``D``; the prompt is
re-compressed at prefill and every ``every`` steps a sequence holding more than ``w`` tokens.
"""

from __future__ import annotations

import math

import numpy as np

import ref_baselines as ref
import ref_chunkkv as refc


def ring_votes(held_pos, keys, ring, qvecs, d: int) -> np.ndarray:
    """Votes ``[len(held_pos)]`` of one KV head's held tokens: for each ring query ``(position p, [G, D] vectors)``
    and each query head of the group, the softmax over the held keys with position ``<= p``; summed over the ring,
    mean over the group."""
    held_pos = np.asarray(held_pos)
    g = qvecs[0].shape[0] if qvecs else 1
    out = np.zeros(len(held_pos))
    for p, qv in zip(ring, qvecs):
        see = held_pos <= p
        for gi in range(g):
            x = keys[see] @ qv[gi] / math.sqrt(d)
            e = np.exp(x - x.max())
            out[see] += e / e.sum()
    return out / g


def snapkv_reselect(votes, target: int, window: int, kernel: int, pool: str) -> list[int]:
    """Indices into the held sequence SnapKV keeps of it under ``target`` tokens (every one when it fits)."""
    n = len(votes)
    if n <= target:
        return list(range(n))
    w = min(window, target)
    prefix = n - w
    scores = ref.pool1d(votes[:prefix], kernel, pool)
    return ref.top_positions(scores, target - w) + list(range(prefix, n))


def chunkkv_reselect(votes, target: int, window: int, chunk: int) -> list[int]:
    """Indices ChunkKV (``prefix_exclusive``) keeps: whole chunks of ``chunk`` held tokens, then the window."""
    n = len(votes)
    if n <= target:
        return list(range(n))
    w = min(window, target)
    if target - w < chunk:  # no chunk fits beside the window: the window takes the whole budget
        w = target
    limit = n - w
    scores = refc.chunk_scores(votes, limit, chunk)
    toks = [
        t for i in refc.top_chunks(scores, (target - w) // chunk) for t in range(i * chunk, min((i + 1) * chunk, limit))
    ]
    return toks + list(range(limit, n))


def passing(kind, opts, votes, queries: int, window: int, threshold: float) -> int:
    """How many held tokens before the window score at least ``threshold`` (mean vote over ``queries``)."""
    prefix = max(0, len(votes) - window)
    scores = np.asarray(votes[:prefix], np.float64)
    if kind == "snapkv":
        scores = ref.pool1d(scores, opts["kernel"], opts["pool"])
    return int(np.sum(scores / max(queries, 1) >= threshold))


def simulate(kind, opts, q_pre, k_pre, lengths, q_steps, k_steps, target: int, every: int, threshold=None):
    """Held positions per step of a batch under the decode budget: ``[step][b][h] -> list of positions`` (step 0:
    after prefill). ``kind``: "snapkv" (opts: budget tokens ``P``, window, kernel, pool) or "chunkkv" (opts: ``P``,
    window, chunk). q_pre ``[B, Hq, T, D]``, k_pre ``[B, Hkv, T, D]``, lengths ``[B]``; q_steps ``[S, B, Hq, D]``,
    k_steps ``[S, B, Hkv, D]`` the decode steps' queries and keys (position ``n_b + s``).

    The fill count ``length`` (most slots any head of the sequence holds, gaps included) decides a re-compression
    as it does in kvjax: every ``every`` steps, when some sequence's fill exceeds ``target``; then every sequence is
    re-selected (one that does not need it keeps all it holds) and its fill becomes its most held. ``threshold``:
    the module docstring's rule."""
    b, hq, t, d = q_pre.shape
    hkv = k_pre.shape[1]
    g = hq // hkv
    w = opts["window"]
    head_mode = opts.get("head_mode", "per_kv_head")  # ChunkKV: "shared" ranks by the heads' mean votes
    keys = [[{} for _ in range(hkv)] for _ in range(b)]  # position -> key vector
    held, ring, fill = [], [], []
    for i in range(b):
        n = int(lengths[i])
        for h in range(hkv):
            for p in range(n):
                keys[i][h][p] = np.asarray(k_pre[i, h, p], np.float64)
        if kind == "snapkv":
            kept, _ = ref.snapkv_keep(q_pre[i], k_pre[i], n, w, opts["P"], opts["kernel"], opts["pool"])
        else:
            kept, _, _ = refc.chunkkv_keep(q_pre[i], k_pre[i], n, w, opts["chunk"], opts["P"], head_mode=head_mode)
        held.append([list(x) for x in kept])
        ring.append([(p, np.asarray(q_pre[i, :, p], np.float64)) for p in range(max(0, n - w), n)])
        fill.append(max(len(x) for x in kept))
    history = []

    floor = target if threshold is None else w  # a head holding more than this is re-selected

    def head_votes(i):
        """Each head's votes over its held positions; with shared heads (who hold the same positions) their mean."""
        votes = []
        for h in range(hkv):
            pos = held[i][h]
            kk = np.stack([keys[i][h][p] for p in pos])
            qv = [x[h * g : (h + 1) * g] for _, x in ring[i]]
            votes.append(ring_votes(pos, kk, [p for p, _ in ring[i]], qv, d))
        if head_mode == "shared":
            assert all(held[i][h] == held[i][0] for h in range(hkv)), "shared heads hold the same positions"
            votes = [sum(votes) / hkv for _ in range(hkv)]
        return votes

    def reselect(i, need):
        votes = head_votes(i) if need else None
        for h in range(hkv):
            pos = held[i][h]
            if need and len(pos) > floor:
                v = votes[h]
                budget = target
                if threshold is not None:
                    budget = min(target, w + passing(kind, opts, v, len(ring[i]), w, threshold))
                if kind == "snapkv":
                    keep = snapkv_reselect(v, budget, w, opts["kernel"], opts["pool"])
                else:
                    keep = chunkkv_reselect(v, budget, w, opts["chunk"])
                held[i][h] = [pos[j] for j in keep]
        fill[i] = max(len(x) for x in held[i])

    for i in range(b):  # prefill: a kept prompt above the target is re-compressed at once
        if max(len(x) for x in held[i]) > floor:
            reselect(i, True)
    history.append([[list(x) for x in held[i]] for i in range(b)])
    for s in range(len(q_steps)):
        for i in range(b):
            p = int(lengths[i]) + s
            for h in range(hkv):
                keys[i][h][p] = np.asarray(k_steps[s, i, h], np.float64)
                held[i][h].append(p)
            fill[i] += 1
            ring[i] = (ring[i] + [(p, np.asarray(q_steps[s, i], np.float64))])[-w:]
        need = [((s + 1) % every == 0) and fill[i] > floor for i in range(b)]
        if any(need):
            for i in range(b):
                reselect(i, need[i])
        history.append([[list(x) for x in held[i]] for i in range(b)])
    return history
