"""LESS training with the batch split over a mesh's ``data`` axis (8 host devices, tests/conftest.py) against the
same training on one device, the independent reference: the same kernels, losses and best epochs up to the
order of float sums; meshes training cannot use are clear errors."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import kvjax
from train_less import cli, trainer
from train_less.trainer import TrainConfig, train
from tiny_models import tiny_config

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py sets XLA_FLAGS)")
CFG = tiny_config(hidden_size=32, intermediate_size=48, head_dim=8, max_position_embeddings=4096)
TC = TrainConfig(budget=6, rank=4, hidden=16, epochs=2, batch=4, seq_len=32, num_seqs=11, val_frac=0.3, lr=1e-2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The model, the data and the reference: the same training on one device."""
    params = kvjax.model.random_params(CFG, jax.random.PRNGKey(0), scale=0.3)
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (11, 32))
    out = tmp_path_factory.mktemp("one-device")
    return params, tokens, out, train(CFG, params, tokens, TC, out, "tiny", progress=False)


@pytest.mark.parametrize("mesh", ["data=2", pytest.param("data=4", marks=pytest.mark.slow)])
def test_data_parallel_training_equals_one_device(setup, tmp_path, monkeypatch, mesh):
    params, tokens, one_dir, one = setup
    seen = []
    step = trainer._train_step

    def spy(cfg, tc, steps, lp, kp, opt, x, packed, keys):
        seen.append((x.sharding.spec, packed.sharding.spec, len(x.sharding.device_set)))
        return step(cfg, tc, steps, lp, kp, opt, x, packed, keys)

    monkeypatch.setattr(trainer, "_train_step", spy)
    dp = train(CFG, params, tokens, TC, tmp_path / "mesh", "tiny", progress=False, mesh=mesh)
    n = int(mesh.split("=")[1])
    assert seen and all(s[:2] == (P(None, "data"), P(None, "data")) and s[2] == n for s in seen)
    for key in ("train_loss", "val_loss", "val_loss_sparse", "val_loss_baseline_plus"):
        np.testing.assert_allclose([h[key] for h in dp["history"]], [h[key] for h in one["history"]], rtol=1e-4)
    assert dp["best_epoch"] == one["best_epoch"]
    with np.load(one_dir / "kernels.npz") as a, np.load(tmp_path / "mesh" / "kernels.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        for name in a.files:
            np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_meshes_training_cannot_use_are_errors(setup, tmp_path, capsys):
    params, tokens, _, _ = setup
    with pytest.raises(ValueError, match=r"--batch 4 is not a multiple of the mesh's 'data' size 8"):
        train(CFG, params, tokens, TC, tmp_path / "a", "tiny", progress=False, mesh="data=8")
    with pytest.raises(ValueError, match="mesh axis 'model' has size 2"):
        train(
            CFG,
            params,
            tokens,
            dataclasses.replace(TC, batch=2),
            tmp_path / "b",
            "tiny",
            progress=False,
            mesh="data=2,model=2",
        )
    for argv, message in (
        (["--batch", "3", "--mesh", "data=2"], "--batch 3 is not a multiple"),
        (["--mesh", "tensor=2"], "mesh axis 'tensor' is unknown"),
        (["--mesh", "data=16"], "needs 16 devices but 8 exist"),
    ):
        assert cli.main(["--out", str(tmp_path / "c"), *argv]) == 2  # refused before the model is loaded
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
