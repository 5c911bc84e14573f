"""``kvjax-train-less``: train LESS kernels for a model from the command line.

    kvjax-train-less --out runs/less-h2o --budget 52 --seq-len 512 --num-seqs 64 --epochs 40
    kvjax-train-less --out runs/less-h2o --resume          # continue an interrupted run (same settings)
    kvjax-train-less --out runs/less-h2o --batch 8 --mesh data=8   # data parallel: the batch split over 8 devices
    kvjax-train-less --out runs/llama --model meta-llama/Llama-2-7b-hf --seq-len 4096 --num-seqs 512 --budget 204 \\
        --layers 0-7 --store-dtype bfloat16 --checkpoint-every 50      # then --layers 8-15, 16-23, 24-31: one folder
    kvjax-train-less --out runs/llama --merge                       # re-merge layers-*/ runs copied into one folder

Then ``kvjax.methods.get("less", policy="h2o", budget=52, kernels="runs/less-h2o")``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvjax.cli import HelpFormatter, budget_type, run_cli


def _number(text: str):
    return float(text) if "." in text else int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvjax-train-less", description=__doc__.replace("``", ""), formatter_class=HelpFormatter
    )
    for add in (_data_args, _kernel_args, _training_args, _run_args):
        add(p)
    return p


def _data_args(p) -> None:
    """Where the run writes, the model, and the training text."""
    p.add_argument(
        "--out",
        required=True,
        help="output folder: kernels.npz, less_config.json, checkpoints/ "
        "(with --layers: the run in OUT/layers-A-B/, merged into OUT)",
    )
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="kvjax.load_model name/path (HF folder, .gguf, hub id, or an embedded model: SmolLM2, gemma3-270m)",
    )
    p.add_argument(
        "--data",
        nargs="*",
        default=None,
        help="text files, jsonl files ('text' per line) or folders; default: embedded essays + Bible "
        "(minus the held-out essays and Gospel of John)",
    )
    p.add_argument("--hf-dataset", default=None, help="a Hugging Face dataset name (e.g. allenai/c4), streamed")
    p.add_argument("--hf-split", default="train", help="split of --hf-dataset")
    p.add_argument("--hf-field", default="text", help="text field of --hf-dataset")


def _kernel_args(p) -> None:
    """The sparse policy LESS wraps and the kernels' shape."""
    p.add_argument("--policy", choices=("h2o", "lambda"), default="h2o", help="the sparse policy LESS wraps")
    p.add_argument(
        "--budget",
        type=budget_type("--budget"),
        default=None,
        help="sparse cache tokens (256), or a fraction of --seq-len (0.2) (default: 0.2 of --seq-len, the budget "
        "kvjax generate and kvjax-eval give LESS, so the kernels are used at the fraction they were trained at)",
    )
    p.add_argument("--recent", type=_number, default=0.5, help="H2O recent window: fraction of budget or tokens")
    p.add_argument("--sinks", type=int, default=4, help="lambda policy: attention-sink tokens")
    p.add_argument("--rank", type=int, default=8, help="rank R of the low-rank state")
    p.add_argument("--hidden", type=int, default=512, help="hidden width of the kernel MLPs")
    p.add_argument("--dropout", type=float, default=0.3, help="dropout of the kernel MLPs")


def _training_args(p) -> None:
    """The optimisation: epochs, batches, sequences, learning rate, layers, the loss's attention."""
    p.add_argument("--epochs", type=int, default=40, help="training epochs")
    p.add_argument("--batch", type=int, default=2, help="sequences per training step")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence")
    p.add_argument("--num-seqs", type=int, default=64, help="training + validation sequences")
    p.add_argument("--val-frac", type=float, default=0.1, help="share of the sequences held out for validation")
    p.add_argument("--lr", type=float, default=1e-3, help="initial learning rate")
    p.add_argument("--halve-every", type=int, default=10, help="epochs between learning-rate halvings")
    p.add_argument(
        "--layers-per-step",
        type=int,
        default=None,
        help="layers vmapped together (default: all; lower it when memory is short)",
    )
    p.add_argument("--store-dtype", default="float32", help="dtype of the captured activations (float32, bfloat16)")
    p.add_argument(
        "--layers",
        default=None,
        metavar="A-B",
        help=(
            "train only these layers ('0-7', '0,2,5-9'; default: all, or a hybrid model's global ones); runs of one "
            "--out merge into one kernels folder"
        ),
    )
    p.add_argument(
        "--mask",
        choices=("decode", "paper"),
        default="decode",
        help="parallel H2O mask: kvjax's decode semantics or the paper's (full-attention scores)",
    )
    p.add_argument(
        "--query-chunk",
        type=int,
        default=512,
        help="query rows per attention block in the loss (memory linear in --seq-len); 0: unchunked",
    )


def _run_args(p) -> None:
    """The capture on disk, checkpoints, merging, seed, mesh, resume and progress."""
    p.add_argument(
        "--shard-mb",
        type=float,
        default=1024,
        help="MiB per capture shard on disk: the capture's host-memory bound besides one batch",
    )
    p.add_argument(
        "--capture-batch",
        type=int,
        default=None,
        help="sequences per capture forward pass (default max(--batch, 4)); host memory holds one batch",
    )
    p.add_argument(
        "--capture-dir",
        default=None,
        help="where the activation capture goes (default OUT[/layers-A-B]/capture; a fast, large disk)",
    )
    p.add_argument("--keep-capture", action="store_true", help="keep the capture when training ends")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="STEPS",
        help="also checkpoint every STEPS steps within an epoch (long epochs)",
    )
    p.add_argument("--merge", action="store_true", help="only merge OUT/layers-*/ runs into OUT, then exit")
    p.add_argument("--seed", type=int, default=0, help="seed of the sequence split, initialisation and dropout")
    p.add_argument(
        "--mesh",
        default=None,
        metavar="data=N",
        help="data parallel over a device mesh (kvjax.sharding): each batch split over 'data' (--batch a "
        "multiple of N), kernels and optimizer state replicated",
    )
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli("kvjax-train-less", run, args)


def run(args) -> int:
    """Train (or ``--merge``) as the parsed ``args`` say. Bad values raise ValueError/FileNotFoundError before the
    model loads where they can (:func:`kvjax.cli.run_cli` prints them as one ``error:`` line)."""
    import kvjax
    from kvjax.methods import less as L
    from train_less import data
    from train_less.trainer import check_mesh, make_mesh, merge_parts, train

    if args.merge:
        meta = merge_parts(args.out)
        print(json.dumps({"out": args.out, "layers_trained": meta["layers_trained"], "parts": meta["parts"]}))
        return 0

    tc = _train_config(args)
    mesh = None if args.mesh is None else make_mesh(args.mesh)
    if mesh is not None:
        check_mesh(mesh, tc.batch)
    t0 = time.perf_counter()
    model = kvjax.load_model(args.model)
    if model.tokenizer is None:
        raise ValueError(f"model={args.model!r} was loaded without a tokenizer; LESS training needs one to read text")
    tokens = data.sequences(model.tokenizer, _sources(args), tc.seq_len, tc.num_seqs)
    try:
        layers = (
            list(model.config.global_layers)
            if args.layers is None
            else L.parse_layers(args.layers, model.config.num_layers)
        )
    except ValueError as e:
        raise ValueError(f"--layers: {e}") from None
    print(
        f"kvjax-train-less: {model.name}, {tokens.shape[0]} sequences x {tc.seq_len} tokens, policy {tc.policy} "
        f"budget {tc.budget_tokens}, R={tc.rank}, layers {L.format_layers(layers)} of "
        f"{model.config.num_layers}",
        file=sys.stderr,
    )
    meta = train(
        model.config,
        model.params,
        tokens,
        tc,
        args.out,
        model_name=model.name,
        resume=args.resume,
        progress=not args.no_progress,
        mesh=mesh,
        layers=layers,
        shard_mb=args.shard_mb,
        capture_dir=args.capture_dir,
        keep_capture=args.keep_capture,
        checkpoint_every=args.checkpoint_every,
        capture_batch=args.capture_batch,
    )
    print(json.dumps(_summary(args, meta, time.perf_counter() - t0)))
    return 0


def _train_config(args):
    """The parsed arguments as a :class:`~train_less.trainer.TrainConfig` (``--budget`` as a fraction of
    ``--seq-len`` made tokens), the run's own options checked."""
    from train_less.trainer import TrainConfig

    if isinstance(args.budget, float):  # a fraction of the training sequence length, in tokens
        from kvjax.budget import budget_tokens

        args.budget = budget_tokens(args.budget, args.seq_len)
    tc = TrainConfig(
        policy=args.policy,
        budget=args.budget,
        recent=args.recent,
        sinks=args.sinks,
        rank=args.rank,
        hidden=args.hidden,
        dropout=args.dropout,
        epochs=args.epochs,
        batch=args.batch,
        seq_len=args.seq_len,
        num_seqs=args.num_seqs,
        val_frac=args.val_frac,
        lr=args.lr,
        halve_every=args.halve_every,
        layers_per_step=args.layers_per_step,
        seed=args.seed,
        store_dtype=args.store_dtype,
        mask=args.mask,
        query_chunk=args.query_chunk or None,
    )
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise ValueError(f"--checkpoint-every {args.checkpoint_every} must be >= 1 step")
    if args.capture_batch is not None and args.capture_batch < 1:
        raise ValueError(f"--capture-batch {args.capture_batch} must be >= 1")
    if args.shard_mb <= 0:
        raise ValueError(f"--shard-mb {args.shard_mb} must be > 0 MiB")
    for path in args.data or ():
        if not Path(path).exists():
            raise FileNotFoundError(
                f"--data {path}: no such file or folder; pass text files, jsonl files ('text' "
                "per line) or folders of them, or leave --data out for the embedded corpus"
            )
    return tc


def _sources(args) -> dict:
    """The training text: ``--data`` files, a streamed ``--hf-dataset``, or the embedded corpus."""
    from train_less import data

    if args.data:
        return {str(p): data.read_source(p) for p in args.data}
    if args.hf_dataset:
        return {args.hf_dataset: data.hf_source(args.hf_dataset, args.hf_split, args.hf_field)}
    return data.default_sources()


def _summary(args, meta, seconds) -> dict:
    """The one JSON line a run prints: where, epochs, time, layers and the mean validation losses."""

    def mean(key):
        vals = [v for v in meta[key] if v is not None]
        return sum(vals) / len(vals)

    return {
        "out": args.out,
        "epochs_done": meta["epochs_done"],
        "wall_seconds": seconds,
        "layers_trained": meta["layers_trained"],
        "val_loss_mean": mean("val_loss"),
        "val_loss_sparse_mean": mean("val_loss_sparse"),
        "val_loss_baseline_plus_mean": mean("val_loss_baseline_plus"),
    }


if __name__ == "__main__":
    sys.exit(main())
