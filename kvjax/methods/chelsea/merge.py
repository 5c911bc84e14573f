"""One Chelsea call at fixed shapes (Hu et al., 2025, §5.1 and Alg. 1; spec §2.4, §2.7): rounds of chunked soft
matching (:func:`kvjax.methods.chelsea.csm.csm_round`, §5.2-5.3) until every active sequence holds at most its budget
``B_b``, run as ``lax.while_loop``s over levels of shrinking size sized from the host plan
(:func:`kvjax.methods.chelsea.schedule.round_plans`).

Shapes: k, v ``[B, Hc, S, D]`` (the compressed heads); n ``[B, Hc, S]`` float32 counts (0 = empty slot); length,
target ``[B]`` int32 (occupied slots at the front, ``B_b``); active ``[B]`` bool (the sequences this call
compresses); sinks and recent window Python ints or ``[B]`` int32 (per-sequence windows,
:func:`kvjax.methods.chelsea.budget.windows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.methods.chelsea.csm import Round, csm_round, merges_for

#: A new level of the round loop starts once the plan's occupancy bound has fallen to this fraction of the
#: current level's size (smaller: fewer compiles, more work per round).
LEVEL_SHRINK = 0.7


def levels(rounds: tuple[Round, ...], size_in: int) -> list[tuple[int, int, int, int]]:
    """Group the host plan's rounds into levels ``(first round, end round, slots, max merges)``: a level's slots
    bound every element's occupancy when it starts (``size_in`` or the previous round's ``out_slots``); a new
    level starts when that bound has fallen to ``LEVEL_SHRINK`` of the current level's slots. The last level
    also covers any rounds past the plan (its loop runs until every element is done)."""
    found, first, size = [], 0, size_in
    for i in range(1, len(rounds)):
        bound = rounds[i - 1].out_slots
        if bound <= LEVEL_SHRINK * size:
            found.append((first, i, size, max(r.max_merges for r in rounds[first:i])))
            first, size = i, bound
    found.append((first, max(len(rounds), first + 1), size, max((r.max_merges for r in rounds[first:]), default=0)))
    return found


def compress(k, v, n, length, target, active, rounds: tuple[Round, ...], *, ns, nr, chunk: int, impl, table, unroll):
    """One Chelsea call (§5.1) for the elements with ``active [B]``: CSM rounds until every active element holds
    at most its budget ``target [B]``; returns ``(k, v, n, length)``, the buffers cut to the last level's slots.

    Default (``unroll=False``): the rounds run as ``lax.while_loop``s over *levels* of shrinking size
    (:func:`levels`): each level is one compiled round body at a static size that bounds every element's
    occupancy there (from the host plan ``rounds``), and runs its rounds until no active element is above its
    budget (round ``i`` uses the quantised ratio ``table[min(i, m)]``,
    :func:`kvjax.methods.chelsea.schedule.ratio_table`); the buffers are then cut to the next level's size. So a
    round costs what the cache holds at that point (a prefill call from ``n`` slots costs about ``2 n``
    slot-rounds instead of ``rounds x n``), with a handful of compiles; the last level runs until every element
    is done (a shorter prompt has a smaller budget and may need more rounds). A decode call is one level at the
    cache size. ``unroll=True`` runs the static worst-case plan at shrinking sizes instead: the same merges (top-k
    is sorted and stable, so the first m of a larger top-k are the top m; surplus rounds merge nothing), one
    compile per round. ``ns``/``nr``: sinks and recent window (ints or ``[B]``); ``chunk``, ``impl``: the CSM
    chunk and the ``chunk_best_match`` kernel.
    """
    if unroll:
        for rnd in rounds:
            m = jnp.where(active, merges_for(length, target, ns, nr, rnd.r_q), 0)
            k, v, n = csm_round(
                k,
                v,
                n,
                length,
                m,
                n_sink=ns,
                n_recent=nr,
                chunk=chunk,
                max_merges=rnd.max_merges,
                out_slots=rnd.out_slots,
                impl=impl,
            )
            length = length - m
        return k, v, n, length
    r_tab = jnp.asarray(table, jnp.int32)
    length = length.astype(jnp.int32)
    size_in = k.shape[2]
    plan = levels(rounds, size_in)
    i = jnp.int32(0)
    for li, (first, end, size, kmax) in enumerate(plan):
        last = li == len(plan) - 1
        if size < k.shape[2]:  # every element holds at most `size` slots here (host plan bound)
            k, v, n = k[:, :, :size], v[:, :, :size], n[:, :, :size]

        def cond(carry, end=end, last=last):
            more = jnp.any(active & (carry[4] > target))
            return more if last else more & (carry[0] < end)

        def body(carry, kmax=kmax):
            i, k, v, n, length = carry
            r_q = r_tab[jnp.minimum(i, len(table) - 1)]
            m = jnp.where(active, merges_for(length, target, ns, nr, r_q), 0)
            k, v, n = csm_round(
                k,
                v,
                n,
                length,
                m,
                n_sink=ns,
                n_recent=nr,
                chunk=chunk,
                max_merges=kmax,
                out_slots=k.shape[2],
                impl=impl,
            )
            return i + 1, k, v, n, (length - m).astype(jnp.int32)

        i, k, v, n, length = jax.lax.while_loop(cond, body, (i, k, v, n, length))
    return k, v, n, length


def after(x, partial):
    """``x`` (an int32 array), unchanged, but computed from the attention ``partial``'s sum ``l``: a data dependency
    that orders the in-place compression after every read of the attention (``l`` is a sum of exponentials, never
    ``< 0``, so ``x + (l < 0)`` is ``x`` for every input, NaN included; XLA cannot prove it, so it keeps the order).
    Without it the attention's reads and the compression's writes are unordered and XLA copies the cache buffers
    on every step (:meth:`kvjax.methods.Chelsea.decode`)."""
    flag = jnp.any(partial[2] < 0).astype(x.dtype)
    return x + flag
