"""Bad inputs at every entry point, and the table of them in docs/bad-inputs.md (generated from this file).

Each case is a bad value given to the Python API, ``kvjax``, ``kvjax-eval`` or ``kvjax-train-less``; the test
runs it and checks that it fails the documented way: a ``ValueError``/``FileNotFoundError`` (Python) or exit
code 2 with a one-line ``error:`` (command lines), whose message names the argument (``match``). Command lines
run in-process through their ``main(argv)`` (cheap); a few run as real subprocesses (``python -m``, the
console script's module): an error raised in ``kvjax generate``'s streaming worker thread, and at least one
case per console script. The docs table lists every case with the message it really gives;
``test_table_is_current`` fails when the table and the messages part ways. Regenerate it with

    python3 tests/test_bad_inputs.py --write docs/bad-inputs.md
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

if __name__ == "__main__":  # the same environment as the tests (tests/conftest.py): CPU, 8 host devices
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # not tests/, whose kvjax/ folder would shadow kvjax
    sys.path.append(str(Path(__file__).resolve().parent))  # after the root: tests/extended.py
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import pytest
from extended import methods_params
from methods_table import small

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "bad-inputs.md"
ENTRY_POINTS = {
    "python": "Python API",
    "pure": "Pure functions",
    "kvjax": "`kvjax`",
    "kvjax-eval": "`kvjax-eval`",
    "kvjax-train-less": "`kvjax-train-less`",
}


@dataclasses.dataclass(frozen=True)
class Case:
    entry: str  # a key of ENTRY_POINTS
    shown: str  # the input as a user writes it (``{tiny}`` stands for a small local HF checkpoint)
    run: Callable[[dict], object]  # raises (Python) or returns the exit code (command lines)
    match: str  # a regex the message must contain: the argument it names


def _methods(**kw):
    from kvjax import methods

    return lambda ctx: methods.get(**kw)


def _load(path_key=None, **kw):
    import kvjax

    return lambda ctx: kvjax.load_model(ctx[path_key] if path_key else "/no/such/model", **kw)


def _generate(prompt=(5, 6, 7), **kw):
    from kvjax import engine

    return lambda ctx: engine.generate(
        ctx["model"],
        [list(prompt)] if not isinstance(prompt, str) else [prompt],
        **{"method": "full", "max_new_tokens": 4, **kw},
    )


def _generate_with(name, **options):
    from kvjax import engine, methods

    return lambda ctx: engine.generate(ctx["model"], [[5, 6, 7]], methods.get(name, **options), 4)


def _cli(main_path: str, *argv):
    def run(ctx):
        module, func = main_path.rsplit(".", 1)
        main = getattr(__import__(module, fromlist=[func]), func)
        args = [a.format(**ctx) for a in argv]
        try:
            return main(args)
        except SystemExit as e:  # argparse usage errors
            return e.code

    return run


def _proc(module: str, *argv):
    """Run ``python -m module argv`` as a subprocess (this checkout first on PYTHONPATH): its exit code, its
    stderr copied to ours (where :func:`failure` reads it)."""

    def run(ctx):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(
            [sys.executable, "-m", module, *(a.format(**ctx) for a in argv)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        sys.stderr.write(proc.stderr)
        return proc.returncode

    return run


def _stream(**kw):
    from kvjax import engine

    return lambda ctx: list(engine.stream(ctx["model"], [5, 6, 7], "full", **kw))


def _scan_without_traced_layer(ctx):
    import jax.numpy as jnp

    from kvjax import engine
    from kvjax.methods.base import Capacity
    from kvjax.methods.full import Full

    @dataclasses.dataclass(frozen=True)
    class MyMethod(Full):
        traced_layer = False

    return engine.init_states(ctx["model"].config, MyMethod(), 1, Capacity(32, 4), jnp.float32, scan_layers=True)


def _parse_budget(text):
    from kvjax.budget import parse_budget

    return lambda ctx: parse_budget(text)


def _train_config(**kw):
    from train_less.trainer import TrainConfig

    return lambda ctx: TrainConfig(**kw)


#: (case, the call as shown, the regex its message must contain); the sizes PURE_SIZES gives: batch 2, 4 query
#: heads on 2 KV heads of 16 dims, a bucket of 32 tokens.
PURE = [
    ("long", "m.prefill(state, 1, q, k, v, lengths) with 40 tokens in a bucket of 32", "capacity.prompt_len=32"),
    ("layout", "m.prefill(state, 1, q, k, v, lengths) with k, v as [B, T, Hkv, D]", r"k has shape \(2, 24, 2, 16\)"),
    ("repeated", "m.prefill(state, 1, q, k, v, lengths) with k, v repeated to 4 heads", "unrepeated"),
    ("q_heads", "m.prefill(state, 1, q, k, v, lengths) with q of 3 heads", r"q has shape \(2, 3, 24, 16\)"),
    ("lengths_shape", "m.prefill(state, 1, q, k, v, [24, 24, 24])", r"lengths has shape \(3,\)"),
    ("lengths_value", "m.prefill(state, 1, q, k, v, [24, 30]) (T=24)", r"lengths=\[24, 30\]"),
    ("decode_tokens", "m.decode(state, 1, q, k, v, pos) with q, k, v as [B, H, 1, D]", r"q has shape \(2, 4, 1, 16\)"),
    ("pos_shape", "m.decode(state, 1, q, k, v, jnp.zeros((2, 1), jnp.int32))", r"pos has shape \(2, 1\)"),
]
PURE_SIZES = dict(batch=2, heads=4, kv_heads=2, dim=16, bucket=32, steps=4, tokens=24)


def pure_call(name: str, case: str):
    """Run ``case`` of :data:`PURE` on layer 1 of method ``name`` (at its test sizes; layer 1 is compressed for every
    method there); returns what the call returns (it should raise)."""
    import jax.numpy as jnp
    import numpy as np

    from kvjax.config import ModelConfig
    from kvjax.methods import Capacity

    z = PURE_SIZES
    b, hq, hkv, d, t = z["batch"], z["heads"], z["kv_heads"], z["dim"], z["tokens"]
    cfg = ModelConfig("llama", 1, 64, 1, num_layers=2, num_heads=hq, num_kv_heads=hkv, head_dim=d)
    m = small(name).at(1)
    state = m.init(cfg, b, Capacity(z["bucket"], z["steps"]), 1, jnp.float32)
    x = lambda *shape: np.random.default_rng(0).normal(size=shape).astype(np.float32)
    q, k, lengths = x(b, hq, t, d), x(b, hkv, t, d), jnp.full((b,), t)
    if case == "long":
        t = z["bucket"] + 8
        return m.prefill(state, 1, x(b, hq, t, d), x(b, hkv, t, d), x(b, hkv, t, d), jnp.full((b,), t))
    if case == "layout":
        kt = k.transpose(0, 2, 1, 3)
        return m.prefill(state, 1, q, kt, kt, lengths)
    if case == "repeated":
        kr = np.repeat(k, hq // hkv, axis=1)
        return m.prefill(state, 1, q, kr, kr, lengths)
    if case == "q_heads":
        return m.prefill(state, 1, q[:, :3], k, k, lengths)
    if case == "lengths_shape":
        return m.prefill(state, 1, q, k, k, [t] * (b + 1))
    if case == "lengths_value":
        return m.prefill(state, 1, q, k, k, [t, t + 6])
    state = m.prefill(state, 1, q, k, k, lengths)
    if case == "decode_tokens":
        return m.decode(state, 1, x(b, hq, 1, d), x(b, hkv, 1, d), x(b, hkv, 1, d), lengths)
    if case == "pos_shape":
        return m.decode(state, 1, x(b, hq, d), x(b, hkv, d), x(b, hkv, d), jnp.zeros((b, 1), jnp.int32))
    raise AssertionError(case)


KVJAX = "kvjax.cli.main"
EVAL = "eval.cli.main"
TRAIN = "train_less.cli.main"
LONG = " ".join(["word"] * 300)  # 300 tokens of {tiny_tok}'s word-level tokenizer: more than its 256-token context

CASES = [
    # Python API
    Case("python", 'methods.get("nope")', _methods(name="nope"), "not registered"),
    Case("python", 'methods.get("snapkv", budget=0)', _methods(name="snapkv", budget=0), "budget=0"),
    Case("python", 'methods.get("snapkv", budget=1.5)', _methods(name="snapkv", budget=1.5), "budget=1.5"),
    Case(
        "python", 'methods.get("snapkv", budget=float("nan"))', _methods(name="snapkv", budget=float("nan")), "budget"
    ),
    Case("python", 'methods.get("h2o", budget=True)', _methods(name="h2o", budget=True), "budget"),
    Case("python", 'methods.get("snapkv", window=0)', _methods(name="snapkv", window=0), "window=0"),
    Case("python", 'methods.get("chunkkv", chunk_size=0)', _methods(name="chunkkv", chunk_size=0), "chunk_size"),
    Case("python", 'methods.get("chunkkv", reuse=0)', _methods(name="chunkkv", reuse=0), "reuse"),
    Case("python", 'methods.get("pqcache", bits=0)', _methods(name="pqcache", bits=0), "bits"),
    Case("python", 'methods.get("quest", page_size=0)', _methods(name="quest", page_size=0), "page_size"),
    Case(
        "python",
        'methods.get("chelsea", outlier_heads="missing.json")',
        _methods(name="chelsea", outlier_heads="missing.json"),
        "outlier_heads",
    ),
    Case("python", 'methods.get("less", policy="lru")', _methods(name="less", policy="lru"), "policy"),
    Case(
        "python",
        'methods.get("less", kernels="/no/such/folder")',
        _methods(name="less", kernels="/no/such/folder"),
        "kernels",
    ),
    Case("python", 'kvjax.load_model("/no/such/model")', _load(), "no/such/model"),
    # the pure functions (docs/pure-functions.md), shown for snapkv; test_pure_functions_check_their_inputs runs
    # every case on every registered method
    *(Case("pure", shown, lambda ctx, c=case: pure_call("snapkv", c), match) for case, shown, match in PURE),
    Case("python", 'kvjax.load_model({tiny}, mesh="tensor=2")', _load("tiny", mesh="tensor=2"), "tensor"),
    Case("python", 'kvjax.load_model({tiny}, mesh="data=2,model=3")', _load("tiny", mesh="data=2,model=3"), "model"),
    Case("python", 'kvjax.load_model({tiny}, mesh="data=16")', _load("tiny", mesh="data=16"), "devices"),
    Case("python", "generate(model, ids, max_new_tokens=0)", _generate(max_new_tokens=0), "max_new_tokens"),
    Case("python", "generate(model, ids, max_new_tokens=10**6)", _generate(max_new_tokens=10**6), "context"),
    Case("python", "generate(model, [[]])", _generate(prompt=()), "empty prompt"),
    Case(
        "python",
        "generate(model, [])",
        lambda ctx: __import__("kvjax").engine.generate(ctx["model"], []),
        "prompts=\\[\\]",
    ),
    Case(
        "python",
        "list(stream(model, ids, max_new_tokens=0)) (raised in its worker thread)",
        _stream(max_new_tokens=0),
        "max_new_tokens",
    ),
    Case(
        "python", "generate(model, 40 ids, prompt_len=32)", _generate(prompt=range(1, 41), prompt_len=32), "prompt_len"
    ),
    Case("python", 'generate(model, "text") on a model without tokenizer', _generate(prompt="text"), "tokenizer"),
    Case("python", 'generate(model, ids, driver="loop")', _generate(driver="loop"), "driver"),
    Case(
        "python",
        'generate(model, ids, methods.get("snapkv", budget=10**9))',
        _generate_with("snapkv", budget=10**9),
        "budget",
    ),
    Case(
        "python",
        "engine.init_states(..., scan_layers=True) with a method without traced_layer",
        _scan_without_traced_layer,
        "traced_layer",
    ),
    Case("python", 'kvjax.budget.parse_budget("abc")', _parse_budget("abc"), "abc"),
    Case("python", "TrainConfig(budget=600, seq_len=512)", _train_config(budget=600, seq_len=512), "budget=600"),
    Case("python", "TrainConfig(val_frac=1.0)", _train_config(val_frac=1.0), "val_frac"),
    # kvjax
    Case(
        "kvjax",
        "kvjax generate --budget 0 --prompt hi",
        _cli(KVJAX, "generate", "--budget", "0", "--prompt", "hi"),
        "--budget",
    ),
    Case(
        "kvjax",
        "kvjax generate --budget 1.5 --prompt hi",
        _cli(KVJAX, "generate", "--budget", "1.5", "--prompt", "hi"),
        "--budget",
    ),
    Case(
        "kvjax",
        "kvjax generate --method nope --prompt hi",
        _cli(KVJAX, "generate", "--method", "nope", "--prompt", "hi"),
        "--method: 'nope'",
    ),
    Case(
        "kvjax",
        "kvjax generate --max-new-tokens 0 --prompt hi",
        _cli(KVJAX, "generate", "--max-new-tokens", "0", "--prompt", "hi"),
        "--max-new-tokens 0",
    ),
    Case(
        "kvjax",
        "kvjax generate --max-new-tokens -5 --prompt hi",
        _cli(KVJAX, "generate", "--max-new-tokens", "-5", "--prompt", "hi"),
        "--max-new-tokens -5",
    ),
    Case(
        "kvjax",
        "kvjax generate --method snapkv --option windw=4 --prompt hi",
        _cli(KVJAX, "generate", "--method", "snapkv", "--option", "windw=4", "--prompt", "hi"),
        "windw",
    ),
    Case(
        "kvjax",
        "kvjax generate --model {tiny_tok} --prompt '<300 words>' (a real process; raised in the streaming thread)",
        _proc("kvjax.cli", "generate", "--model", "{tiny_tok}", "--prompt", LONG),
        "exceeds the model context",
    ),
    Case(
        "kvjax",
        "kvjax generate --model {tiny} --option window --prompt hi",
        _cli(KVJAX, "generate", "--model", "{tiny}", "--option", "window", "--prompt", "hi"),
        "--option",
    ),
    Case(
        "kvjax",
        "kvjax generate --model {tiny} --mesh tensor=2 --prompt hi",
        _cli(KVJAX, "generate", "--model", "{tiny}", "--mesh", "tensor=2", "--prompt", "hi"),
        "tensor",
    ),
    Case(
        "kvjax",
        "kvjax generate --model /no/such/model --prompt hi",
        _cli(KVJAX, "generate", "--model", "/no/such/model", "--prompt", "hi"),
        "no/such/model",
    ),
    Case("kvjax", "kvjax demo --methods full,nope", _cli(KVJAX, "demo", "--methods", "full,nope"), "nope"),
    Case("kvjax", "kvjax demo --max-new-tokens 0", _cli(KVJAX, "demo", "--max-new-tokens", "0"), "--max-new-tokens"),
    Case(
        "kvjax",
        "kvjax generate --plugin /no/such/methods.py --prompt hi",
        _cli(KVJAX, "generate", "--plugin", "/no/such/methods.py", "--prompt", "hi"),
        "no/such/methods.py",
    ),
    Case(
        "kvjax",
        "kvjax generate --plugin no_such_module --prompt hi",
        _cli(KVJAX, "generate", "--plugin", "no_such_module", "--prompt", "hi"),
        "no_such_module",
    ),
    Case(
        "kvjax",
        "kvjax calibrate-chelsea --out heads.json --text /no/such.txt",
        _cli(KVJAX, "calibrate-chelsea", "--out", "{tmp}/heads.json", "--text", "/no/such.txt"),
        "--text",
    ),
    Case(
        "kvjax",
        "kvjax calibrate-chelsea --out heads.json --keep-layers first",
        _cli(KVJAX, "calibrate-chelsea", "--out", "{tmp}/heads.json", "--keep-layers", "first"),
        "--keep-layers",
    ),
    # kvjax-eval
    Case("kvjax-eval", "kvjax-eval main --budgets 0.2,1.5", _cli(EVAL, "main", "--budgets", "0.2,1.5"), "--budgets"),
    Case("kvjax-eval", "kvjax-eval main --budgets 1,1.0", _cli(EVAL, "main", "--budgets", "1,1.0"), "one token"),
    Case("kvjax-eval", "kvjax-eval main --methods full,nope", _cli(EVAL, "main", "--methods", "full,nope"), "nope"),
    Case(
        "kvjax-eval",
        "kvjax-eval main --plugin /no/such/methods.py",
        _cli(EVAL, "main", "--plugin", "/no/such/methods.py"),
        "no/such/methods.py",
    ),
    Case(
        "kvjax-eval",
        "kvjax-eval main --methods full,snapkv --equal-bytes h2o",
        _cli(EVAL, "main", "--methods", "full,snapkv", "--equal-bytes", "h2o"),
        "--equal-bytes",
    ),
    Case(
        "kvjax-eval", "kvjax-eval perplexity --lengths 512", _cli(EVAL, "perplexity", "--lengths", "512"), "--lengths"
    ),
    Case(
        "kvjax-eval",
        "kvjax-eval main --mesh data=2,model=1 --batch 3",
        _cli(EVAL, "main", "--mesh", "data=2,model=1", "--batch", "3"),
        "--batch",
    ),
    Case("kvjax-eval", "kvjax-eval main --option windw=4", _cli(EVAL, "main", "--option", "windw=4"), "windw"),
    Case("kvjax-eval", "kvjax-eval main --option h2o.window=4", _cli(EVAL, "main", "--option", "h2o.window=4"), "h2o"),
    Case(
        "kvjax-eval",
        "kvjax-eval needle --methods full,snapkv --option chunkkv.chunk_size=4",
        _cli(EVAL, "needle", "--methods", "full,snapkv", "--option", "chunkkv.chunk_size=4"),
        "chunkkv",
    ),
    Case(
        "kvjax-eval",
        "kvjax-eval main --option snapkv.window=0",
        _cli(EVAL, "main", "--option", "snapkv.window=0"),
        "--option snapkv: window=0",
    ),
    Case(
        "kvjax-eval", "kvjax-eval main --option budget=0.1", _cli(EVAL, "main", "--option", "budget=0.1"), "--budgets"
    ),
    Case("kvjax-eval", "kvjax-eval main --option window", _cli(EVAL, "main", "--option", "window"), "--option"),
    Case(
        "kvjax-eval",
        "kvjax-eval plot /no/such/results.json (a real process)",
        _proc("eval.cli", "plot", "/no/such/results.json"),
        "results",
    ),
    Case(
        "kvjax-eval",
        "kvjax-eval main --model {tiny} --lengths 100000",
        _cli(EVAL, "main", "--model", "{tiny}", "--methods", "full", "--lengths", "100000"),
        "lengths",
    ),
    # kvjax-train-less
    Case(
        "kvjax-train-less",
        "kvjax-train-less --out runs/x --batch 0",
        _cli(TRAIN, "--out", "{tmp}/x", "--batch", "0"),
        "batch",
    ),
    Case(
        "kvjax-train-less",
        "kvjax-train-less --out runs/x --budget 600 --seq-len 512",
        _cli(TRAIN, "--out", "{tmp}/x", "--budget", "600", "--seq-len", "512"),
        "budget=600",
    ),
    Case(
        "kvjax-train-less",
        "kvjax-train-less --out runs/x --batch 3 --mesh data=2",
        _cli(TRAIN, "--out", "{tmp}/x", "--batch", "3", "--mesh", "data=2"),
        "--batch 3",
    ),
    Case(
        "kvjax-train-less",
        "kvjax-train-less --out runs/x --mesh data=2,model=4",
        _cli(TRAIN, "--out", "{tmp}/x", "--mesh", "data=2,model=4", "--batch", "2"),
        "model",
    ),
    Case(
        "kvjax-train-less",
        "kvjax-train-less --out runs/x --shard-mb 0",
        _cli(TRAIN, "--out", "{tmp}/x", "--shard-mb", "0"),
        "--shard-mb",
    ),
    Case(
        "kvjax-train-less",
        "kvjax-train-less --out runs/x --checkpoint-every 0",
        _cli(TRAIN, "--out", "{tmp}/x", "--checkpoint-every", "0"),
        "--checkpoint-every",
    ),
    Case(
        "kvjax-train-less",
        "kvjax-train-less --out runs/x --mask h2o",
        _cli(TRAIN, "--out", "{tmp}/x", "--mask", "h2o"),
        "--mask",
    ),
    Case(
        "kvjax-train-less",
        "kvjax-train-less --out runs/x --policy lru",
        _cli(TRAIN, "--out", "{tmp}/x", "--policy", "lru"),
        "--policy",
    ),
    Case(
        "kvjax-train-less",
        "kvjax-train-less --out runs/x --data /no/such/folder (a real process)",
        _proc("train_less.cli", "--out", "{tmp}/x", "--data", "/no/such/folder"),
        "--data",
    ),
]


def failure(case: Case, ctx: dict) -> tuple[str, str]:
    """Run a bad input: ``(how it failed, its message)``. A case that does not fail the documented way is an
    AssertionError naming it."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = case.run(ctx)
    except (ValueError, FileNotFoundError) as e:
        assert case.entry in ("python", "pure"), (
            f"{case.shown}: raised {type(e).__name__} instead of exiting with code 2"
        )
        return type(e).__name__, str(e)
    assert case.entry not in ("python", "pure"), f"{case.shown}: did not raise"
    assert code == 2, f"{case.shown}: exit code {code!r}, want 2; stderr: {err.getvalue()[-500:]}"
    lines = [l for l in err.getvalue().splitlines() if "error:" in l]
    assert len(lines) == 1, f"{case.shown}: want one 'error:' line on stderr, got: {err.getvalue()[-800:]}"
    return "exit 2", lines[0].split("error:", 1)[1].strip()


def context(tmp: Path) -> dict:
    """A small local HF checkpoint (no tokenizer), the same with a word-level tokenizer (``tiny_tok``), and a
    model loaded from the first."""
    import shutil

    import kvjax
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tiny, tiny_tok = tmp / "tiny", tmp / "tiny-tok"
    if not (tiny / "config.json").is_file():
        torch.manual_seed(0)
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=128,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=256,
            )
        ).save_pretrained(tiny)
    if not (tiny_tok / "tokenizer.json").is_file():
        shutil.copytree(tiny, tiny_tok, dirs_exist_ok=True)
        words = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "hi": 2, "word": 3}, unk_token="<unk>"))
        words.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="</s>").save_pretrained(tiny_tok)
    return {
        "tiny": str(tiny),
        "tiny_tok": str(tiny_tok),
        "tmp": str(tmp),
        "model": kvjax.load_model(tiny, dtype="float32"),
    }


def render(rows: list[tuple[Case, str, str]], tmp: str) -> str:
    def clean(text: str) -> str:
        text = text.replace(tmp, "<tmp>").replace("|", "\\|")
        return re.sub(r"\s+", " ", text).strip()

    out = [
        "# Bad inputs and the errors they give",
        "",
        "Every entry point checks its input before it does any work and names the argument and the fix. The "
        "rows below are generated by `tests/test_bad_inputs.py` (`python3 tests/test_bad_inputs.py --write "
        "docs/bad-inputs.md`), which runs each bad input and checks the message; the Python API raises "
        "`ValueError` (or `FileNotFoundError` for missing files), the command lines exit with code 2 and print "
        "one `error:` line. `{tiny}` is a small local Hugging Face checkpoint (`{tiny_tok}`: the same with a "
        "word-level tokenizer). A budget too small for its method is not an error: it runs and warns once "
        "(`kvjax.budget.BudgetWarning`, printed by the command lines as one `warning:` line).",
        "",
    ]
    for entry, title in ENTRY_POINTS.items():
        out += [f"## {title}", "", "| input | error |", "|---|---|"]
        for case, how, msg in rows:
            if case.entry == entry:
                kind = "" if how == "exit 2" else f"`{how}`: "
                out.append(f"| `{clean(case.shown)}` | {kind}{clean(msg)} |")
        out.append("")
    return "\n".join(out)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    pytest.importorskip("transformers")
    return context(tmp_path_factory.mktemp("bad-inputs"))


@pytest.fixture(scope="module")
def results(ctx):
    return [(c, *failure(c, ctx)) for c in CASES]


@pytest.mark.parametrize("i", range(len(CASES)), ids=[c.shown[:60] for c in CASES])
def test_bad_input_fails_clearly(results, i):
    case, how, msg = results[i]
    assert re.search(case.match, msg), f"{case.shown}: the message does not name {case.match!r}: {msg}"
    assert "Traceback" not in msg


def test_a_failed_subprocess_is_one_error_line(capsys):
    """``kvjax install-assets`` runs pip: a pip failure is one ``error:`` line naming the command, exit code 2."""
    from kvjax.cli import run_cli

    def pip_fails():
        subprocess.run([sys.executable, "-c", "import sys; sys.exit(3)"], check=True)

    assert run_cli("kvjax", pip_fails) == 2
    lines = [l for l in capsys.readouterr().err.splitlines() if "error:" in l]
    assert len(lines) == 1 and "failed with exit code 3" in lines[0] and "Traceback" not in lines[0]


@pytest.mark.parametrize("case,shown,match", PURE, ids=[c[0] for c in PURE])
@pytest.mark.parametrize("name", sorted(__import__("kvjax.methods").methods.REGISTRY))
def test_pure_functions_check_their_inputs(name, case, shown, match):
    """Every registered method's ``prefill``/``decode`` refuse each bad argument with a ValueError naming it, its
    shape and the expected one (kvjax.methods.boundary, applied by Method.__init_subclass__)."""
    with pytest.raises(ValueError, match=match):
        pure_call(name, case)


@pytest.mark.parametrize("name", methods_params(sorted(__import__("kvjax.methods").methods.REGISTRY)))
def test_lengths_and_pos_as_lists(name):
    """``lengths`` and ``pos`` given as Python lists (and ``pos`` as numpy) give the states and outputs jnp arrays
    give."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax.config import ModelConfig
    from kvjax.methods import Capacity

    cfg = ModelConfig("llama", 1, 64, 1, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    m = small(name).at(1)
    x = np.random.default_rng(1).normal(size=(3, 2, 4, 24, 16)).astype(np.float32)
    q, k, v = x[0], x[1, :, :2], x[2, :, :2]
    runs = []
    for lengths, pos in (([24, 17], [24, 17]), (jnp.array([24, 17]), jnp.array([24, 17], jnp.int32))):
        st = m.prefill(m.init(cfg, 2, Capacity(32, 4), 1, jnp.float32), 1, q, k, v, lengths)
        pos = np.asarray(pos) if isinstance(pos, list) else pos
        runs.append(m.decode(st, 1, q[:, :, 0], k[:, :, 0], v[:, :, 0], pos))
    for a, b in zip(*(jax.tree.leaves(r) for r in runs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_configs_sharing_a_state_shape_are_both_accepted():
    """Two configs whose ``full`` states have one shape (4 and 8 query heads over 2 KV heads, buckets 24 and 32
    within the same slot count) are each accepted in any order; a query-head count neither was built for is
    still refused, naming the most recent one."""
    import jax.numpy as jnp
    import numpy as np

    from kvjax import methods
    from kvjax.config import ModelConfig
    from kvjax.methods import Capacity

    cfg = lambda hq: ModelConfig("llama", 1, 64, 1, num_layers=1, num_heads=hq, num_kv_heads=2, head_dim=16)
    m = methods.get("full")
    a = m.init(cfg(4), 2, Capacity(32, 4), 0, jnp.float32)
    b = m.init(cfg(8), 2, Capacity(24, 12), 0, jnp.float32)
    assert all(x.shape == y.shape for x, y in zip(*map(__import__("jax").tree.leaves, (a, b))))
    x = lambda *s: np.random.default_rng(0).normal(size=s).astype(np.float32)
    k, v = x(2, 2, 32, 16), x(2, 2, 32, 16)
    m.prefill(a, 0, x(2, 4, 32, 16), k, v, [32, 20])  # cfg(4) at its bucket 32, after cfg(8)'s init
    m.prefill(b, 0, x(2, 8, 24, 16), k[:, :, :24], v[:, :, :24], [24, 20])
    with pytest.raises(ValueError, match=r"q has shape \(2, 6, 24, 16\); expected \(batch=2, heads=8"):
        m.prefill(b, 0, x(2, 6, 24, 16), k[:, :, :24], v[:, :, :24], [24, 20])
    with pytest.raises(ValueError, match="capacity.prompt_len=24"):  # cfg(8) was built for 24 tokens, not 32
        m.prefill(b, 0, x(2, 8, 32, 16), k, v, [32, 20])


def test_table_is_current(results, ctx):
    want = render(results, ctx["tmp"])
    have = DOC.read_text() if DOC.is_file() else ""
    assert have == want + "\n", (
        "docs/bad-inputs.md is out of date; regenerate it with "
        "`python3 tests/test_bad_inputs.py --write docs/bad-inputs.md`"
    )


if __name__ == "__main__":
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description="write the bad-inputs table")
    ap.add_argument("--write", default=str(DOC))
    path = ap.parse_args().write
    rows, problems = [], []
    with tempfile.TemporaryDirectory() as d:
        c = context(Path(d))
        for case in CASES:
            try:
                rows.append((case, *failure(case, c)))
            except AssertionError as e:
                problems.append(str(e))
        table = render(rows, c["tmp"])
    if problems:
        sys.exit("not written; these inputs do not fail the documented way:\n" + "\n".join(problems))
    Path(path).write_text(table + "\n")
    print(f"wrote {path} ({len(CASES)} cases)")
