"""The multi-host script in one process and ``kvjax generate --mesh`` errors (8 host devices, tests/conftest.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import kvjax
from kvjax import cli
from repo_scripts import load_script
from tiny_models import random_hf

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py sets XLA_FLAGS)")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    hf = random_hf(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    path = tmp_path_factory.mktemp("tiny-mh")
    hf.save_pretrained(path)
    return path


def test_multihost_script_single_process_equals_one_device(tiny_path, capsys):
    script = load_script("scripts/multihost.py", "multihost")
    assert (
        script.main(
            [
                "--single-process",
                "--mesh",
                "data=2,model=4",
                "--model",
                str(tiny_path),
                "--method",
                "snapkv",
                "--budget",
                "0.5",
                "--max-new-tokens",
                "6",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("process 0 of 1: mesh data=2 x model=4: 2 query heads and 1 KV heads per device")
    printed = [eval(line) for line in out[1:]]
    model = kvjax.load_model(tiny_path)
    prompts = [[1 + (ord(c) % 127) for c in f"Count from {i} to {i + 5}:"] for i in range(2)]
    ref = kvjax.generate(model, prompts, kvjax.methods.get("snapkv", budget=0.5), 6, stop_at_eos=False).tokens
    assert printed == ref and len(np.unique(ref)) > 1


@pytest.mark.parametrize(
    "mesh,message",
    [
        ("data=1,tensor=8", "mesh axis 'tensor' is unknown"),
        ("data=1,model=3", "'model' has size 3 but the model has 8 attention heads"),
        ("data=4,model=4", "needs 16 devices but 8 exist"),
    ],
)
def test_generate_cli_bad_mesh_is_a_clean_error(tiny_path, capsys, mesh, message):
    code = cli.main(["generate", "--model", str(tiny_path), "--mesh", mesh, "--prompt", "hi", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
