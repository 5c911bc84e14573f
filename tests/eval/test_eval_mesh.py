"""``kvjax-eval --mesh``: the eval tasks on a sharded model (8 host devices, tests/conftest.py) against the same
run on one device, the independent reference. A tiny random Llama saved as a local HF folder with the embedded
SmolLM2 tokenizer (the needle, perplexity and fidelity tasks read text)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import kvjax
from eval import cli, fidelity, harness
from kvjax import engine
from tiny_models import save_tiny_llama

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py sets XLA_FLAGS)")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
MESH = "data=2,model=4"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-eval-mesh"))


def _main(path, out, *extra):
    argv = [
        "main",
        "--model",
        str(path),
        "--methods",
        "snapkv",
        "--budgets",
        "0.5",
        "--lengths",
        "160",
        "--depths",
        "0,1",
        "--batch",
        "2",
        "--max-new-tokens",
        "4",
        "--sequences",
        "2",
        "--prefix",
        "64",
        "--continuation",
        "8",
        "--trials",
        "1",
        "--no-progress",
        "--out",
        str(out),
        *extra,
    ]
    assert cli.main(argv) == 0
    return json.loads((out / "results.json").read_text())


@pytest.mark.extended  # CI's second line (.ci/run); not the default run, for time (docs/testing.md)
def test_main_with_mesh_equals_one_device(tiny_path, tmp_path, monkeypatch):
    one = _main(tiny_path, tmp_path / "one")
    seen = []  # (mesh, state leaf sharding spec) of every prefill the perplexity task runs
    prefill = engine.prefill

    def spy(cfg, method, params, tokens, lengths, states, mesh=None):
        seen.append((mesh, jax.tree.leaves(states)[0].sharding.spec))
        return prefill(cfg, method, params, tokens, lengths, states, mesh=mesh)

    monkeypatch.setattr(engine, "prefill", spy)
    sharded = _main(tiny_path, tmp_path / "mesh", "--mesh", MESH)
    assert sharded["config"]["mesh"] == MESH and one["config"]["mesh"] is None
    # the main job scans the layers by default: a stacked leaf has the layer axis first, unsharded
    assert seen and all(
        m is not None and dict(m.shape) == {"data": 2, "model": 4} and tuple(spec[:3]) == (None, "data", "model")
        for m, spec in seen
    )
    assert len(one["rows"]) == len(sharded["rows"]) == 4
    for a, b in zip(one["rows"], sharded["rows"]):
        assert (a["task"], a["method"], a["budget"]) == (b["task"], b["method"], b["budget"])
        assert (a["tokens_held"], a["cache_bytes"]) == (b["tokens_held"], b["cache_bytes"])
        if a["task"] == "perplexity":
            assert b["nll"] == pytest.approx(a["nll"], abs=1e-5)
        else:
            assert (a["answer"], a["score"]) == (b["answer"], b["score"])
    assert len({r["answer"] for r in one["rows"] if r["task"] == "needle"}) > 1  # not a degenerate model
    assert (tmp_path / "mesh" / "results.md").is_file()
    monkeypatch.setattr(engine, "prefill", prefill)
    scanned = _main(tiny_path, tmp_path / "scan", "--mesh", MESH, "--scan-layers")  # stacked layers, one body
    for a, b in zip(one["rows"], scanned["rows"]):
        assert (a["tokens_held"], a["cache_bytes"], a.get("answer")) == (
            b["tokens_held"],
            b["cache_bytes"],
            b.get("answer"),
        )
        assert b["score"] == pytest.approx(a["score"], abs=1e-5)


def test_ruler_protocol_and_fidelity_sharded_equal_one_device(tiny_path):
    model = kvjax.load_model(tiny_path)
    sharded = kvjax.shard(model, MESH)
    method = kvjax.methods.get("snapkv", budget=0.5, window=4)
    rng = np.random.RandomState(0)
    contexts = [list(rng.randint(3, 1000, size=n)) for n in (30, 21)]
    questions = [list(rng.randint(3, 1000, size=n)) for n in (3, 5)]
    run = lambda m: harness.answer_after_context(
        m, method, contexts, questions, bucket=32, max_new_tokens=4, memory=True
    )
    assert run(sharded) == run(model)
    ids = list(rng.randint(3, 1000, size=40))
    ref, got = fidelity.probe(model, ids, method, probes=4), fidelity.probe(sharded, ids, method, probes=4)
    np.testing.assert_allclose(got["rel_error"], ref["rel_error"], rtol=1e-4, atol=1e-6)
    assert (got["recall"], got["jaccard"], got["cache_bytes"]) == (ref["recall"], ref["jaccard"], ref["cache_bytes"])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--mesh", "data=1,tensor=8"], "mesh axis 'tensor' is unknown"),
        (["--mesh", "data=1,model=3"], "'model' has size 3 but the model has 8 attention heads"),
        (["--mesh", "data=2,model=4", "--batch", "3"], "--batch 3: mesh axis 'data' has size 2"),
        (["--mesh", "data=2,model=4", "--batch", "2", "--sequences", "3"], "--sequences 3: mesh axis 'data'"),
    ],
)
def test_bad_mesh_is_exit_2_naming_the_axis(tiny_path, tmp_path, capsys, argv, message):
    code = cli.main(["main", "--model", str(tiny_path), "--out", str(tmp_path), "--no-progress", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "results.json").exists()
