"""LESS training at scale: query-chunked attention and loss (value and gradient) against the unchunked path; the
paper's parallel H2O mask against a NumPy transcription of its formula; the on-disk capture (shards, bounded
size, resumable) against the model's own activations and masks; layer-subset runs merged into one folder equal
to one run over all layers; mid-epoch resume and a corrupt newest checkpoint against an uninterrupted run; a
SIGKILLed ``kvjax-train-less`` resumed to the uninterrupted kernels; kernels used with other settings warn."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import model as M
from kvjax.methods import less as L
from kvjax.methods.base import Capacity
from train_less import capture as C
from train_less import trainer
from train_less.trainer import TrainConfig, merge_parts, train
from tiny_models import tiny_config

CFG = tiny_config(hidden_size=32, intermediate_size=48, head_dim=8, max_position_embeddings=4096)
TC = TrainConfig(
    budget=6, rank=4, hidden=16, epochs=2, batch=2, seq_len=32, num_seqs=10, val_frac=0.2, lr=1e-2, query_chunk=8
)
ROOT = Path(__file__).resolve().parents[2]


def rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def setup():
    params = kvjax.model.random_params(CFG, jax.random.PRNGKey(0), scale=0.3)
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (10, 32))
    return params, tokens


@pytest.fixture(scope="module")
def full_run(setup, tmp_path_factory):
    params, tokens = setup
    out = tmp_path_factory.mktemp("full")
    return out, train(CFG, params, tokens, TC, out, "tiny", progress=False)


def _kernels(folder):
    with np.load(Path(folder) / L.KERNELS_FILE) as f:
        return {k: f[k] for k in f.files}


# -- chunked attention and loss -----------------------------------------------------------------------------------
def test_chunked_attention_and_gradient_equal_unchunked():
    s, chunk = 37, 8  # 5 blocks, the last one padded
    q, k, v = (
        jnp.asarray(rand((2, 4, s, 8), 1)),
        jnp.asarray(rand((2, 2, s, 8), 2)),
        jnp.asarray(rand((2, 2, s, 8), 3)),
    )
    phq, psk = jnp.abs(jnp.asarray(rand((2, 4, s, 3), 4))), jnp.abs(jnp.asarray(rand((2, 2, s, 3), 5)))
    evict = L.h2o_evictions(q, k, 7, 3)
    mask = L.mask_from_evictions(evict)  # the unchunked path on the bool mask: the reference
    ref = L.parallel_attention(q, k, v, mask, phq, psk)
    np.testing.assert_allclose(L.parallel_attention(q, k, v, evict, phq, psk, chunk=chunk), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(L.parallel_attention(q, k, v, mask, phq, psk, chunk=chunk), ref, rtol=1e-5, atol=1e-6)
    w = jnp.asarray(rand((2, 4, s, 8), 6))
    loss = lambda m, c: lambda a, b: jnp.sum(w * L.parallel_attention(q, k, v, m, a, b, chunk=c))
    g_ref = jax.grad(loss(mask, None), argnums=(0, 1))(phq, psk)
    g = jax.jit(jax.grad(loss(evict, chunk), argnums=(0, 1)))(phq, psk)
    for a, b in zip(g, g_ref):
        assert float(jnp.abs(b).max()) > 0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_chunked_training_loss_and_gradient_equal_unchunked(setup):
    params, tokens = setup
    lp = jax.tree.map(lambda a: a[0], C.stack_layers(params))
    x = M.embed(params, jnp.asarray(tokens[:2]))
    q, k, _ = M.layer_qkv(CFG, lp, x, jnp.broadcast_to(jnp.arange(32), (2, 32)))
    evict = TC.less.eviction_times(q, k)
    kp = L.init_kernels(CFG, jax.random.PRNGKey(1), TC.rank, TC.hidden)
    kp = {**kp, "k_s1": kp["k_s1"] * 0 + 0.3, "k_s2": kp["k_s2"] * 0 + 0.3}
    key = jax.random.PRNGKey(2)

    def loss(tc):
        return jax.jit(jax.value_and_grad(lambda p: trainer._layer_losses(CFG, tc, lp, p, x, (evict,), key, True)))

    (a, ga), (b, gb) = loss(TC)(kp), loss(TrainConfig(**{**TC.__dict__, "query_chunk": None}))(kp)
    np.testing.assert_allclose(a, b, rtol=1e-5)
    for name in gb:
        # atol: float32 rounding of the gradient's largest terms (a reduction order changed by the chunking or by
        # XLA's code generation moves an entry near 0 by ~1e-9, measured)
        np.testing.assert_allclose(ga[name], gb[name], rtol=1e-4, atol=1e-6 * float(np.abs(gb[name]).max()))


# -- the paper's parallel H2O mask --------------------------------------------------------------------------------
def paper_mask_np(q, k, budget, recent):
    """Method note §2.7.1 (the authors' ``local_heavy_hitter_mask_nonoverlap``), float64, literally: full
    probabilities P (mean over the KV group), rows < h + r causal, then row i = top-h of acc[0 : i - r] plus
    the band i - r .. i, and acc = (acc + P[i]) * mask[i]."""
    hq, s, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    h = budget - recent
    out = np.zeros((hkv, s, s), bool)
    tril = np.tril(np.ones((s, s), bool))
    for kv in range(hkv):
        sc = np.einsum("gid,jd->gij", q[kv * g : (kv + 1) * g].astype(np.float64), k[kv]) / math.sqrt(d)
        sc = np.where(tril, sc, -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p = (p / p.sum(-1, keepdims=True)).mean(0)
        mask = tril.copy()
        acc = p[:budget].sum(0)
        for i in range(budget, s):
            mask[i] = False
            if h:
                mask[i, np.argsort(-acc[: i - recent], kind="stable")[:h]] = True
            mask[i, i - recent : i + 1] = True
            acc = (acc + p[i]) * mask[i]
        out[kv] = mask
    return out


@pytest.mark.parametrize("budget,recent", [(8, 4), (8, 3), (6, 6)])
def test_paper_h2o_mask_matches_numpy_formula(budget, recent):
    s = 30
    for seed in range(2):
        q, k = rand((2, 4, s, 8), 10 + seed), rand((2, 2, s, 8), 20 + seed)
        got = np.asarray(L.mask_from_evictions(L.h2o_paper_evictions(jnp.asarray(q), jnp.asarray(k), budget, recent)))
        for b in range(2):
            np.testing.assert_array_equal(got[b], paper_mask_np(q[b], k[b], budget, recent))
        assert (got.sum(-1) == np.minimum(np.arange(s) + 1, budget + 1)).all()
    m = L.Less(budget=8, recent=4)
    paper = np.asarray(m.parallel_mask(jnp.asarray(q), jnp.asarray(k), mask="paper"))
    np.testing.assert_array_equal(paper[0], paper_mask_np(q[0], k[0], 8, 4))
    with pytest.raises(ValueError, match="mask='tova'"):
        m.eviction_times(jnp.asarray(q), jnp.asarray(k), mask="tova")


# -- capture to disk ----------------------------------------------------------------------------------------------
def test_capture_shards_equal_the_models_activations_and_resume(setup, tmp_path):
    params, tokens = setup
    pols = (TC.less, TC.baseline_plus)
    per_seq = C.seq_bytes(CFG, 1, 32, "float32")
    store = C.capture(
        CFG, params, tokens, pols, tmp_path / "cap", layers=[1], batch=2, shard_mb=3.5 * per_seq / 2**20, progress=False
    )
    shards = sorted((tmp_path / "cap").glob("x-*.npy"))
    assert store.per_shard == 3 and len(shards) == 4  # 10 sequences, 3 per shard
    assert all(p.stat().st_size <= 3.5 * per_seq for p in shards)
    # the reference: the layer's input and its policies' masks, from an ordinary forward pass
    pos = jnp.broadcast_to(jnp.arange(32), (10, 32))
    rec = {}

    def attend(layer, x, q, k, v, carry):
        rec[layer] = (x, [p.parallel_mask(q, k) for p in pols])
        return M.causal_attention(q, k, v), carry

    M.run_layers(CFG, params, M.embed(params, jnp.asarray(tokens)), pos, attend)
    idx = [7, 0, 4]
    x, ev = store.read(idx)
    assert x.shape == (3, 1, 32, 32) and ev.shape == (3, 1, 2, 2, 32)
    np.testing.assert_allclose(x[:, 0], np.asarray(rec[1][0])[idx], rtol=1e-5, atol=1e-4)  # jit vs eager rounding
    for p in range(2):
        np.testing.assert_array_equal(np.asarray(L.mask_from_evictions(ev[:, 0, p])), np.asarray(rec[1][1][p])[idx])
    # a killed capture resumes at the missing shard; the others are kept as they are
    before = {p.name: p.stat().st_mtime_ns for p in shards}
    (tmp_path / "cap" / "evict-00002.npy").unlink()
    again = C.capture(
        CFG, params, tokens, pols, tmp_path / "cap", layers=[1], batch=2, shard_mb=3.5 * per_seq / 2**20, progress=False
    )
    after = {p.name: p.stat().st_mtime_ns for p in sorted((tmp_path / "cap").glob("x-*.npy"))}
    assert [n for n in before if before[n] != after[n]] == ["x-00002.npy"]
    np.testing.assert_array_equal(again.read(range(10))[1], store.read(range(10))[1])
    with pytest.raises(ValueError, match="shard_mb"):
        C.capture(CFG, params, tokens, pols, tmp_path / "c2", shard_mb=0, progress=False)


# -- layer subsets -------------------------------------------------------------------------------------------------
@pytest.mark.extended  # CI's second line (.ci/run); not the default run, for time (docs/testing.md)
def test_layer_runs_merge_into_one_folder_equal_to_all_layers(setup, full_run, tmp_path):
    params, tokens = setup
    full_dir, full = full_run
    out = tmp_path / "k"
    one = train(CFG, params, tokens, TC, out, "tiny", progress=False, layers="1", shard_mb=0.01)
    assert one["layers_trained"] == [1] and one["val_loss"][0] is None
    merged = json.loads((out / L.CONFIG_FILE).read_text())
    assert merged["layers_trained"] == [1]
    m = L.Less(budget=6, kernels=str(out))
    m.init(CFG, 1, Capacity(16, 4), 1, jnp.float32)
    with pytest.raises(ValueError, match="no trained kernels for layer 0"):
        m.init(CFG, 1, Capacity(16, 4), 0, jnp.float32)
    with pytest.raises(ValueError, match="layer 0 .*one --layers run; use its parent"):
        L.Less(budget=6, kernels=str(out / "layers-1")).init(CFG, 1, Capacity(16, 4), 0, jnp.float32)
    train(CFG, params, tokens, TC, out, "tiny", progress=False, layers=[0])
    merged = json.loads((out / L.CONFIG_FILE).read_text())
    assert merged["layers_trained"] == [0, 1] and set(merged["parts"]) == {"layers-0", "layers-1"}
    a, b = _kernels(out), _kernels(full_dir)
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=1e-5)  # vmap over 1 vs 2 layers: rounding
    np.testing.assert_allclose(merged["val_loss"], full["val_loss"], rtol=1e-4)
    assert not (out / "layers-0" / "capture").exists()  # removed when training ends
    L.Less(budget=6, kernels=str(out)).init(CFG, 1, Capacity(16, 4), 0, jnp.float32)
    # parts of other settings are refused by name
    train(
        CFG,
        params,
        tokens,
        TrainConfig(**{**TC.__dict__, "epochs": 1, "rank": 2}),
        tmp_path / "r2",
        "tiny",
        progress=False,
        layers="0",
    )
    os.rename(tmp_path / "r2" / "layers-0", out / "layers-0-x")
    with pytest.raises(ValueError, match="layers-0-x"):
        merge_parts(out)
    with pytest.raises(ValueError, match="layers='9'"):
        train(CFG, params, tokens, TC, tmp_path / "bad", "tiny", progress=False, layers="9")


# -- resume -------------------------------------------------------------------------------------------------------
def test_mid_epoch_resume_and_corrupt_checkpoint_equal_uninterrupted(setup, full_run, tmp_path):
    params, tokens = setup
    full_dir, full = full_run
    out = tmp_path / "r"
    train(CFG, params, tokens, TC, out, "tiny", progress=False, checkpoint_every=1, stop_after_steps=7)
    ckpts = out / "checkpoints"
    assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [6, 7]  # max_to_keep=2, mid-epoch
    for f in (ckpts / "7" / "state").rglob("*"):  # corrupt the newest one's arrays
        if f.is_file():
            f.write_bytes(b"\x00garbage" * 3)
    with pytest.warns(UserWarning, match=r"checkpoints/7 is unreadable.*checkpoints/6"):
        resumed = train(CFG, params, tokens, TC, out, "tiny", resume=True, progress=False, checkpoint_every=1)
    assert (out / "checkpoints-corrupt" / "7").is_dir()
    a, b = _kernels(out), _kernels(full_dir)
    for name in b:
        np.testing.assert_array_equal(a[name], b[name])
    assert resumed["history"] == full["history"]
    # nothing readable: a clear error naming the checkpoints
    for f in ckpts.rglob("*"):
        if f.is_file():
            f.write_bytes(b"x")
    with pytest.raises(ValueError, match="no readable checkpoint in .*checkpoints"):
        train(CFG, params, tokens, TC, out, "tiny", resume=True, progress=False)


def _tiny_hf_folder(path: Path):
    """A tiny random Llama with a character-level tokenizer, saved as a Hugging Face folder."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    chars = sorted(set("abcdefghijklmnopqrstuvwxyz .,\n"))
    vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    (path.parent / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)


def _cli(out, model, extra=()):
    return [
        sys.executable,
        "-m",
        "train_less.cli",
        "--out",
        str(out),
        "--model",
        str(model),
        "--data",
        str(model.parent / "text.txt"),
        "--seq-len",
        "32",
        "--num-seqs",
        "12",
        "--budget",
        "6",
        "--rank",
        "4",
        "--hidden",
        "16",
        "--epochs",
        "3",
        "--batch",
        "2",
        "--lr",
        "1e-2",
        "--query-chunk",
        "8",
        "--checkpoint-every",
        "1",
        "--no-progress",
        *extra,
    ]


@pytest.mark.slow  # 50-85 s of three training subprocesses: CI runs it on its slow line (.ci/run)
def test_sigkill_mid_epoch_then_resume_equals_uninterrupted(tmp_path):
    model = tmp_path / "tiny"
    _tiny_hf_folder(model)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    subprocess.run(_cli(tmp_path / "a", model), env=env, check=True, capture_output=True, cwd=ROOT)
    proc = subprocess.Popen(
        _cli(tmp_path / "b", model), env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    ckpts = tmp_path / "b" / "checkpoints"
    deadline = time.time() + 300
    while not (ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())) and time.time() < deadline:
        assert proc.poll() is None, "the run ended before its first checkpoint"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed_at = max(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    assert killed_at < 15  # 5 steps per epoch x 3 epochs: killed mid-run
    res = subprocess.run(_cli(tmp_path / "b", model, ["--resume"]), env=env, capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    a, b = _kernels(tmp_path / "a"), _kernels(tmp_path / "b")
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    ha = json.loads((tmp_path / "a" / L.CONFIG_FILE).read_text())["history"]
    assert ha == json.loads((tmp_path / "b" / L.CONFIG_FILE).read_text())["history"]


# -- kernels used with other settings ----------------------------------------------------------------------------
def test_kernels_with_other_settings_warn_or_raise(full_run):
    folder = str(full_run[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        L.Less(budget=6, kernels=folder)  # the trained settings (h2o, 6 tokens, recent 0.5): silent
        L.Less(budget=6, recent=3, kernels=folder)  # the same recent window in tokens
        L.Less(budget=0.18, kernels=folder)  # a fraction giving the trained 6 tokens of seq_len=32: ceil(5.76)
    with pytest.warns(UserWarning, match="budget: trained 6, requested 8. LESS") as rec:
        L.Less(budget=8, kernels=folder)  # the same recent fraction: only the budget is named
    assert len(rec) == 1
    with pytest.warns(UserWarning, match="budget: trained 6, requested 8; recent: trained 0.5, requested 2"):
        L.Less(budget=8, recent=2, kernels=folder)
    with pytest.warns(UserWarning, match=r"recent: trained 0.5 \(3 tokens\), requested 2 \(2 tokens\)"):
        L.Less(budget=6, recent=2, kernels=folder)
    with pytest.warns(UserWarning, match="policy: trained 'h2o', requested 'lambda'"):
        L.Less(policy="lambda", budget=6, kernels=folder)
    with pytest.warns(UserWarning, match="budget: trained 6 tokens of 32-token sequences, requested 0.2"):
        L.Less(kernels=folder)
    with pytest.raises(ValueError, match="budget: trained 6, requested 8.*strict=True"):
        L.Less(budget=8, kernels=folder, strict=True)


def test_default_training_budget_is_the_default_less_budget():
    """kvjax-train-less's default budget is ``ceil(0.2 seq_len)``, LESS's default fraction of the training length,
    so kernels trained at the defaults are used at ``Less``'s default budget without a warning (the settings as
    TrainConfig writes them to less_config.json); on another length the fraction would mean other tokens."""
    for seq_len in (32, 512, 4096):
        tc = TrainConfig(seq_len=seq_len)
        assert tc.budget_tokens == math.ceil(0.2 * seq_len) and L.Less().budget == 0.2
        trained = {"policy": "h2o", "budget": tc.budget_tokens, "recent": tc.recent, "sinks": tc.sinks}
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            L.Less()._check_trained(trained, seq_len)
        with pytest.warns(
            UserWarning,
            match=f"budget: trained {tc.budget_tokens} tokens of {seq_len * 2 + 7}-token sequences, requested 0.2",
        ):
            L.Less()._check_trained(trained, seq_len * 2 + 7)


def test_cli_scale_options_and_errors(tmp_path, capsys):
    from train_less import cli

    a = cli.build_parser().parse_args(
        [
            "--out",
            "x",
            "--layers",
            "0-7",
            "--mask",
            "paper",
            "--shard-mb",
            "512",
            "--checkpoint-every",
            "50",
            "--capture-batch",
            "1",
            "--query-chunk",
            "0",
        ]
    )
    assert (a.layers, a.mask, a.shard_mb, a.checkpoint_every, a.capture_batch, a.query_chunk) == (
        "0-7",
        "paper",
        512,
        50,
        1,
        0,
    )
    for bad, what in (
        (["--capture-batch", "0"], "--capture-batch 0"),
        (["--shard-mb", "0"], "--shard-mb 0"),
        (["--checkpoint-every", "0"], "--checkpoint-every 0"),
        (["--query-chunk", "-1"], "--query-chunk"),
    ):
        assert cli.main(["--out", str(tmp_path / "o"), *bad]) == 2
        assert what in capsys.readouterr().err
    assert cli.main(["--out", str(tmp_path / "none"), "--merge"]) == 2
    assert "no layers-*/ folders" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--out", "x", "--mask", "tova"])
