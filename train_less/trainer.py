"""Per-layer training of the LESS kernels φ, ψ with optax (paper §3.2; method note ``docs/notes/less.md`` §3,
§8.5).

Every layer is trained independently against its own frozen full-attention output: loss = MSE between
``o_proj(LESS parallel attention)`` and ``o_proj(full attention)`` over positions ``>= budget`` (earlier rows
have nothing evicted), the sparse policy applied as a parallel mask. Layers are stacked on a leading axis
and ``vmap``-ed (``layers_per_step`` at a time; all at once by default), each with its own Adam state, so
this is exactly L independent trainings. Adam, lr 1e-3 halved every 10 epochs, dropout 0.3 on the first
pre-activation, per-layer best-validation epoch kept. An orbax checkpoint is written (atomically) after every
epoch; ``resume=True`` continues from the last one bit-exactly (data order and dropout keys depend only on
the seed, epoch and step).

Output folder: ``kernels.npz`` (best params, each ``[L, ...]``), ``less_config.json`` (format, model
identity, kernel/policy/training config, per-layer validation losses of LESS, of the sparse policy alone and
of Baseline+ = the sparse policy with ``R/2`` more tokens, best epochs, history) and ``checkpoints/``.

Many devices (``mesh``, ``kvjax-train-less --mesh data=N``): data parallelism. Each step's batch (axis 1 of
``x [L, B, S, H]`` and of the packed masks) is split over the mesh's ``data`` axis; the frozen layer parameters,
the kernels and the Adam states are *replicated* on every device, and ``jit``'s SPMD partitioner all-reduces the
gradients (the loss is a mean over the batch), so every device applies the same update: the same training as one
device up to the order of float sums. ``batch`` must be a multiple of the ``data`` size; a ``model`` axis > 1 is
refused (the kernels are small; tensor parallelism would not pay). Activation capture runs with its batch split
over ``data`` too.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh
from tqdm.auto import tqdm

from kvjax import model as M
from kvjax import sharding as S
from kvjax.methods import less as L
from train_less.capture import capture, put_batch, stack_layers


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Static training configuration (hashable). ``budget``: sparse tokens (int; default 10% of seq_len,
    rounded down to an even count); ``recent`` (H2O) and ``sinks`` (Λ) as in :class:`kvjax.methods.less.Less`."""

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

    def __post_init__(self):
        for name in ("rank", "hidden", "epochs", "batch", "seq_len", "num_seqs", "halve_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0.0 < self.val_frac < 1.0:
            raise ValueError(f"val_frac={self.val_frac} must be in (0, 1)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        if self.budget is not None and not 1 <= self.budget < self.seq_len:
            raise ValueError(f"budget={self.budget} tokens must be in [1, seq_len={self.seq_len}); the sparse "
                             "policy must evict something to train on")
        if self.layers_per_step is not None and self.layers_per_step < 1:
            raise ValueError(f"layers_per_step={self.layers_per_step} must be >= 1 (or None for all layers)")
        self.less  # validates policy / recent / sinks

    @property
    def budget_tokens(self) -> int:
        return self.budget if self.budget is not None else max(2, int(0.1 * self.seq_len) // 2 * 2)

    @property
    def less(self) -> L.Less:
        return L.Less(policy=self.policy, budget=self.budget_tokens, recent=self.recent, sinks=self.sinks,
                      rank=self.rank, hidden=self.hidden)

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
    return L.LessKernels(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, tc.rank, tc.hidden, tc.dropout,
                         tc.scale_init)


def _layer_losses(cfg, tc: TrainConfig, lp, kp, x, masks, key, train: bool):
    """One layer: ``x [B, S, H]`` residual in, masks ``[B, Hkv, S, S]`` -> LESS loss (and, for validation,
    the sparse-only loss and the Baseline+ loss with ``masks[1]``)."""
    b, s, _ = x.shape
    positions = jnp.broadcast_to(jnp.arange(s), (b, s))
    q, k, v = M.layer_qkv(cfg, lp, x.astype(lp["wq"].dtype), positions)
    target = _o_proj(lp, M.causal_attention(q, k, v))
    mod = _module(cfg, tc)
    k1, k2 = jax.random.split(key)
    phq = mod.apply({"params": kp}, q, not train, method="phi", rngs={"dropout": k1})
    psk = mod.apply({"params": kp}, k, not train, method="psi", rngs={"dropout": k2})
    start = tc.budget_tokens

    def mse(mask, ps):
        pred = _o_proj(lp, L.parallel_attention(q, k, v, mask, phq, ps))
        return jnp.mean(jnp.square(pred - target)[:, start:])

    if train:
        return mse(masks[0], psk)
    zero = jnp.zeros_like(psk)
    return mse(masks[0], psk), mse(masks[0], zero), mse(masks[1], zero)


def _unpack(packed, s):
    return jnp.unpackbits(packed, axis=-1, count=s).astype(bool)


def _optimizer(tc: TrainConfig, steps_per_epoch: int):
    """Adam (torch defaults), lr ``tc.lr`` halved every ``tc.halve_every`` epochs (StepLR, per epoch)."""
    return optax.adam(optax.exponential_decay(tc.lr, tc.halve_every * steps_per_epoch, 0.5, staircase=True))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _train_step(cfg, tc: TrainConfig, steps_per_epoch: int, lp, kp, opt, x, packed, keys):
    """One Adam step of every layer in the chunk (vmapped; leading ``[Lc]`` axis on every argument)."""
    tx = _optimizer(tc, steps_per_epoch)

    def step(lp, kp, opt, x, packed, key):
        mask = _unpack(packed, x.shape[1])
        loss, g = jax.value_and_grad(lambda p: _layer_losses(cfg, tc, lp, p, x, (mask,), key, True))(kp)
        upd, opt = tx.update(g, opt, kp)
        return optax.apply_updates(kp, upd), opt, loss

    return jax.vmap(step)(lp, kp, opt, x, packed, keys)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _evaluate(cfg, tc: TrainConfig, lp, kp, x, packed, packed_plus):
    """Validation losses ``(LESS, sparse alone, Baseline+)`` per layer of the chunk, dropout off."""
    def one(lp, kp, x, packed, packed_plus):
        s = x.shape[1]
        return _layer_losses(cfg, tc, lp, kp, x, (_unpack(packed, s), _unpack(packed_plus, s)),
                             jax.random.PRNGKey(0), False)

    return jax.vmap(one)(lp, kp, x, packed, packed_plus)


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
        raise ValueError(f"--mesh: LESS training splits only the batch, over 'data'; mesh axis 'model' has size {tp}. "
                         f"Use --mesh data={dp * tp} (model=1)")
    if batch % dp:
        raise ValueError(f"--batch {batch} is not a multiple of the mesh's 'data' size {dp} (--mesh data={dp}): each "
                         f"device takes batch / {dp} sequences; use --batch {-(-batch // dp) * dp} or a smaller "
                         "'data' size")


def _config_dict(tc: TrainConfig) -> dict:
    d = dataclasses.asdict(tc)
    d["budget"] = tc.budget_tokens
    return d


def _atomic_write(path: Path, write):
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _write_output(out: Path, tc, cfg, model_name, best, meta_extra):
    arrays = {k: np.asarray(v) for k, v in best.items()}

    def write_npz(tmp):
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)

    _atomic_write(out / L.KERNELS_FILE, write_npz)
    meta = {"format": L.FORMAT, "model": L.model_identity(cfg, model_name),
            "kernel": {"rank": tc.rank, "hidden": tc.hidden, "dropout": tc.dropout, "scale_init": tc.scale_init,
                       "psi_form": "code", "gelu": "exact"},
            "policy": {"policy": tc.policy, "budget": tc.budget_tokens, "recent": tc.recent, "sinks": tc.sinks,
                       "baseline_plus_budget": tc.budget_tokens + tc.rank // 2},
            "train": _config_dict(tc), **meta_extra}
    _atomic_write(out / L.CONFIG_FILE, lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
    return meta


def train(cfg, params, tokens: np.ndarray, tc: TrainConfig, out_dir, model_name: str | None = None,
          resume: bool = False, progress: bool = True, stop_after: int | None = None, mesh=None) -> dict:
    """Train the kernels of every layer of the frozen model ``(cfg, params)`` on ``tokens [N, S]``.

    Writes ``out_dir`` (see the module docstring) and returns the JSON written there. ``resume``: continue
    from the last checkpoint in ``out_dir`` (same config and data; ``epochs`` may grow). ``stop_after``:
    stop after that many epochs in total (as if interrupted; for tests). ``mesh``: a ``jax.sharding.Mesh`` or
    a spec such as ``"data=4"`` (:func:`make_mesh`): the batch is split over ``data`` (module docstring).
    """
    t0 = time.perf_counter()
    if mesh is not None:
        mesh = make_mesh(mesh)
        check_mesh(mesh, tc.batch)
        params = jax.device_put(params, S.replicated(mesh))
    out = Path(out_dir).absolute()
    ckpt_dir = out / "checkpoints"
    if ckpt_dir.exists() and any(ckpt_dir.iterdir()) and not resume:
        raise ValueError(f"out_dir={str(out_dir)!r} already holds checkpoints; pass resume=True (--resume) to "
                         "continue that run, or choose a new folder")
    if resume and not (ckpt_dir.exists() and any(ckpt_dir.iterdir())):
        raise ValueError(f"resume=True but out_dir={str(out_dir)!r} has no checkpoint to resume from")
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 2 or tokens.shape[1] != tc.seq_len:
        raise ValueError(f"tokens has shape {tokens.shape}; expected [N, seq_len={tc.seq_len}]")
    n = tokens.shape[0]
    n_val = max(1, int(round(tc.val_frac * n)))
    if n - n_val < tc.batch:
        raise ValueError(f"{n} sequences leave {n - n_val} for training, fewer than batch={tc.batch}; add data "
                         "(--num-seqs, --data) or lower --batch")
    perm = np.random.default_rng(tc.seed).permutation(n)
    val_idx, train_idx = np.sort(perm[:n_val]), perm[n_val:]
    steps_per_epoch = len(train_idx) // tc.batch
    out.mkdir(parents=True, exist_ok=True)

    mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
    if resume:  # check the run's config before any work
        last = mngr.latest_step()
        meta = mngr.restore(last, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        saved = {k: v for k, v in meta["config"].items() if k != "epochs"}
        now = {k: v for k, v in _config_dict(tc).items() if k != "epochs"}
        if saved != now or meta["model"] != L.model_identity(cfg, model_name):
            diff = sorted(k for k in now if saved.get(k) != now[k])
            raise ValueError(f"resume: the checkpoint in {str(out_dir)!r} was written with a different config "
                             f"(differs in {diff or 'the model'}); resume with the same settings or use a new folder")
    dp = S.axis_size(mesh, S.DATA)
    xs, (masks, masks_plus) = capture(cfg, params, tokens, (tc.less, tc.baseline_plus),
                                      batch=-(-max(tc.batch, 4) // dp) * dp, store_dtype=jnp.dtype(tc.store_dtype),
                                      progress=progress, mesh=mesh)
    layers = stack_layers(params)
    nl = cfg.num_layers
    tx = _optimizer(tc, steps_per_epoch)

    keys = jax.random.split(jax.random.PRNGKey(tc.seed), nl)
    kparams = jax.vmap(lambda k: L.init_kernels(cfg, k, tc.rank, tc.hidden))(keys)
    if tc.scale_init != 1e-4:
        kparams = {**kparams, "k_s1": jnp.full_like(kparams["k_s1"], tc.scale_init),
                   "k_s2": jnp.full_like(kparams["k_s2"], tc.scale_init)}
    opt = jax.vmap(tx.init)(kparams)
    best = kparams
    best_val = np.full((nl,), np.inf)
    best_epoch = np.full((nl,), -1)
    history: list[dict] = []
    start_epoch = 0

    opt_leaves, opt_def = jax.tree.flatten(opt)

    def ckpt_tree(kp, op, bp, bv, be):
        return {"params": kp, "best": bp, "opt": {f"{i:04d}": x for i, x in enumerate(jax.tree.leaves(op))},
                "best_val": jnp.asarray(bv), "best_epoch": jnp.asarray(be)}

    if resume:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                ckpt_tree(kparams, opt, best, best_val, best_epoch))
        st = mngr.restore(last, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        kparams, best = st["params"], st["best"]
        opt = jax.tree.unflatten(opt_def, [st["opt"][f"{i:04d}"] for i in range(len(opt_leaves))])
        best_val, best_epoch = np.asarray(st["best_val"]), np.asarray(st["best_epoch"])
        history, start_epoch = meta["history"], meta["epoch"]

    if mesh is not None:  # replicated: every device holds the kernels and Adam states and applies the same update
        kparams, opt, best, layers = jax.device_put((kparams, opt, best, layers), S.replicated(mesh))
    chunks = _chunks(nl, tc.layers_per_step)
    kp_c = [_take(kparams, c) for c in chunks]
    op_c = [_take(opt, c) for c in chunks]
    ly_c = [_take(layers, c) for c in chunks]
    base_key = jax.random.PRNGKey(tc.seed + 1)
    layer_ids = jnp.arange(nl)
    end = tc.epochs if stop_after is None else min(tc.epochs, stop_after)
    bar = tqdm(total=(end - start_epoch) * steps_per_epoch, desc="train LESS", disable=not progress, unit="step")
    for epoch in range(start_epoch, end):
        order = np.random.default_rng([tc.seed, epoch]).permutation(train_idx)
        run = np.zeros((nl,))
        for i in range(steps_per_epoch):
            idx = np.sort(order[i * tc.batch:(i + 1) * tc.batch])
            x = put_batch(np.swapaxes(xs[idx], 0, 1), mesh, axis=1)  # [L, B, S, H], B over 'data'
            pm = put_batch(np.swapaxes(masks[idx], 0, 1), mesh, axis=1)
            gstep = epoch * steps_per_epoch + i
            lkeys = jax.vmap(lambda l: jax.random.fold_in(jax.random.fold_in(base_key, gstep), l))(layer_ids)
            losses = []
            for j, c in enumerate(chunks):
                kp_c[j], op_c[j], loss = _train_step(cfg, tc, steps_per_epoch, ly_c[j], kp_c[j], op_c[j], x[c], pm[c],
                                                      lkeys[c])
                losses.append(loss)
            run += np.asarray(jnp.concatenate(losses))
            bar.update(1)
            bar.set_postfix_str("loss/layer " + " ".join(f"{v:.2e}" for v in run / (i + 1)))
        val = np.zeros((3, nl))
        for i in range(0, n_val, tc.batch):
            idx = val_idx[i:i + tc.batch]
            x = put_batch(np.swapaxes(xs[idx], 0, 1), mesh, axis=1)
            pm, pp = (put_batch(np.swapaxes(m[idx], 0, 1), mesh, axis=1) for m in (masks, masks_plus))
            parts = [_evaluate(cfg, tc, ly_c[j], kp_c[j], x[c], pm[c], pp[c]) for j, c in enumerate(chunks)]
            val += np.stack([np.concatenate([np.asarray(p[t]) for p in parts]) for t in range(3)]) * len(idx)
        val /= n_val
        kparams = _cat(kp_c)
        better = val[0] < best_val
        best = jax.tree.map(lambda b, k: jnp.where(better.reshape((-1,) + (1,) * (k.ndim - 1)), k, b),
                            best, kparams)
        best_val = np.where(better, val[0], best_val)
        best_epoch = np.where(better, epoch, best_epoch)
        history.append({"epoch": epoch, "train_loss": (run / steps_per_epoch).tolist(), "val_loss": val[0].tolist(),
                        "val_loss_sparse": val[1].tolist(), "val_loss_baseline_plus": val[2].tolist()})
        bar.write(f"epoch {epoch + 1}/{tc.epochs}: val loss mean {val[0].mean():.4e} (sparse {val[1].mean():.4e}, "
                  f"baseline+ {val[2].mean():.4e}); per layer " + " ".join(f"{v:.2e}" for v in val[0]))
        meta = {"epoch": epoch + 1, "history": history, "config": _config_dict(tc),
                "model": L.model_identity(cfg, model_name)}
        mngr.save(epoch + 1, args=ocp.args.Composite(
            state=ocp.args.StandardSave(ckpt_tree(kparams, _cat(op_c), best, best_val, best_epoch)),
            meta=ocp.args.JsonSave(meta)))
        mngr.wait_until_finished()
        last_val = val
        _write_output(out, tc, cfg, model_name, best, {
            "epochs_done": epoch + 1, "val_loss": best_val.tolist(), "best_epoch": best_epoch.tolist(),
            "val_loss_sparse": last_val[1].tolist(), "val_loss_baseline_plus": last_val[2].tolist(),
            "num_train_seqs": int(len(train_idx)), "num_val_seqs": int(n_val), "history": history,
            "wall_seconds": time.perf_counter() - t0})
    bar.close()
    mngr.close()
    return json.loads((out / L.CONFIG_FILE).read_text())
