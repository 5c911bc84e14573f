"""Model parity with transformers (PyTorch) on tiny random checkpoints built here, and on the embedded GGUF."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.loading import assets
from kvjax.model import forward

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=64)
CASES = {
    "llama-mha-tied": (
        "LlamaForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    ),
    "llama-gqa-headdim-llama3rope": (
        "LlamaForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "llama-mqa-bias-linear": (
        "LlamaForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            attention_bias=True,
            mlp_bias=True,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
    "mistral-window": ("MistralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=8)),
    "qwen2-gqa": ("Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
}


def build(arch, options, path, dtype=torch.float32, shard=None):
    torch.manual_seed(0)
    cls = getattr(transformers, arch)
    cfg = cls.config_class(**BASE, **options)
    model = cls(cfg).eval()
    with torch.no_grad():  # HF inits biases to 0 and norms to 1: randomise them so they are checked
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    model = model.to(dtype)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    arch, options = CASES[case]
    hf = build(arch, options, tmp_path)
    model = kvjax.load_model(tmp_path, dtype=jnp.float32)
    ids = np.random.RandomState(1).randint(0, 128, size=(2, 20))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    out = np.asarray(jax.jit(forward, static_argnums=0)(model.config, model.params, jnp.asarray(ids)))
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=0)
    # Greedy continuation (naive re-forward) equals transformers' generate.
    seq = list(ids[0, :8])
    want = hf.generate(torch.tensor([seq]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)[
        0, 8:
    ].tolist()
    for _ in range(6):
        seq.append(int(np.argmax(np.asarray(forward(model.config, model.params, jnp.asarray([seq])))[0, -1])))
    assert seq[8:] == want


def test_padding_and_sharded_and_bf16(tmp_path):
    arch, options = CASES["llama-gqa-headdim-llama3rope"]
    hf = build(arch, options, tmp_path / "sharded", shard="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) >= 3
    model = kvjax.load_model(tmp_path / "sharded", dtype=jnp.float32)
    ids = np.random.RandomState(2).randint(0, 128, size=(2, 16))
    out = np.asarray(forward(model.config, model.params, jnp.asarray(ids), lengths=jnp.asarray([16, 9])))
    with torch.no_grad():
        full = hf(torch.tensor(ids[:1])).logits.numpy()[0]
        short = hf(torch.tensor(ids[1:, :9])).logits.numpy()[0]
    np.testing.assert_allclose(out[0], full, atol=1e-4)
    np.testing.assert_allclose(out[1, :9], short, atol=1e-4)

    hf16 = build(arch, options, tmp_path / "bf16", dtype=torch.bfloat16)
    m16 = kvjax.load_model(tmp_path / "bf16", dtype=jnp.bfloat16)
    assert m16.params["layers"][0]["wq"].dtype == jnp.bfloat16
    m32 = kvjax.load_model(tmp_path / "bf16", dtype=jnp.float32)
    with torch.no_grad():
        ref = hf16.float()(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(forward(m32.config, m32.params, jnp.asarray(ids))), ref, atol=1e-4)
    out16 = np.asarray(forward(m16.config, m16.params, jnp.asarray(ids)))
    assert np.mean(out16.argmax(-1) == ref.argmax(-1)) > 0.9


def test_transformers4_key_spelling():
    v5 = {
        **BASE,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "dtype": "bfloat16",
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    }
    v4 = {k: v for k, v in v5.items() if k not in ("dtype", "rope_parameters")}
    v4.update(
        torch_dtype="bfloat16",
        rope_theta=5e5,
        rope_scaling={
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    assert kvjax.ModelConfig.from_hf(v4) == kvjax.ModelConfig.from_hf(v5)


@pytest.fixture(scope="module")
def smollm2():
    path = assets.smollm2_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    return kvjax.load_model("smollm2-135m-instruct", dtype=jnp.float32), hf, tok


def test_embedded_smollm2_matches_transformers_gguf(smollm2):
    model, hf, tok = smollm2
    ids = tok(assets.essay("addiction"), add_special_tokens=False).input_ids[:300]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits.numpy()
    out = np.asarray(jax.jit(forward, static_argnums=0)(model.config, model.params, jnp.asarray([ids])))
    assert np.abs(out - ref).max() < 1e-3


def test_embedded_tokenizer_matches_transformers(smollm2):
    model, _, tok = smollm2
    for name in assets.essay_names():
        text = assets.essay(name)
        assert model.tokenizer.encode(text) == tok(text, add_special_tokens=False).input_ids, name
        assert model.tokenizer.decode(model.tokenizer.encode(text)) == text
    tricky = "Digits 1234567 and 3.14, emoji 🙂, ünïcödé,   spaces\n\n\ttabs <|im_start|>user<|im_end|>"
    assert model.tokenizer.encode(tricky) == tok(tricky, add_special_tokens=False).input_ids
    for msgs in (
        [{"role": "user", "content": "Hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ],
    ):
        want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert model.tokenizer.apply_chat_template(msgs) == want
        assert model.tokenizer.encode_chat(msgs) == tok(want, add_special_tokens=False).input_ids
    assert 2 in model.tokenizer.eos_token_ids and model.tokenizer.bos_token_id == tok.bos_token_id


def test_embedded_model_answers(smollm2):
    from kvjax import engine

    model = smollm2[0]
    out = engine.generate(model, ["What is the capital of France?"], "full", max_new_tokens=12, chat=True)
    assert "Paris" in out.text[0]


def _write_gguf(path, arch, tokenizer_model="gpt2"):
    import gguf

    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list(["a", "b", "c"])
    w.add_tensor("token_embd.weight", np.zeros((3, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_bad_input(tmp_path):
    from kvjax.loading.gguf_loader import config_from_gguf, open_gguf
    from kvjax.loading.tokenizer import GGUFTokenizer

    with pytest.raises(FileNotFoundError, match="neither"):
        kvjax.load_model(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(
        json.dumps({**BASE, "model_type": "llama", "num_attention_heads": 4})
    )
    with pytest.raises(FileNotFoundError, match="safetensors"):
        kvjax.load_model(tmp_path / "empty")
    build(*CASES["qwen2-gqa"], tmp_path / "sh", shard="40KB")
    shard = sorted((tmp_path / "sh").glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        kvjax.load_model(tmp_path / "sh")
    with pytest.raises(ValueError, match="gemma"):
        kvjax.ModelConfig.from_hf({**BASE, "model_type": "gemma", "num_attention_heads": 4})
    with pytest.raises(ValueError, match="longrope"):
        kvjax.ModelConfig.from_hf(
            {
                **BASE,
                "model_type": "llama",
                "num_attention_heads": 4,
                "rope_scaling": {"rope_type": "longrope", "factor": 4.0},
            }
        )
    _write_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ValueError, match="gpt2"):
        config_from_gguf(open_gguf(tmp_path / "gpt2.gguf"))
    _write_gguf(tmp_path / "wordpiece.gguf", "llama", tokenizer_model="bert")
    with pytest.raises(ValueError, match="'bert' is not supported: kvjax builds 'gpt2' .* and 'llama'"):
        GGUFTokenizer.from_gguf(tmp_path / "wordpiece.gguf")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        open_gguf(tmp_path / "nope.gguf")


def test_missing_and_extra_tensors(tmp_path):
    from safetensors.numpy import load_file, save_file

    build(*CASES["qwen2-gqa"], tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file(
        {**tensors, "model.layers.0.self_attn.q_norm.weight": np.ones(16, np.float32)}, tmp_path / "model.safetensors"
    )
    with pytest.raises(ValueError, match="does not use"):
        kvjax.load_model(tmp_path)
    save_file({k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks"):
        kvjax.load_model(tmp_path)
