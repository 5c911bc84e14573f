"""ClusterKV's index of one layer's keys (Liu et al., DAC'25, §III-B semantic clustering, §IV-B batched clustering,
§IV-C indexing; spec §2.2-2.4, §7.2-7.3; method note ``docs/notes/clusterkv.md`` §2.3-2.4, §6 #3, #9): Lloyd
K-means under cosine distance per KV head, the clusters as CSR runs of slots (sizes and starts), and the
permutation of the prompt's (or a decode window's) K/V rows into cluster order.

Shapes: k, v ``[B, Hkv, L, D]`` rows; positions ``[L]`` or ``[B, L]``; valid ``[B, L]`` bool; mu ``[B, Hkv, C, D]``
float32 centroids; labels ``[B, Hkv, L]`` int32 (``C`` for an invalid row); size, start ``[B, Hkv, C]`` int32 (a
cluster's rows and its first slot). The K-means steps are the ``kernels_pallas.cosine_kmeans`` kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.cosine_kmeans import cosine_assign, lloyd_step
from kvjax import sharding
from kvjax.methods.core import kmeans as km


def cosine_kmeans(x, valid, c0, cvalid, iters: int, impl=None):
    """Lloyd K-means under cosine distance (paper §III-B, note §2.3).

    x ``[N, L, D]`` keys, valid ``[N, L]`` bool, c0 ``[N, C, D]`` initial centroids, cvalid ``[N, C]`` bool ->
    (mu ``[N, C, D]`` float32, labels ``[N, L]`` int32, ``C`` for invalid rows, updates run ``[]`` int32).
    Each iteration assigns with the current centroids (argmax cosine similarity, ties to the lower index) and, if
    some label changed, moves each centroid to the mean of its members' raw keys (empty: unchanged); at most
    ``iters`` updates; then a last assignment (the labels returned)."""

    def cond(carry):
        _, _, it, done = carry
        return (it < iters) & ~done

    def body(carry):
        mu, prev, it, _ = carry
        new, labels = lloyd_step(x, mu, valid, cvalid, impl=impl)  # labels: the assignment against mu
        done = jnp.all(labels == prev)
        return jnp.where(done, mu, new), labels, it + jnp.where(done, 0, 1), done

    start = (c0.astype(jnp.float32), jnp.full(x.shape[:2], -1, jnp.int32), jnp.int32(0), jnp.bool_(False))
    mu, _, it, _ = jax.lax.while_loop(cond, body, start)
    return mu, cosine_assign(x, mu, valid, cvalid, impl=impl), it


def init_rows(seed: int, stream, num_heads: int, positions, valid, num: int):
    """Initial centroid rows ``[B, Hkv, num]`` int32 (note §6 #3: sampled without replacement, independent per KV
    head; ``stream`` is the layer for the prompt, :func:`window_stream` for a decode window). positions, valid
    ``[B, L]``."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed), stream)
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(num_heads))  # one stream per KV head
    return jax.vmap(lambda kk: km.init_rows(kk, valid, num, positions), out_axes=1)(keys)


def window_stream(layer, window):
    """The init stream of decode window ``window`` (0-based) of ``layer``."""
    return layer * 100003 + 7919 * (window + 1)


def cluster(k, positions, valid, ncl, num: int, *, stream, seed: int, iters: int, impl):
    """K-means of rows ``k [B, Hkv, L, D]`` (positions ``[L]`` or ``[B, L]``, valid ``[B, L]``) into ``ncl [B]`` of
    ``num`` clusters -> (mu ``[B, Hkv, num, D]``, labels ``[B, Hkv, L]`` with ``num`` for invalid rows), from the
    rows :func:`init_rows` draws for ``stream``; at most ``iters`` updates."""
    b, h, l, d = k.shape
    init = init_rows(seed, stream, h, positions, valid, num)  # [B, Hkv, num]
    c0 = jnp.take_along_axis(k, init[..., None], axis=2)  # [B, Hkv, num, D]
    cvalid = jnp.broadcast_to((jnp.arange(num)[None, :] < ncl[:, None])[:, None], (b, h, num))
    vmask = jnp.broadcast_to(valid[:, None], (b, h, l))

    def rows(x, vm, c, cv):  # one device's (sequences, KV heads) as rows of the k-means kernel
        bb, hh = x.shape[:2]
        mu, labels, _ = cosine_kmeans(
            x.reshape(bb * hh, l, d),
            vm.reshape(bb * hh, l),
            c.reshape(bb * hh, num, d),
            cv.reshape(bb * hh, num),
            iters,
            impl,
        )
        return mu.reshape(bb, hh, num, d), labels.reshape(bb, hh, l)

    return sharding.per_head(rows, k, vmask, c0, cvalid)


def csr(labels, num: int, base):
    """Sizes ``[B, Hkv, num]`` (a bincount: no ``[L, num]`` one-hot) and starts (``base [B]`` + exclusive prefix
    sums) of labels ``[B, Hkv, L]`` (``num`` = invalid, not counted): each cluster a run of slots (§IV-C)."""
    lead = labels.shape[:-1]
    count = jax.vmap(lambda x: jnp.bincount(x, length=num + 1))(labels.reshape(-1, labels.shape[-1]))
    size = count[:, :num].reshape(*lead, num).astype(jnp.int32)
    start = base[:, None, None] + jnp.cumsum(size, axis=-1) - size
    return size, start.astype(jnp.int32)


def index_bytes(mu, csize, clusters) -> tuple:
    """``(allocated, used [B])`` bytes of the index ``mu [B, Hkv, C, D]``, ``csize`` and ``cstart`` (``csize``'s
    dtype): every cluster slot of the buffers, and the ``clusters [B]`` (numpy int64) a sequence has made."""
    b, h, c, d = mu.shape
    per = h * (d * np.dtype(mu.dtype).itemsize + 2 * np.dtype(csize.dtype).itemsize)
    return b * c * per, clusters * per


def cluster_prompt(k, v, n, sinks, ncl, c0: int, dtypes, *, layer: int, seed: int, iters: int, impl):
    """Cluster the prompt's keys ``[sink_b, n_b)`` per KV head into ``ncl [B]`` of ``c0`` clusters (§III-B) and put
    its rows in slot order: the sinks, the clusters by id (positions ascending in each), then padding.

    k, v ``[B, Hkv, T, D]``; n, sinks ``[B]`` int32; ``dtypes``: the K and V buffers' -> (k, v ``[B, Hkv, T, D]`` in
    slot order, cast to ``dtypes``; pos ``[B, Hkv, T]`` int32 the position each slot holds, -1 past ``n_b``; mu
    ``[B, Hkv, c0, D]``; size, start ``[B, Hkv, c0]``, the starts from ``sinks``)."""
    t = k.shape[2]
    p = jnp.arange(t, dtype=jnp.int32)
    valid = (p[None, :] >= sinks[:, None]) & (p[None, :] < n[:, None])  # [B, T]
    mu, labels = cluster(k, p, valid, ncl, c0, stream=layer, seed=seed, iters=iters, impl=impl)  # positions shared
    size, start = csr(labels, c0, sinks)
    # slot order: sinks (group -1), clusters by id, then padding (group c0); stable keeps positions ascending
    group = jnp.where(p[None, None, :] < sinks[:, None, None], -1, labels)
    order = jnp.argsort(group, axis=-1, stable=True).astype(jnp.int32)  # [B, Hkv, T]
    ks = jnp.take_along_axis(k, order[..., None], axis=2).astype(dtypes[0])
    vs = jnp.take_along_axis(v, order[..., None], axis=2).astype(dtypes[1])
    pos = jnp.where(order < n[:, None, None], order, -1)
    return ks, vs, pos, mu, size, start


def cluster_window(k, v, pos, clustered, windows, *, window: int, clusters: int, layer: int, seed, iters, impl):
    """Cluster the decode window, slots ``[clustered, clustered + window)`` of ``k, v [B, Hkv, S, D]`` (``pos [B,
    Hkv, S]``), into ``clusters`` clusters (§III-B incremental clustering, note §2.4) and permute it into cluster
    order; ``windows []`` int32 counts the windows clustered before (the init stream).

    -> (slots ``[B, Hkv, window]`` int32 the window's slots; k, v ``[B, Hkv, window, D]`` and pos ``[B, Hkv, window]``
    in cluster order, to write there; mu ``[B, Hkv, clusters, D]``; size, start ``[B, Hkv, clusters]``, the starts
    from ``clustered``)."""
    b, h, _, d = k.shape
    m, cp = window, clusters
    slots = clustered[:, None] + jnp.arange(m, dtype=jnp.int32)[None, :]  # [B, m]
    idx = jnp.broadcast_to(slots[:, None, :, None], (b, h, m, 1))
    kw = jnp.take_along_axis(k, idx, axis=2)
    vw = jnp.take_along_axis(v, idx, axis=2)
    pw = jnp.take_along_axis(pos, idx[..., 0], axis=2)
    stream = window_stream(layer, windows)
    opts = dict(seed=seed, iters=iters, impl=impl)
    mu, labels = cluster(kw, slots, jnp.ones((b, m), bool), jnp.full((b,), cp, jnp.int32), cp, stream=stream, **opts)
    size, start = csr(labels, cp, clustered)
    order = jnp.argsort(labels, axis=-1, stable=True).astype(jnp.int32)  # cluster order, positions ascending
    ks = jnp.take_along_axis(kw, order[..., None], axis=2)
    vs = jnp.take_along_axis(vw, order[..., None], axis=2)
    ps = jnp.take_along_axis(pw, order, axis=2)
    si = jnp.broadcast_to(slots[:, None, :], (b, h, m))
    return si, ks, vs, ps, mu, size, start
