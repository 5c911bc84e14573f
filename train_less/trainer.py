"""Per-layer training of the LESS kernels φ, ψ with optax (paper §3.2; method note ``docs/notes/less.md`` §3,
§8.5).

Every layer is trained independently against its own frozen full-attention output: loss = MSE between
``o_proj(LESS parallel attention)`` and ``o_proj(full attention)`` over positions ``>= budget`` (earlier rows
have nothing evicted), the sparse policy applied as a parallel mask. Layers are stacked on a leading axis
and ``vmap``-ed (``layers_per_step`` at a time; all at once by default), each with its own Adam state, so
this is exactly L independent trainings. Adam, lr 1e-3 halved every 10 epochs, dropout 0.3 on the first
pre-activation, per-layer best-validation epoch kept. An orbax checkpoint is written (atomically) after every
epoch and, with ``checkpoint_every``, every that many steps; ``resume=True`` continues from the last readable
one bit-exactly (data order and dropout keys depend only on the seed, epoch and step; the running loss of a
mid-epoch checkpoint is saved with it). An unreadable checkpoint is named in a warning, moved to
``checkpoints-corrupt/`` and the previous one used (:mod:`train_less.checkpoints`).

Scale: the activations and the policies' eviction times are captured to disk in shards
(:mod:`train_less.capture`; host memory bounded by ``shard_mb`` plus one batch, whatever the number of
sequences) and read back a batch per step; the loss attends in query blocks of ``query_chunk`` rows
(:func:`kvjax.methods.less.parallel_attention`), so memory is linear in the sequence length. ``layers`` trains
a subset of layers in ``out/layers-A-B/``, merged after every epoch with the other such runs into ``out``
(:func:`merge_parts`). ``mask="paper"`` trains on the paper's parallel H2O mask instead of kvjax's decode one.

Output folder: ``kernels.npz`` (best params, each ``[L, ...]``; zeros for layers not trained), ``less_config.json``
(format, model identity, kernel/policy/training config, ``layers_trained``, per-layer validation losses of LESS,
of the sparse policy alone and of Baseline+ = the sparse policy with ``R/2`` more tokens, best epochs, history)
and ``checkpoints/``.

Many devices (``mesh``, ``kvjax-train-less --mesh data=N``): data parallelism. Each step's batch (axis 1 of
``x [L, B, S, H]`` and of the eviction times) is split over the mesh's ``data`` axis; the frozen layer parameters,
the kernels and the Adam states are *replicated* on every device, and ``jit``'s SPMD partitioner all-reduces the
gradients (the loss is a mean over the batch), so every device applies the same update: the same training as one
device up to the order of float sums. ``batch`` must be a multiple of the ``data`` size; a ``model`` axis > 1 is
refused (the kernels are small; tensor parallelism would not pay). Activation capture runs with its batch split
over ``data`` too. Several processes (``jax.distributed``, the mesh spanning them): every process runs the same
training on the same tokens; each captures to its own folder (``capture-process<i>``, read back whole), the orbax
checkpoint is saved collectively (written once, restorable by one process), and process 0 alone writes
``kernels.npz`` and ``less_config.json`` (docs/architecture.md#multi-host).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import os
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from tqdm.auto import tqdm

from kernels_pallas.checks import check_int
from kvjax import model as M
from kvjax import sharding as S
from kvjax.methods import less as L
from train_less.capture import capture, put_batch, stack_layers
from train_less.checkpoints import Checkpoints, Record


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Static training configuration (hashable). ``budget``: sparse tokens (int; default ``ceil(0.2 seq_len)``,
    :data:`kvjax.methods.less.DEFAULT_BUDGET` of it, so that ``Less(kernels=...)`` at its default budget uses the
    kernels at the fraction they were trained at); ``recent`` (H2O) and ``sinks`` (Λ) as in
    :class:`kvjax.methods.less.Less`."""

    policy: str = "h2o"
    budget: int | None = None
    recent: float | int = 0.5
    sinks: int = 4
    rank: int = 8
    hidden: int = 512
    dropout: float = 0.3
    scale_init: float = 1e-4
    epochs: int = 40
    batch: int = 2
    seq_len: int = 512
    num_seqs: int = 64
    val_frac: float = 0.1
    lr: float = 1e-3
    halve_every: int = 10
    layers_per_step: int | None = None
    seed: int = 0
    store_dtype: str = "float32"
    mask: str = "decode"
    query_chunk: int | None = 512

    def __post_init__(self):
        for name in ("rank", "hidden", "epochs", "batch", "seq_len", "num_seqs", "halve_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0.0 < self.val_frac < 1.0:
            raise ValueError(f"val_frac={self.val_frac} must be in (0, 1)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        if self.budget is not None and not 1 <= self.budget < self.seq_len:
            raise ValueError(
                f"budget={self.budget} tokens must be in [1, seq_len={self.seq_len}); the sparse "
                "policy must evict something to train on"
            )
        check_int("layers_per_step", self.layers_per_step, "None: all layers", none_ok=True, numpy_ok=True)
        if self.mask not in L.MASKS:
            raise ValueError(
                f"mask={self.mask!r} (--mask): choose 'decode' (kvjax's decode semantics, the "
                "default) or 'paper' (the paper's parallel H2O mask)"
            )
        check_int("query_chunk", self.query_chunk, "--query-chunk; None: no chunking", none_ok=True, numpy_ok=True)
        self.less  # validates policy / recent / sinks

    @property
    def budget_tokens(self) -> int:
        from kvjax.budget import budget_tokens

        return self.budget if self.budget is not None else int(budget_tokens(L.DEFAULT_BUDGET, self.seq_len))

    @property
    def less(self) -> L.Less:
        return L.Less(
            policy=self.policy,
            budget=self.budget_tokens,
            recent=self.recent,
            sinks=self.sinks,
            rank=self.rank,
            hidden=self.hidden,
        )

    @property
    def baseline_plus(self) -> L.Less:
        """The sparse policy with the memory of H added as tokens: ``R·D`` numbers = ``R/2`` KV pairs."""
        return dataclasses.replace(self.less, budget=self.budget_tokens + self.rank // 2)


def _o_proj(lp, attn):
    """``[B, Hq, S, D]`` -> ``[B, S, hidden]`` through the frozen output projection (float32)."""
    b, h, s, d = attn.shape
    o = attn.astype(jnp.float32).transpose(0, 2, 1, 3).reshape(b, s, h * d) @ lp["wo"].astype(jnp.float32)
    return o + lp["bo"].astype(jnp.float32) if "bo" in lp else o


def _module(cfg, tc: TrainConfig) -> L.LessKernels:
    return L.LessKernels(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, tc.rank, tc.hidden, tc.dropout, tc.scale_init)


def _layer_losses(cfg, tc: TrainConfig, lp, kp, x, evicts, key, train: bool):
    """One layer: ``x [B, S, H]`` residual in, the policies' eviction times ``[B, Hkv, S]`` -> LESS loss (and,
    for validation, the sparse-only loss and the Baseline+ loss with ``evicts[1]``). Attention runs in query
    chunks of ``tc.query_chunk`` rows (memory linear in S, forward and gradient)."""
    b, s, _ = x.shape
    positions = jnp.broadcast_to(jnp.arange(s), (b, s))
    # every trained layer is global (cfg.global_layers), so the first global layer's RoPE is each one's
    q, k, v = M.layer_qkv(cfg, lp, x.astype(lp["wq"].dtype), positions, cfg.global_layers[0])
    target = jax.lax.stop_gradient(_o_proj(lp, M.causal_attention(q, k, v)))
    mod = _module(cfg, tc)
    k1, k2 = jax.random.split(key)
    phq = mod.apply({"params": kp}, q, not train, method="phi", rngs={"dropout": k1})
    psk = mod.apply({"params": kp}, k, not train, method="psi", rngs={"dropout": k2})
    start = tc.budget_tokens

    def mse(evict, ps):
        pred = _o_proj(lp, L.parallel_attention(q, k, v, evict, phq, ps, chunk=tc.query_chunk))
        return jnp.mean(jnp.square(pred - target)[:, start:])

    if train:
        return mse(evicts[0], psk)
    zero = jnp.zeros_like(psk)
    return mse(evicts[0], psk), mse(evicts[0], zero), mse(evicts[1], zero)


def _optimizer(tc: TrainConfig, steps_per_epoch: int):
    """Adam (torch defaults), lr ``tc.lr`` halved every ``tc.halve_every`` epochs (StepLR, per epoch)."""
    return optax.adam(optax.exponential_decay(tc.lr, tc.halve_every * steps_per_epoch, 0.5, staircase=True))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _train_step(cfg, tc: TrainConfig, steps_per_epoch: int, lp, kp, opt, x, evict, keys):
    """One Adam step of every layer in the chunk (vmapped; leading ``[Lc]`` axis on every argument)."""
    tx = _optimizer(tc, steps_per_epoch)

    def step(lp, kp, opt, x, evict, key):
        loss, g = jax.value_and_grad(lambda p: _layer_losses(cfg, tc, lp, p, x, (evict,), key, True))(kp)
        upd, opt = tx.update(g, opt, kp)
        return optax.apply_updates(kp, upd), opt, loss

    return jax.vmap(step)(lp, kp, opt, x, evict, keys)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _evaluate(cfg, tc: TrainConfig, lp, kp, x, evict, evict_plus):
    """Validation losses ``(LESS, sparse alone, Baseline+)`` per layer of the chunk, dropout off."""

    def one(lp, kp, x, evict, evict_plus):
        return _layer_losses(cfg, tc, lp, kp, x, (evict, evict_plus), jax.random.PRNGKey(0), False)

    return jax.vmap(one)(lp, kp, x, evict, evict_plus)


def _chunks(n_layers: int, per: int | None):
    per = per or n_layers
    return [slice(i, min(i + per, n_layers)) for i in range(0, n_layers, per)]


def _take(tree, sl):
    return jax.tree.map(lambda a: a[sl], tree)


def _cat(trees):
    return jax.tree.map(lambda *a: jnp.concatenate(a), *trees)


def make_mesh(spec) -> Mesh:
    """The training mesh from ``"data=N"`` (or a dict, or a ``Mesh``, returned as is): unlike
    :func:`kvjax.sharding.make_mesh`, a ``model`` size left out is 1, not the remaining devices."""
    if isinstance(spec, Mesh):
        return spec
    return S.make_mesh({S.MODEL: 1, **(S.parse_mesh(spec) if isinstance(spec, str) else spec)})


def check_mesh(mesh, batch: int) -> None:
    """ValueErrors for a mesh LESS training cannot use: a ``model`` axis > 1 or a ``batch`` (``--batch``) that
    is not a multiple of the ``data`` size (``--mesh``)."""
    dp, tp = S.axis_size(mesh, S.DATA), S.axis_size(mesh, S.MODEL)
    if tp > 1:
        raise ValueError(
            f"--mesh: LESS training splits only the batch, over 'data'; mesh axis 'model' has size {tp}. "
            f"Use --mesh data={dp * tp} (model=1)"
        )
    if batch % dp:
        raise ValueError(
            f"--batch {batch} is not a multiple of the mesh's 'data' size {dp} (--mesh data={dp}): each "
            f"device takes batch / {dp} sequences; use --batch {-(-batch // dp) * dp} or a smaller "
            "'data' size"
        )


def _config_dict(tc: TrainConfig) -> dict:
    d = dataclasses.asdict(tc)
    d["budget"] = tc.budget_tokens
    return d


def _atomic_write(path: Path, write):
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _write_npz(path: Path, arrays: dict):
    def write(tmp):
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)  # the untrained layers' zeros take no room

    _atomic_write(path, write)


PER_LAYER = ("val_loss", "best_epoch", "val_loss_sparse", "val_loss_baseline_plus")


def _write_output(out: Path, tc, cfg, model_name, best, layers, meta_extra):
    """``kernels.npz`` with ``[L, ...]`` arrays (zeros for the layers not trained here) and ``less_config.json``
    (per-layer lists over all L layers, ``None`` where untrained; ``layers_trained``)."""
    arrays = {}
    for k, v in best.items():
        a = np.zeros((cfg.num_layers,) + v.shape[1:], np.asarray(v).dtype)
        a[layers] = np.asarray(v)
        arrays[k] = a
    _write_npz(out / L.KERNELS_FILE, arrays)
    for key in PER_LAYER:
        full = [None] * cfg.num_layers
        for i, l in enumerate(layers):
            full[l] = meta_extra[key][i]
        meta_extra = {**meta_extra, key: full}
    meta = {
        "format": L.FORMAT,
        "model": L.model_identity(cfg, model_name),
        "kernel": {
            "rank": tc.rank,
            "hidden": tc.hidden,
            "dropout": tc.dropout,
            "scale_init": tc.scale_init,
            "psi_form": "code",
            "gelu": "exact",
        },
        "policy": {
            "policy": tc.policy,
            "budget": tc.budget_tokens,
            "recent": tc.recent,
            "sinks": tc.sinks,
            "baseline_plus_budget": tc.budget_tokens + tc.rank // 2,
            "mask": tc.mask,
        },
        "train": _config_dict(tc),
        "layers_trained": list(layers),
        **meta_extra,
    }
    _atomic_write(out / L.CONFIG_FILE, lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
    return meta


def merge_parts(out_dir) -> dict:
    """Merge the ``layers-*/`` runs of ``out_dir`` (``train(layers=...)``, ``kvjax-train-less --layers``) into
    ``out_dir/kernels.npz`` and ``less_config.json``: one kernels folder whose ``layers_trained`` is the union.
    The runs must share model, kernel, policy and training settings and train disjoint layers (ValueError
    naming the folders otherwise). Run after every epoch of a layer run; ``kvjax-train-less --merge`` runs it
    alone (e.g. after copying parts trained on several machines into one folder)."""
    out = Path(out_dir)
    parts = sorted(p for p in out.glob("layers-*") if (p / L.CONFIG_FILE).is_file() and (p / L.KERNELS_FILE).is_file())
    if not parts:
        raise ValueError(
            f"{str(out)!r} has no layers-*/ folders with kernels to merge (kvjax-train-less --layers runs write them)"
        )
    with open(out / ".merge.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        metas = [json.loads((p / L.CONFIG_FILE).read_text()) for p in parts]
        base = metas[0]
        fixed = lambda m: (m["model"], m["kernel"], m["policy"], {k: v for k, v in m["train"].items() if k != "epochs"})
        owner: dict[int, str] = {}
        for p, m in zip(parts, metas):
            if fixed(m) != fixed(base):
                diff = [n for n, a, b in zip(("model", "kernel", "policy", "train"), fixed(m), fixed(base)) if a != b]
                raise ValueError(
                    f"cannot merge {p.name} with {parts[0].name}: they differ in {diff}; every "
                    "--layers run of one folder needs the same model and settings"
                )
            for l in m["layers_trained"]:
                if l in owner:
                    raise ValueError(f"layer {l} is trained by both {owner[l]} and {p.name}; remove one of them")
                owner[l] = p.name
        merged = None
        for p, m in zip(parts, metas):
            with np.load(p / L.KERNELS_FILE) as f:
                if merged is None:
                    merged = {k: np.zeros_like(f[k]) for k in f.files}
                for k in f.files:
                    merged[k][m["layers_trained"]] = f[k][m["layers_trained"]]
        meta = {k: base[k] for k in ("format", "model", "kernel", "policy", "train")}
        meta["layers_trained"] = sorted(owner)
        for key in PER_LAYER:
            meta[key] = [
                next((m[key][l] for m in metas if l in m["layers_trained"]), None) for l in range(len(base[key]))
            ]
        meta["epochs_done"] = min(m["epochs_done"] for m in metas)
        meta["parts"] = {
            p.name: {"layers": m["layers_trained"], "epochs_done": m["epochs_done"]} for p, m in zip(parts, metas)
        }
        _write_npz(out / L.KERNELS_FILE, merged)
        _atomic_write(out / L.CONFIG_FILE, lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
    return meta


def _capture(cfg, params, tokens, tc, run_dir, sel, capture_dir, capture_batch, shard_mb, progress, mesh, model_name):
    """``(store, folder)``: the activation capture :func:`train` reads, in ``capture_dir`` (default
    ``run_dir/capture``), one folder per process when there are several, ``capture_batch`` sequences per forward
    pass rounded up to a multiple of the mesh's ``data`` size."""
    cap_dir = Path(capture_dir) if capture_dir is not None else run_dir / "capture"
    if jax.process_count() > 1:  # every process reads the whole capture back: one folder each, no shared writes
        cap_dir = cap_dir.with_name(f"{cap_dir.name}-process{jax.process_index()}")
    dp = S.axis_size(mesh, S.DATA)
    store = capture(
        cfg,
        params,
        tokens,
        (tc.less, tc.baseline_plus),
        cap_dir,
        layers=sel,
        mask=tc.mask,
        batch=-(-(capture_batch or max(tc.batch, 4)) // dp) * dp,
        store_dtype=tc.store_dtype,
        shard_mb=shard_mb,
        progress=progress,
        mesh=mesh,
        model_name=model_name,
    )
    return store, cap_dir


def _report_epoch(bar, run_dir, out, tc, cfg, model_name, sel, rec, val, epoch: int, split, t0: float) -> None:
    """After epoch ``epoch`` (checkpointed): its validation line on the progress bar, then (process 0) the run's
    kernels file and JSON, and the merge of the per-layer-range runs into ``out``."""
    bar.write(
        f"epoch {epoch + 1}/{tc.epochs}: val loss mean {val[0].mean():.4e} (sparse {val[1].mean():.4e}, "
        f"baseline+ {val[2].mean():.4e}); per layer " + " ".join(f"{v:.2e}" for v in val[0])
    )
    if not S.is_primary():  # several processes: orbax saved collectively; process 0 writes the rest
        return
    summary = {
        "epochs_done": epoch + 1,
        "val_loss": rec.best_val.tolist(),
        "best_epoch": rec.best_epoch.tolist(),
        "val_loss_sparse": val[1].tolist(),
        "val_loss_baseline_plus": val[2].tolist(),
        "num_train_seqs": int(len(split[0])),
        "num_val_seqs": int(len(split[1])),
        "history": rec.history,
        "wall_seconds": time.perf_counter() - t0,
    }
    _write_output(run_dir, tc, cfg, model_name, rec.best, sel, summary)
    if run_dir != out:
        merge_parts(out)


def train(
    cfg,
    params,
    tokens: np.ndarray,
    tc: TrainConfig,
    out_dir,
    model_name: str | None = None,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    mesh=None,
    layers=None,
    shard_mb: float = 1024,
    capture_dir=None,
    keep_capture: bool = False,
    checkpoint_every: int | None = None,
    stop_after_steps: int | None = None,
    capture_batch: int | None = None,
) -> dict:
    """Train the kernels of the frozen model ``(cfg, params)`` on ``tokens [N, S]``.

    Writes ``out_dir`` (see the module docstring) and returns the JSON written there. ``resume``: continue
    from the last readable checkpoint (same config and data; ``epochs`` may grow). ``stop_after``: stop after
    that many epochs in total (as if interrupted; for tests); ``stop_after_steps``: after that many steps.
    ``mesh``: a ``jax.sharding.Mesh`` or a spec such as ``"data=4"`` (:func:`make_mesh`): the batch is split
    over ``data`` (module docstring). ``layers``: train only these layers (``"0-7"``, a list); the run lives in
    ``out_dir/layers-0-7/`` and every epoch merges all such runs into ``out_dir`` (:func:`merge_parts`).
    ``shard_mb``: MiB per capture shard, the host-memory bound of the capture; ``capture_dir``: where the
    capture goes (default ``<run>/capture``; deleted when training ends unless ``keep_capture``).
    ``checkpoint_every``: also checkpoint every that many steps within an epoch. ``capture_batch``: sequences per
    capture forward pass (default ``max(batch, 4)``; with a mesh, rounded up to a multiple of its ``data`` size).
    """
    t0 = time.perf_counter()
    mesh = _check_args(tc, mesh, capture_batch, checkpoint_every)
    if mesh is not None:
        params = jax.device_put(params, S.replicated(mesh))
    sel = list(cfg.global_layers) if layers is None else L.parse_layers(layers, cfg.num_layers)
    out = Path(out_dir).absolute()
    run_dir = out if sorted(sel) == list(cfg.global_layers) else out / f"layers-{L.format_layers(sel)}"
    ckpt = Checkpoints(run_dir, mesh, {**_config_dict(tc), "layers": sel}, L.model_identity(cfg, model_name), resume)
    tokens, train_idx, val_idx = _split(tokens, tc)
    steps_per_epoch = len(train_idx) // tc.batch
    run_dir.mkdir(parents=True, exist_ok=True)
    kparams, opt = _init_kernels(cfg, tc, sel, steps_per_epoch)
    rec = Record.fresh(kparams)
    if resume:
        kparams, opt, rec = ckpt.restore(kparams, opt, rec)
    else:
        ckpt.start()
    end = tc.epochs if stop_after is None else min(tc.epochs, stop_after)
    if rec.epoch >= end:
        ckpt.close()
        return json.loads((run_dir / L.CONFIG_FILE).read_text())
    store, cap_dir = _capture(
        cfg, params, tokens, tc, run_dir, sel, capture_dir, capture_batch, shard_mb, progress, mesh, model_name
    )
    lay = _Layers(cfg, tc, sel, params, kparams, opt, store, mesh, steps_per_epoch)
    if mesh is not None:  # replicated, as the kernels (_Layers)
        rec.best = jax.device_put(rec.best, S.replicated(mesh))
    bar = tqdm(
        total=(end - rec.epoch) * steps_per_epoch - rec.step, desc="train LESS", disable=not progress, unit="step"
    )
    resumed_at, stopped = (rec.epoch, rec.step, rec.run), False
    for epoch in range(rec.epoch, end):
        first, run = (resumed_at[1], resumed_at[2]) if epoch == resumed_at[0] else (0, None)
        run, stopped = _train_epoch(
            lay, ckpt, rec, epoch, first, run, train_idx, bar, checkpoint_every, stop_after_steps
        )
        if stopped:
            break
        val = lay.validate(val_idx)
        _end_epoch(lay, rec, epoch, run / steps_per_epoch, val)
        ckpt.save((epoch + 1) * steps_per_epoch, lay.kernels(), lay.opt(), rec, epoch + 1, 0, None)
        _report_epoch(bar, run_dir, out, tc, cfg, model_name, sel, rec, val, epoch, (train_idx, val_idx), t0)
    bar.close()
    ckpt.close()
    return _finish(run_dir, cap_dir, not stopped and end == tc.epochs and not keep_capture)


def _check_args(tc: TrainConfig, mesh, capture_batch, checkpoint_every):
    """The training mesh (:func:`make_mesh`, checked) or None; ValueErrors for options that cannot work."""
    if mesh is not None:
        mesh = make_mesh(mesh)
        check_mesh(mesh, tc.batch)
    check_int("capture_batch", capture_batch, "--capture-batch; None: max(batch, 4)", none_ok=True, numpy_ok=True)
    check_int("checkpoint_every", checkpoint_every, "--checkpoint-every, in steps", none_ok=True, numpy_ok=True)
    return mesh


def _split(tokens, tc: TrainConfig):
    """``(tokens [N, S] int32, train_idx, val_idx)``: a seeded split, ``val_frac`` (at least one) for validation."""
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 2 or tokens.shape[1] != tc.seq_len:
        raise ValueError(f"tokens has shape {tokens.shape}; expected [N, seq_len={tc.seq_len}]")
    n = tokens.shape[0]
    n_val = max(1, int(round(tc.val_frac * n)))
    if n - n_val < tc.batch:
        raise ValueError(
            f"{n} sequences leave {n - n_val} for training, fewer than batch={tc.batch}; add data "
            "(--num-seqs, --data) or lower --batch"
        )
    perm = np.random.default_rng(tc.seed).permutation(n)
    return tokens, perm[n_val:], np.sort(perm[:n_val])


def _init_kernels(cfg, tc: TrainConfig, sel, steps_per_epoch: int):
    """Fresh kernels of the selected layers (``[L, ...]``, each layer's own key) and their Adam states."""
    keys = jax.random.split(jax.random.PRNGKey(tc.seed), cfg.num_layers)[jnp.asarray(sel)]
    kparams = jax.vmap(lambda k: L.init_kernels(cfg, k, tc.rank, tc.hidden))(keys)
    if tc.scale_init != 1e-4:
        kparams = {
            **kparams,
            "k_s1": jnp.full_like(kparams["k_s1"], tc.scale_init),
            "k_s2": jnp.full_like(kparams["k_s2"], tc.scale_init),
        }
    return kparams, jax.vmap(_optimizer(tc, steps_per_epoch).init)(kparams)


class _Layers:
    """The selected layers' frozen parameters, kernels and Adam states, in chunks of ``layers_per_step`` (one
    vmapped step each), and the batches read back from the capture. With a mesh all of it is replicated and each
    batch split over ``data``: every device applies the same update (module docstring)."""

    def __init__(self, cfg, tc: TrainConfig, sel, params, kparams, opt, store, mesh, steps_per_epoch: int):
        lyr = _take(stack_layers(params), jnp.asarray(sel))
        if mesh is not None:
            kparams, opt, lyr = jax.device_put((kparams, opt, lyr), S.replicated(mesh))
        self.cfg, self.tc, self.store, self.mesh, self.steps_per_epoch = cfg, tc, store, mesh, steps_per_epoch
        self.chunks = _chunks(len(sel), tc.layers_per_step)
        self.kp = [_take(kparams, c) for c in self.chunks]
        self.op = [_take(opt, c) for c in self.chunks]
        self.ly = [_take(lyr, c) for c in self.chunks]
        self.ids, self.key = jnp.asarray(sel), jax.random.PRNGKey(tc.seed + 1)

    def kernels(self):
        return _cat(self.kp)

    def opt(self):
        return _cat(self.op)

    def batch(self, idx):
        """``x [L, B, S, H]``, eviction times ``[L, B, P, Hkv, S]`` of sequences ``idx``, B split over 'data'."""
        x, ev = self.store.read(idx)
        return put_batch(np.swapaxes(x, 0, 1), self.mesh, axis=1), put_batch(np.swapaxes(ev, 0, 1), self.mesh, axis=1)

    def step(self, idx, gstep: int) -> np.ndarray:
        """One optimizer step of every layer on sequences ``idx`` (global step ``gstep``: the dropout keys)."""
        x, ev = self.batch(idx)
        keys = jax.vmap(lambda l: jax.random.fold_in(jax.random.fold_in(self.key, gstep), l))(self.ids)
        losses = []
        for j, c in enumerate(self.chunks):
            self.kp[j], self.op[j], loss = _train_step(
                self.cfg, self.tc, self.steps_per_epoch, self.ly[j], self.kp[j], self.op[j], x[c], ev[c, :, 0], keys[c]
            )
            losses.append(loss)
        return S.to_host(jnp.concatenate(losses))

    def validate(self, val_idx) -> np.ndarray:
        """``[3, L]`` validation losses (LESS, the sparse policy alone, Baseline+), means over ``val_idx``."""
        val = np.zeros((3, len(self.ids)))
        for i in range(0, len(val_idx), self.tc.batch):
            idx = val_idx[i : i + self.tc.batch]
            x, ev = self.batch(idx)
            parts = [
                _evaluate(self.cfg, self.tc, self.ly[j], self.kp[j], x[c], ev[c, :, 0], ev[c, :, 1])
                for j, c in enumerate(self.chunks)
            ]
            val += np.stack([np.concatenate([S.to_host(p[t]) for p in parts]) for t in range(3)]) * len(idx)
        return val / len(val_idx)


def _train_epoch(
    lay: _Layers,
    ckpt: Checkpoints,
    rec: Record,
    epoch: int,
    first: int,
    run,
    train_idx,
    bar,
    checkpoint_every,
    stop_after_steps,
):
    """The steps ``first..`` of ``epoch`` (the order depends only on the seed and the epoch): ``(running loss
    sum [L], stopped)``; ``run``: the sum a mid-epoch checkpoint saved (None: zeros)."""
    tc, spe = lay.tc, lay.steps_per_epoch
    order = np.random.default_rng([tc.seed, epoch]).permutation(train_idx)
    run = np.zeros((len(lay.ids),)) if run is None or not first else run
    for i in range(first, spe):
        gstep = epoch * spe + i
        run += lay.step(np.sort(order[i * tc.batch : (i + 1) * tc.batch]), gstep)
        bar.update(1)
        bar.set_postfix_str("loss/layer " + " ".join(f"{v:.2e}" for v in run / (i + 1)))
        if checkpoint_every and (gstep + 1) % checkpoint_every == 0 and i + 1 < spe:
            ckpt.save(gstep + 1, lay.kernels(), lay.opt(), rec, epoch, i + 1, run.tolist())
        if stop_after_steps is not None and gstep + 1 >= stop_after_steps:
            return run, True
    return run, False


def _end_epoch(lay: _Layers, rec: Record, epoch: int, train_loss, val) -> None:
    """Keep each layer's kernels where its validation loss improved; add the epoch to the history."""
    kparams = lay.kernels()
    better = val[0] < rec.best_val
    rec.best = jax.tree.map(
        lambda b, k: jnp.where(better.reshape((-1,) + (1,) * (k.ndim - 1)), k, b), rec.best, kparams
    )
    rec.best_val = np.where(better, val[0], rec.best_val)
    rec.best_epoch = np.where(better, epoch, rec.best_epoch)
    rec.history.append(
        {
            "epoch": epoch,
            "train_loss": train_loss.tolist(),
            "val_loss": val[0].tolist(),
            "val_loss_sparse": val[1].tolist(),
            "val_loss_baseline_plus": val[2].tolist(),
        }
    )


def _finish(run_dir: Path, cap_dir: Path, drop_capture: bool) -> dict:
    """After the last epoch of this call: wait for process 0's output, drop the capture, return the JSON."""
    if jax.process_count() > 1:  # the others read what process 0 wrote
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("train_less.train: output written")
    if drop_capture:
        shutil.rmtree(cap_dir, ignore_errors=True)
    path = run_dir / L.CONFIG_FILE
    return json.loads(path.read_text()) if path.is_file() else {"epochs_done": 0}
