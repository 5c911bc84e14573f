"""kvjax.loading.tokenizer against transformers, the independent reference.

The GGUF tokenizer is compared with transformers' own GGUF tokenizer (``AutoTokenizer`` with ``gguf_file``)
on the embedded SmolLM2 file and on tiny GGUF files written here; ``HFTokenizer`` with ``AutoTokenizer`` on
a tokenizer folder saved here (no network).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvjax
from kvjax.loading import assets
from kvjax.loading.tokenizer import GGUFTokenizer, HFTokenizer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: E402

TRICKY = [
    "",
    "Digits 1234567 and 3.14, 1,000,000 and 0x1F; dates 2024-05-01.",
    "ünïcödé, naïve café, Ελληνικά, русский, 中文字符, 日本語のテキスト, 한국어",
    "emoji 🙂👍🏽🇫🇷 and a ZWJ family 👨‍👩‍👧‍👦",
    "   leading spaces, \t tabs,\ttrailing   ",
    "newlines\n\n\nand\r\nCRLF\n \n",
    "chat tokens inside text: <|im_start|>user\nHi<|im_end|>\n<|endoftext|> and <repo_name>",
    "half a token <|im_start and im_end|> and <|im_end|><|im_end|>",
    "contractions: don't, I'M, we've, they'll, it'S",
    "code: def f(x):\n    return x**2  # square\n",
]

CHATS = {
    "user": [{"role": "user", "content": "What is the capital of France?"}],
    "system+user": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "multi-turn": [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "2 + 2 = ? 🙂"},
    ],
}


@pytest.fixture(scope="module")
def ours():
    return GGUFTokenizer.from_gguf(assets.smollm2_gguf_path())


@pytest.fixture(scope="module")
def ref():
    path = assets.smollm2_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _ref_ids(tok, text, add_special_tokens=False):
    return tok(text, add_special_tokens=add_special_tokens).input_ids


def test_essays_match_transformers(ours, ref):
    names = assets.essay_names()
    assert len(names) == 49
    for name in names:
        text = assets.essay(name)
        ids = ours.encode(text)
        assert ids == _ref_ids(ref, text), name
        assert ours.decode(ids) == text, name
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), name


def test_bible_book_matches_transformers(ours, ref):
    text = assets.bible_text("Genesis")
    ids = ours.encode(text)
    assert len(ids) > 40_000
    assert ids == _ref_ids(ref, text)
    assert ours.decode(np.asarray(ids)) == text  # any 1-D int sequence decodes


@pytest.mark.parametrize("text", TRICKY)
def test_tricky_strings_match_transformers(ours, ref, text):
    ids = ours.encode(text)
    assert ids == _ref_ids(ref, text)
    assert ours.encode(text, add_special_tokens=True) == _ref_ids(ref, text, add_special_tokens=True)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_are_whole_and_skipped(ours):
    assert ours.encode("<|im_start|><|im_end|>") == [1, 2]
    assert ours.decode([1, 2, 3, 0]) == ""
    assert ours.decode([1, 2], skip_special_tokens=False) == "<|im_start|><|im_end|>"


@pytest.mark.parametrize("name", list(CHATS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, ref, name, add_generation_prompt):
    msgs = CHATS[name]
    want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt) == want
    want_ids = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=add_generation_prompt)["input_ids"]
    assert ours.encode_chat(msgs, add_generation_prompt=add_generation_prompt) == list(want_ids)


def test_special_ids_match_transformers(ours, ref):
    assert 2 in ours.eos_token_ids and ref.convert_ids_to_tokens(2) == "<|im_end|>"
    assert ref.eos_token_id in ours.eos_token_ids
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.pad_token_id == ref.pad_token_id
    assert ours.vocab_size == len(ref) == 49152
    assert ours.chat_template == ref.chat_template


def test_gguf_tokenizer_needs_neither_torch_nor_transformers():
    code = (
        "import sys; from kvjax.loading import assets; from kvjax.loading.tokenizer import GGUFTokenizer; "
        "t = GGUFTokenizer.from_gguf(assets.smollm2_gguf_path()); assert t.encode('hi'); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    root = str(Path(kvjax.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- tiny GGUF files written here --------------------------------------------------------------------------

_ALPHABET = list(bytes_to_unicode().values())  # GPT-2's byte alphabet: every byte is a token
_MERGES = ["Ġ 1", "1 2", "12 3", "123 4", "Ġ t", "Ġt h", "Ġth e", "' s", "' S"]
_MERGED = ["Ġ1", "12", "123", "1234", "Ġt", "Ġth", "Ġthe", "'s", "'S"]
_TINY_TOKENS = ["<s>", "</s>", "<think>", *_ALPHABET, *_MERGED]
_TINY_TYPES = [3, 3, 4] + [1] * (len(_ALPHABET) + len(_MERGED))
_TINY_TEXT = "12345 1234 the's THE'S <think>x</s> the\n\n a  b"


def _write_gguf(path, model="gpt2", pre=None, chat_template=None):
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    tokens, types = (_TINY_TOKENS, _TINY_TYPES) if model == "gpt2" else (["<unk>", "▁a", "▁b"], [2, 1, 1])
    w.add_token_list(tokens)
    w.add_token_types(types)
    if model == "gpt2":
        w.add_token_merges(_MERGES)
    else:
        w.add_token_scores([0.0, -1.0, -2.0])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("pre", [None, "smollm", "llama-bpe", "qwen2"])
def test_tiny_gguf_matches_transformers(tmp_path, pre):
    path = _write_gguf(tmp_path / "tiny.gguf", pre=pre)
    tok = GGUFTokenizer.from_gguf(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert tok.encode(_TINY_TEXT) == _ref_ids(ref, _TINY_TEXT)
    assert tok.encode(_TINY_TEXT, add_special_tokens=True) == _ref_ids(ref, _TINY_TEXT, True)  # add_bos_token
    assert tok.encode(_TINY_TEXT, add_special_tokens=True)[0] == 0
    ids = tok.encode(_TINY_TEXT)
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True) == _TINY_TEXT.replace("</s>", "")
    # No padding id in the file: pad falls back to eos. transformers appends GPT2Tokenizer's default
    # "<|endoftext|>" when the vocabulary lacks it (one id past the model's embeddings); we add nothing.
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (0, (1,), 1)
    assert tok.vocab_size == len(_TINY_TOKENS) == len(ref) - ("<|endoftext|>" not in _TINY_TOKENS)


def test_tiny_gguf_split_regex_follows_pre(tmp_path):
    """The splits differ on digits and upper-case contractions: GPT-2 vs Llama 3 vs Qwen2."""
    encodings = {
        pre: tuple(GGUFTokenizer.from_gguf(_write_gguf(tmp_path / f"{pre}.gguf", pre=pre)).encode(" 12345 IT'S"))
        for pre in ("smollm", "llama-bpe", "qwen2")
    }
    assert len(set(encodings.values())) == 3, encodings


def test_tiny_gguf_chat_template(tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system role') }}{% endif %}"
        "[{{ m['role'] }}]{{ m['content'] | tojson }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    path = _write_gguf(tmp_path / "chat.gguf", chat_template=template)
    tok = GGUFTokenizer.from_gguf(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    msgs = [{"role": "user", "content": 'né <b>"q"</b>'}]
    want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(msgs) == want == '<s>[user]"né <b>\\"q\\"</b>"</s>\n[assistant]'
    assert tok.encode_chat(msgs)[:1] == [0]
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="no system role"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_bad_input(tmp_path):
    unigram = _write_gguf(tmp_path / "t5.gguf", model="t5")
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model='t5'.*'gpt2' \(byte-level BPE\) and 'llama'"):
        GGUFTokenizer.from_gguf(unigram)
    with pytest.raises(ValueError, match="'t5'"):
        GGUFTokenizer.from_gguf(gguf.GGUFReader(str(unigram)))
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        GGUFTokenizer.from_gguf(missing)
    no_chat = GGUFTokenizer.from_gguf(_write_gguf(tmp_path / "plain.gguf"))
    assert no_chat.chat_template is None
    with pytest.raises(ValueError, match="chat"):
        no_chat.apply_chat_template([{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="chat"):
        no_chat.encode_chat([{"role": "user", "content": "Hi"}])


# --- SentencePiece ('llama') GGUF files -----------------------------------------------------------------------

# A tiny SentencePiece vocabulary as llama.cpp writes one: special tokens (CONTROL, UNKNOWN, USER_DEFINED), the 256
# byte-fallback tokens <0x00>..<0xFF> (BYTE), then pieces with U+2581 for a space and scores in merge order. Gemma
# files name their special tokens differently and store a token of spaces as spaces ("  ", "   ").
_SPM_SPECIAL = {
    "llama": [("<unk>", 2), ("<s>", 3), ("</s>", 3), ("<pad>", 3), ("<start_of_turn>", 3)],
    "gemma3": [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 3), ("<mask>", 3), ("<start_of_turn>", 3)],
}
_SPM_IDS = {"llama": dict(unk=0, bos=1, eos=2, pad=3), "gemma3": dict(pad=0, eos=1, bos=2, unk=3)}
_SPM_ADDED = [("<think>", 4), ("\n\n", 4)]
_SPM_PIECES = [
    *"▁theabcdoruniflx():*#,.'12340\n\té中文",
    *["th", "he", "▁t", "▁th", "▁the", "▁a", "▁b", "re", "ret", "retu", "return", "▁return", "de", "▁d", "▁de"],
    *["▁def", "12", "123", "▁1", "  ", "   ", "▁▁", "in", "▁in", "▁x", "on", "▁on", "er", "▁c", "ca", "caf", "café"],
    *["中文", "▁中文", "▁▁▁"],
]
_SPM_TEXTS = [
    *TRICKY,
    "the return of the café",
    " the",
    "  the  a b  ",
    "▁the ▁ and U+2581 written in text",
    "<s><bos>hi</s><eos> <start_of_turn>user<think>x<pad><unk><mask><start_of_turn",
    "\n\nthe\n\n\n",
    "<0x41> is not a byte token in text",
    "\x00 control \x7f bytes",
    "a<start_of_turn>b",
]


def _write_spm_gguf(path, arch="llama", add_bos=True):
    """A SentencePiece GGUF (``tokenizer.ggml.model='llama'``) of ``general.architecture=arch``; add_bos: the
    ``tokenizer.ggml.add_bos_token`` flag, or None for a file without it."""
    special = _SPM_SPECIAL["gemma3" if arch.startswith("gemma") else "llama"]
    head = [*special, *_SPM_ADDED, *((f"<0x{b:02X}>", 6) for b in range(256))]
    tokens = [t for t, _ in head] + _SPM_PIECES
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types([ty for _, ty in head] + [1] * len(_SPM_PIECES))
    w.add_token_scores([0.0] * len(head) + [-float(i) for i in range(len(_SPM_PIECES))])
    ids = _SPM_IDS["gemma3" if arch.startswith("gemma") else "llama"]
    w.add_bos_token_id(ids["bos"])
    w.add_eos_token_id(ids["eos"])
    w.add_unk_token_id(ids["unk"])
    w.add_pad_token_id(ids["pad"])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _assert_matches(ours, ref, texts):
    """encode with and without special tokens, decode with and without skipping them: equal to transformers'."""
    for text in texts:
        ids = ours.encode(text)
        assert ids == _ref_ids(ref, text), text
        with_bos = ours.encode(text, add_special_tokens=True)
        assert with_bos == _ref_ids(ref, text, add_special_tokens=True), text
        for skip in (True, False):
            assert ours.decode(with_bos, skip_special_tokens=skip) == ref.decode(with_bos, skip_special_tokens=skip)
    assert (ours.bos_token_id, ours.eos_token_ids[0], ours.pad_token_id) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
    )


# transformers builds the tokenizer by architecture: Gemma's (no prefix space, a space ends a piece, merges in file
# order) for gemma*, Phi-3's (the prefix space from a normalizer), Llama's (Metaspace) for any other
@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_sentencepiece_gguf_matches_transformers(tmp_path, arch):
    path = _write_spm_gguf(tmp_path / f"{arch}.gguf", arch)
    ours = GGUFTokenizer.from_gguf(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    _assert_matches(ours, ref, _SPM_TEXTS)
    assert ours.vocab_size == len(ref)  # Gemma: "  " and "▁▁" are one vocabulary entry, in both
    # byte fallback: a character outside the vocabulary is its UTF-8 bytes, each a <0xNN> token
    emoji = ours.encode("🙂")
    assert [ours.backend.id_to_token(i) for i in emoji[-4:]] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    assert ours.decode(emoji) == "🙂"
    # special tokens written in text are whole tokens, dropped by decode(skip_special_tokens=True)
    bos = ours.bos_token_id
    turn = ours.encode("<start_of_turn>")
    assert len(turn) == 1 and ours.encode("x" + ours.backend.id_to_token(bos))[-1] == bos
    assert ours.decode(ours.encode("x<start_of_turn>"), skip_special_tokens=True) == "x"


@pytest.mark.parametrize("add_bos", [None, False])
def test_sentencepiece_gguf_bos_flag(tmp_path, add_bos):
    """Without ``add_bos_token`` a SentencePiece file gets BOS (as llama.cpp and transformers add it); False: none."""
    path = _write_spm_gguf(tmp_path / "t.gguf", "llama", add_bos=add_bos)
    ours = GGUFTokenizer.from_gguf(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    _assert_matches(ours, ref, ["the café", ""])
    assert (ours.encode("the", add_special_tokens=True)[0] == 1) == (add_bos is None)


# --- HFTokenizer ---------------------------------------------------------------------------------------------


def _save_hf_folder(ours, folder, chat_template, generation_eos=None):
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=ours.backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(folder))
    if generation_eos is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return folder


def test_hf_tokenizer_matches_auto_tokenizer(ours, tmp_path):
    folder = _save_hf_folder(ours, tmp_path / "hf", ours.chat_template, generation_eos=[2, 0])
    tok = HFTokenizer(folder)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in [*TRICKY, assets.essay(assets.essay_names()[0])]:
        ids = tok.encode(text)
        assert ids == _ref_ids(ref, text) == ours.encode(text)
        assert tok.encode(text, add_special_tokens=True) == _ref_ids(ref, text, True)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    for msgs in CHATS.values():
        want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(msgs) == want == ours.apply_chat_template(msgs)
        assert tok.encode_chat(msgs) == list(ref.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"])
    assert tok.eos_token_ids == (2, 0)  # the tokenizer's eos, then generation_config.json's
    assert (tok.bos_token_id, tok.pad_token_id, tok.vocab_size) == (1, 0, len(ref))
    assert tok.chat_template == ours.chat_template


def test_hf_tokenizer_without_chat_template(ours, tmp_path):
    folder = _save_hf_folder(ours, tmp_path / "plain", None, generation_eos=0)
    tok = HFTokenizer(folder)
    assert tok.chat_template is None
    assert tok.eos_token_ids == (2, 0)
    with pytest.raises(ValueError, match="chat"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])
