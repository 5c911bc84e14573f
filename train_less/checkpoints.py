"""The orbax checkpoints of a LESS training run (``<run>/checkpoints``; :func:`train_less.trainer.train`).

A checkpoint holds the kernels and their Adam states (every selected layer, ``[L, ...]``) and a :class:`Record`:
the best kernels per layer with their validation losses and epochs, the history, and where the run stands (epoch,
step within it, the running loss of a mid-epoch checkpoint). Its JSON part also holds the training config and the
model's identity, so that ``resume`` refuses a run of other settings. Saves are atomic (orbax), at most two are
kept, and an unreadable one is moved aside to ``checkpoints-corrupt/`` with a warning and the previous one used.
With a mesh every leaf is saved as a replicated global array: orbax's multi-process save needs them so.
"""

from __future__ import annotations

import dataclasses
import shutil
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from kvjax import sharding as S


@dataclasses.dataclass
class Record:
    """What a checkpoint holds besides the kernels and their Adam states."""

    best: dict  # the best kernels per layer so far, [L, ...] leaves
    best_val: np.ndarray  # [L] their validation losses (inf before the first epoch)
    best_epoch: np.ndarray  # [L] the epochs they come from (-1 before the first)
    history: list  # one dict per epoch done (losses per layer)
    epoch: int = 0  # the epoch the run is in (its steps before ``step`` are done)
    step: int = 0
    run: np.ndarray | None = None  # [L] the running loss sum of a mid-epoch checkpoint (None at an epoch's end)

    @classmethod
    def fresh(cls, kernels: dict) -> "Record":
        n = jax.tree.leaves(kernels)[0].shape[0]
        return cls(kernels, np.full((n,), np.inf), np.full((n,), -1), [])


class Checkpoints:
    """The checkpoints of the run in ``run_dir``: ``resume`` must match whether it already holds some (ValueError
    otherwise, naming the fix); :meth:`restore` (resume) or :meth:`start` (a new run) opens them."""

    def __init__(self, run_dir: Path, mesh, config: dict, model_identity: dict, resume: bool):
        self.dir, self.mesh, self.config, self.ident = run_dir / "checkpoints", mesh, config, model_identity
        held = self.dir.exists() and any(self.dir.iterdir())
        if held and not resume:
            raise ValueError(
                f"{str(run_dir)!r} already holds checkpoints; pass resume=True (--resume) to continue "
                "that run, or choose a new folder"
            )
        if resume and not held:
            raise ValueError(f"resume=True but {str(run_dir)!r} has no checkpoint to resume from")
        self.mngr = None

    def _tree(self, kernels, opt, rec: Record):
        tree = {
            "params": kernels,
            "best": rec.best,
            "opt": {f"{i:04d}": x for i, x in enumerate(jax.tree.leaves(opt))},
            "best_val": np.asarray(rec.best_val),
            "best_epoch": np.asarray(rec.best_epoch),
        }
        return jax.tree.map(jnp.asarray, tree) if self.mesh is None else jax.device_put(tree, S.replicated(self.mesh))

    def _check(self, meta: dict) -> None:
        saved = {k: v for k, v in meta["config"].items() if k != "epochs"}
        now = {k: v for k, v in self.config.items() if k != "epochs"}
        if saved != now or meta["model"] != self.ident:
            diff = sorted(k for k in now if saved.get(k) != now[k])
            raise ValueError(
                f"resume: the checkpoint in {str(self.dir.parent)!r} was written with a different "
                f"config (differs in {diff or 'the model'}); resume with the same settings or use a new "
                "folder"
            )

    def start(self) -> None:
        self.mngr = ocp.CheckpointManager(self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))

    def restore(self, kernels, opt, rec: Record):
        """``(kernels, opt, record)`` of the newest readable checkpoint; the arguments give the structure."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self._tree(kernels, opt, rec))
        self.mngr, meta, st = restore_newest(self.dir, abstract, self._check)
        leaves, treedef = jax.tree.flatten(opt)
        opt = jax.tree.unflatten(treedef, [st["opt"][f"{i:04d}"] for i in range(len(leaves))])
        run = None if meta.get("run") is None else np.asarray(meta["run"], np.float64)
        return (
            st["params"],
            opt,
            Record(
                st["best"],
                np.asarray(st["best_val"]),
                np.asarray(st["best_epoch"]),
                meta["history"],
                meta["epoch"],
                meta.get("step", 0),
                run,
            ),
        )

    def save(self, step: int, kernels, opt, rec: Record, epoch: int, in_epoch: int, run) -> None:
        """Checkpoint ``step`` (global steps done): the run stands at step ``in_epoch`` of ``epoch``."""
        meta = {
            "epoch": epoch,
            "step": in_epoch,
            "run": run,
            "history": rec.history,
            "config": self.config,
            "model": self.ident,
        }
        self.mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(self._tree(kernels, opt, rec)), meta=ocp.args.JsonSave(meta)
            ),
        )
        self.mngr.wait_until_finished()

    def close(self) -> None:
        self.mngr.close()


def restore_newest(ckpt_dir: Path, abstract, check):
    """The newest readable checkpoint in ``ckpt_dir`` -> ``(manager, meta, state)``. ``check(meta)`` raises for a
    run of other settings. An unreadable (truncated, corrupt) checkpoint is reported by name and moved to
    ``checkpoints-corrupt/``, and the one before it is used; ValueError when none is readable."""
    opts = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    mngr = ocp.CheckpointManager(ckpt_dir, options=opts)
    bad = []
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 - any failure to read is a corrupt checkpoint
            bad.append((step, e))
            continue
        check(meta)
        try:
            state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        except Exception as e:  # noqa: BLE001
            bad.append((step, e))
            continue
        if bad:
            mngr.close()
            aside = ckpt_dir.parent / "checkpoints-corrupt"
            aside.mkdir(exist_ok=True)
            for b, e in bad:
                warnings.warn(
                    f"checkpoint {ckpt_dir / str(b)} is unreadable ({type(e).__name__}: {str(e)[:200]}); "
                    f"moved to {aside / str(b)}, resuming from the previous one, {ckpt_dir / str(step)}",
                    stacklevel=4,
                )
                shutil.move(str(ckpt_dir / str(b)), str(aside / str(b)))
            mngr = ocp.CheckpointManager(ckpt_dir, options=opts)
        return mngr, meta, state
    mngr.close()
    raise ValueError(
        f"no readable checkpoint in {ckpt_dir}: "
        + "; ".join(f"{ckpt_dir / str(b)}: {type(e).__name__}: {str(e)[:200]}" for b, e in bad)
        + ". Start a new run in a new folder"
    )
