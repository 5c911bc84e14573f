"""Activation capture from the frozen, full-attention model (method note ``docs/notes/less.md`` §3, §8.5 step 2),
streamed to disk in shards.

For every sequence and trained layer we keep the residual stream entering the layer (``x [S, H]``, from which
the layer's post-RoPE q, k, v and its target output ``o_proj(full attention)`` are recomputed exactly during
training — 4x less memory than storing q, k, v, o) and, for each sparse policy (LESS's and Baseline+'s), its
**eviction times** ``[Hkv, S]`` int32: every policy evicts for good, so its parallel mask is ``mask[i, j] =
j <= i < evict[j]`` (:func:`kvjax.methods.less.mask_from_evictions`) — ``S`` integers per head instead of an
``S × S`` mask (``S/32`` times smaller than a bit-packed one; recomputing the masks every step instead would cost
a sequential ``S``-step scan per layer and step). They depend only on the frozen q, k, so they are computed once
(note A7). All layers come from one forward pass per batch (every layer's inputs are the *full-cache* model's,
note A25; a hybrid model's sliding-window layers attend within their window, and only its global layers are
captured and trained, as only they run LESS). With a mesh, each batch's tokens are split over ``data`` (the
parameters as the caller placed them).

On disk (:class:`CaptureStore`): ``manifest.json`` and shards ``x-00000.npy [n, Lsel, S, H]`` (the store dtype),
``evict-00000.npy [n, Lsel, 2, Hkv, S]`` int32, each written to a temporary name and renamed when complete, so a
killed capture resumes at the first missing shard. Host memory while capturing: one shard buffer (``shard_mb``,
at least one sequence) plus one capture batch; while training, one training batch (read back per step).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from kvjax import model as M
from kvjax import sharding as S

FORMAT = "kvjax-less-capture/1"


def stack_layers(params) -> dict:
    """The model's per-layer params stacked on a leading ``[L]`` axis (either layout in)."""
    return M.stack_layers(params)["layers"]


def put_batch(x, mesh, axis: int = 0):
    """``x`` on ``mesh`` with its batch ``axis`` split over ``data`` (replicated when the batch does not divide,
    e.g. a last, smaller batch); a plain device array without a mesh."""
    if mesh is None:
        return jnp.asarray(x)
    split = x.shape[axis] % S.axis_size(mesh, S.DATA) == 0
    return jax.device_put(x, NamedSharding(mesh, P(*(None,) * axis, S.DATA) if split else P()))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _capture_batch(cfg, policies, layers, mask, store_dtype, params, tokens):
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s), (b, s))

    def attend(layer, x, q, k, v, out):
        if layer in layers:
            out = out + ((x.astype(store_dtype), jnp.stack([p.eviction_times(q, k, mask) for p in policies], 1)),)
        return M.causal_attention(q, k, v, sliding_window=cfg.sliding_windows[layer]), out

    _, out = M.run_layers(
        cfg, params, M.embed(params, tokens, cfg), positions, attend, (), layers=range(max(layers) + 1)
    )
    # [B, Lsel, S, H], [B, Lsel, P, Hkv, S]
    return jnp.stack([x for x, _ in out], 1), jnp.stack([e for _, e in out], 1)


def seq_bytes(cfg, n_layers: int, seq_len: int, store_dtype, n_policies: int = 2) -> int:
    """Bytes one captured sequence takes on disk (and in host memory while read back)."""
    return n_layers * seq_len * (cfg.hidden_size * jnp.dtype(store_dtype).itemsize + n_policies * cfg.num_kv_heads * 4)


class CaptureStore:
    """A finished capture folder, read back a batch at a time (``np.load(mmap_mode="r")``, rows copied, the
    mapping dropped: host memory is the batch, whatever the number of sequences)."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.manifest = json.loads((self.folder / "manifest.json").read_text())
        self.n, self.per_shard = self.manifest["n"], self.manifest["per_shard"]

    def shard(self, k: int, kind: str) -> Path:
        return self.folder / f"{kind}-{k:05d}.npy"

    def read(self, idx) -> tuple[np.ndarray, np.ndarray]:
        """Sequences ``idx`` in that order -> ``(x [n, Lsel, S, H], evict [n, Lsel, P, Hkv, S])``."""
        idx = np.asarray(idx)
        out = []
        for kind in ("x", "evict"):
            parts = []
            for i in idx:
                k, row = divmod(int(i), self.per_shard)
                mm = np.load(self.shard(k, kind), mmap_mode="r")
                parts.append(np.array(mm[row]))
                del mm
            out.append(np.stack(parts))
        return out[0], out[1]


def _identity(cfg, tokens, policies, layers, mask, store_dtype, model_name) -> str:
    h = hashlib.sha256(np.ascontiguousarray(tokens, np.int32).tobytes())
    h.update(repr((cfg, policies, tuple(layers), mask, str(store_dtype), model_name)).encode())
    return h.hexdigest()


def capture(
    cfg,
    params,
    tokens: np.ndarray,
    policies: tuple,
    folder,
    layers=None,
    mask: str = "decode",
    batch: int = 4,
    store_dtype="float32",
    shard_mb: float = 1024,
    progress: bool = True,
    mesh=None,
    model_name: str | None = None,
) -> CaptureStore:
    """Run the frozen model over ``tokens [N, S]`` and write the capture to ``folder`` (module docstring).

    policies: :class:`~kvjax.methods.less.Less` configs whose eviction times to record (with ``mask``, see
    ``Less.eviction_times``). layers: layer indices to keep (default all). shard_mb: MiB per shard (host memory
    bound while capturing, besides one batch). A folder holding a capture of the same model, tokens and
    settings is reused (its missing shards written); one of other settings is replaced. mesh: split each batch
    over ``data`` (a batch that does not divide, e.g. the last one, runs replicated).
    """
    if layers is not None and (local := [layer for layer in layers if layer not in cfg.global_layers]):
        raise ValueError(
            f"layers={list(layers)} include sliding-window layers {local}: LESS compresses only the global layers "
            "of a hybrid model (its local layers hold a ring buffer of their window); train global layers only"
        )
    if shard_mb <= 0:
        raise ValueError(f"shard_mb={shard_mb} must be > 0 (MiB per capture shard; --shard-mb)")
    layers = tuple(cfg.global_layers if layers is None else layers)
    store_dtype = jnp.dtype(store_dtype or jnp.float32)
    n, s = tokens.shape
    folder = Path(folder)
    per_seq = seq_bytes(cfg, len(layers), s, store_dtype, len(policies))
    per_shard = max(1, int(shard_mb * 2**20 // per_seq))
    manifest = {
        "format": FORMAT,
        "id": _identity(cfg, tokens, policies, layers, mask, store_dtype, model_name),
        "n": n,
        "seq_len": s,
        "layers": list(layers),
        "store_dtype": str(store_dtype),
        "per_shard": per_shard,
        "shards": -(-n // per_shard),
        "seq_bytes": per_seq,
    }
    mpath = folder / "manifest.json"
    if mpath.is_file() and json.loads(mpath.read_text()) != manifest:
        shutil.rmtree(folder)  # a capture of other data or settings: ours to replace
    folder.mkdir(parents=True, exist_ok=True)
    if not mpath.is_file():
        mpath.write_text(json.dumps(manifest, indent=1))
    store = CaptureStore(folder)
    todo = [k for k in range(manifest["shards"]) if not store.shard(k, "evict").is_file()]
    bar = tqdm(
        total=sum(min(per_shard, n - k * per_shard) for k in todo), desc="capture", disable=not progress, unit="seq"
    )
    for k in todo:
        lo, hi = k * per_shard, min(n, (k + 1) * per_shard)
        xs = np.empty((hi - lo, len(layers), s, cfg.hidden_size), store_dtype)
        ev = np.empty((hi - lo, len(layers), len(policies), cfg.num_kv_heads, s), np.int32)
        for i in range(lo, hi, batch):
            x, e = _capture_batch(
                cfg, tuple(policies), layers, mask, store_dtype, params, put_batch(tokens[i : min(i + batch, hi)], mesh)
            )
            xs[i - lo : i - lo + x.shape[0]] = S.to_host(x)
            ev[i - lo : i - lo + x.shape[0]] = S.to_host(e)
            bar.update(x.shape[0])
        for kind, arr in (("x", xs), ("evict", ev)):  # evict last: its presence marks the shard complete
            tmp = store.shard(k, kind).with_suffix(".tmp")
            with open(tmp, "wb") as f:
                np.save(f, arr)
            os.replace(tmp, store.shard(k, kind))
        del xs, ev
    bar.close()
    return store
