"""One budget parser (kvjax.budget.parse_budget) behind --budget / --budgets of kvjax, kvjax-eval and
kvjax-train-less: bad values are argparse usage errors (exit code 2) naming the option; a token budget above
the model context is a clear error."""

import pytest

from eval import cli as eval_cli
from kvjax import cli as kvjax_cli
from kvjax import engine, methods
from train_less import cli as train_cli

BAD = ["0", "-1", "nan", "abc", "1.5", "true"]


def _exit_code(fn, argv, capsys):
    with pytest.raises(SystemExit) as e:
        fn(argv)
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("bad", BAD)
def test_kvjax_budget_bad(bad, capsys):
    for argv in (["generate", "--prompt", "hi", "--budget", bad], ["demo", "--budget", bad]):
        code, err = _exit_code(kvjax_cli.build_parser().parse_args, argv, capsys)
        assert code == 2 and "argument --budget:" in err and "--budget" in err.split("argument --budget:")[1]


@pytest.mark.parametrize("bad", BAD + ["0.2,abc", ",", "0.2,256,0.2", "1,0.5,1.0"])
def test_eval_budgets_bad(bad, capsys):
    code, err = _exit_code(eval_cli.main, ["needle", "--budgets", bad], capsys)
    assert code == 2 and "argument --budgets:" in err and "--budgets" in err.split("argument --budgets:")[1]


@pytest.mark.parametrize("bad", BAD)
def test_train_less_budget_bad(bad, capsys, tmp_path):
    code, err = _exit_code(train_cli.main, ["--out", str(tmp_path), "--budget", bad], capsys)
    assert code == 2 and "argument --budget:" in err


def test_good_values_parse():
    args = eval_cli.build_parser().parse_args(["needle", "--budgets", "0.2,256,1.0"])
    assert args.budgets == [0.2, 256, 1.0] and isinstance(args.budgets[1], int)
    assert kvjax_cli.build_parser().parse_args(["demo", "--budget", "256"]).budget == 256
    assert kvjax_cli.build_parser().parse_args(["demo", "--budget", "0.25"]).budget == 0.25
    assert train_cli.build_parser().parse_args(["--out", "x", "--budget", "52"]).budget == 52


# the sizes and seed of the tiny fixture's model (tests/conftest.py)
pytestmark = pytest.mark.tiny(
    num_layers=1, num_heads=2, num_kv_heads=1, max_position_embeddings=128, seed=0, scale=0.02
)


def test_token_budget_above_context(tiny, monkeypatch, capsys, tmp_path):
    import kvjax

    monkeypatch.setattr(kvjax, "load_model", lambda *a, **k: tiny)
    code = kvjax_cli.main(["generate", "--prompt", "hi", "--method", "snapkv", "--budget", "1000"])
    assert code == 2 and "budget=1000 tokens exceeds the model context of 128" in capsys.readouterr().err
    with pytest.raises(ValueError, match="exceeds the model context of 128"):
        engine.check_method(tiny.config, methods.get("snapkv", budget=1000))
    # kvjax-train-less: the sparse budget must be below the training sequence length
    code = train_cli.main(["--out", str(tmp_path), "--budget", "1000", "--seq-len", "64"])
    assert code == 2 and "budget=1000" in capsys.readouterr().err
    # kvjax-eval refuses before running anything (the runner checks against the loaded model's context)
    from eval import runner

    with pytest.raises(ValueError, match="--budgets=1000 tokens exceeds the model context of 128"):
        runner.run(tiny, [], ["snapkv"], [1000], progress=False)


@pytest.mark.parametrize(
    "argv",
    [
        ["perplexity", "--lengths", "512"],
        ["perplexity", "--seed", "1"],
        ["perplexity", "--max-new-tokens", "8"],
        ["fidelity", "--batch", "2"],
        ["longbench", "--data", "x", "--lengths", "512"],
        ["fidelity", "--equal-bytes", "snapkv"],
    ],
)
def test_eval_refuses_options_its_task_does_not_use(argv, capsys):
    """An option a subcommand would ignore is a usage error naming it, not silently dropped."""
    code, err = _exit_code(eval_cli.main, argv, capsys)
    assert code == 2 and "unrecognized arguments" in err and argv[-2] in err


def test_eval_equal_bytes_is_checked_before_loading_the_model(capsys, tmp_path):
    missing = str(tmp_path / "no-model")  # would raise FileNotFoundError if the model were loaded first
    code = eval_cli.main(["needle", "--model", missing, "--methods", "full,snapkv", "--equal-bytes", "h2o"])
    err = capsys.readouterr().err
    assert code == 2 and "--equal-bytes 'h2o'" in err and "snapkv" in err and "no-model" not in err


def test_kvjax_generate_method_options(capsys, tmp_path):
    """``kvjax generate --option KEY=VALUE`` sets any field of the method's config (literals parsed, paths kept)."""
    args = kvjax_cli.build_parser().parse_args(
        [
            "generate",
            "--prompt",
            "hi",
            "--method",
            "chunkkv",
            "--budget",
            "0.3",
            "--option",
            "chunk_size=4",
            "--option",
            "mode='paper_literal'",
        ]
    )
    m = kvjax_cli._method(args.method, args.budget, args.option)
    assert (m.chunk_size, m.mode, m.budget) == (4, "paper_literal", 0.3)
    missing = tmp_path / "no-kernels"
    with pytest.raises(FileNotFoundError, match="no-kernels"):  # the path reaches LESS's kernel loading
        kvjax_cli._method("less", 24, [kvjax_cli.parse_option(f"kernels={missing}")])
    with pytest.raises(ValueError, match="chunk_sise"):
        kvjax_cli._method("chunkkv", 0.2, [("chunk_sise", 4)])
    with pytest.raises(ValueError, match="--budget"):
        kvjax_cli._method("snapkv", None, [("budget", 0.2)])
    code, err = _exit_code(kvjax_cli.build_parser().parse_args, ["generate", "--prompt", "x", "--option", "4"], capsys)
    assert code == 2 and "--option" in err and "KEY=VALUE" in err
