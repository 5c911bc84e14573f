"""Tokenizers: text <-> token ids, and chat templates, behind one small interface.

Two implementations of :class:`Tokenizer`:

- :class:`GGUFTokenizer` (``GGUFTokenizer.from_gguf(path_or_reader)``) is built from a GGUF file's own
  metadata with the ``tokenizers`` library only (no torch, no transformers). Supported:
  ``tokenizer.ggml.model == "gpt2"``, a byte-level BPE from ``tokenizer.ggml.tokens`` and
  ``tokenizer.ggml.merges``; it is the construction transformers' GGUF converter uses
  (``transformers/integrations/gguf/gguf_tokenizer_mapping.py``), so ids agree token for token:

  * pre-tokenizer: ``ByteLevel(add_prefix_space=False, use_regex=True)`` (the GPT-2 split regex), except
    for the ``tokenizer.ggml.pre`` values in ``_PRE_SPLITS`` (Llama 3, Qwen2), whose own split regex runs
    before a regex-free ``ByteLevel``; decoder ``ByteLevel``; no normalizer.
  * tokens typed CONTROL (3) in ``tokenizer.ggml.token_type`` are special tokens (matched whole in text,
    dropped by ``decode(skip_special_tokens=True)``); USER_DEFINED (4) ones are added, non-special tokens.
  * bos/eos/pad ids from ``tokenizer.ggml.{bos,eos,padding}_token_id``; ``eos_token_ids`` also holds
    ``eot``/``eom`` ids when the file has them. ``tokenizer.ggml.add_bos_token``/``add_eos_token`` apply
    when ``encode(..., add_special_tokens=True)``.
  * the chat template ``tokenizer.chat_template`` is rendered with jinja2 as transformers renders it: an
    ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the variables
    ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``unk_token``, ``pad_token`` and
    the globals ``raise_exception`` and ``strftime_now``.

  ``tokenizer.ggml.model == "llama"`` (SentencePiece: every Gemma, Llama 2 and Mistral GGUF) is rebuilt as the
  byte-fallback BPE that transformers' GGUF converter builds (``gguf_tokenizer_mapping.py``: ``sentencepiece_tokenizer``
  with ``LlamaTokenizer``, and by ``general.architecture`` ``gemma_tokenizer`` with ``GemmaTokenizer`` or
  ``phi3_tokenizer``), again with the ``tokenizers`` library alone, so kvjax needs no transformers at run time. The
  tests compare the result with transformers' tokenizer of the same file (the serialized ``tokenizers`` object of the
  embedded Gemma 3 file is identical to transformers'):

  * model: ``BPE(byte_fallback=True, fuse_unk=True)`` over ``tokenizer.ggml.tokens``; the merges are the file's
    ``tokenizer.ggml.merges`` or, as SentencePiece files have none, every split of a token into two vocabulary tokens
    ordered by ``tokenizer.ggml.scores`` (transformers' ``generate_merges``); Gemma's by the tokens' order in the
    file, and Gemma's tokens of two or more spaces respelled with U+2581.
  * Llama (any architecture but these): pre-tokenizer ``Metaspace(prepend_scheme="first")`` (one U+2581 before the
    text), decoder U+2581 -> space, byte fallback, fuse, strip one leading space. Gemma (``gemma``, ``gemma2``,
    ``gemma3``): no prefix space, normalizer space -> U+2581, each space ends a piece, the same decoder without the
    strip. Phi-3: the prefix space from a normalizer. transformers ignores ``tokenizer.ggml.add_space_prefix``; so
    does kvjax.
  * CONTROL tokens and the bos/eos/unk/pad tokens are special; USER_DEFINED ones (Gemma's ``"\\n"`` runs, its
    ``[multimodal]``) are added whole. ``add_bos_token`` defaults to True when the file does not say (llama.cpp's
    default for SentencePiece, and transformers').

  Any other ``tokenizer.ggml.model`` (e.g. ``"t5"``) raises a ``ValueError`` naming the supported ones.

- :class:`HFTokenizer` wraps ``transformers.AutoTokenizer.from_pretrained(folder)`` (transformers is imported
  only when one is built). ``eos_token_ids`` joins the tokenizer's eos id with the ``eos_token_id`` (an int
  or a list) of the folder's ``generation_config.json``, as ``model.generate`` would stop on either.

Units: ids are Python ``int`` token ids in ``[0, vocab_size)``; ``encode`` returns a ``list[int]`` of
length ``[T]`` and ``decode`` takes any sequence of ints (a list, or a 1-D numpy/JAX array).
"""

from __future__ import annotations

import abc
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

_CONTROL, _USER_DEFINED = 3, 4  # gguf.TokenType values

# ``tokenizer.ggml.pre`` values whose split regex is not GPT-2's (copied from transformers' GGUF converter).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}


class Tokenizer(abc.ABC):
    """The interface kvjax uses: ``encode``/``decode``, chat templates and the special ids.

    ``vocab_size``: number of ids, added tokens included. ``bos_token_id``: None when the model has none.
    ``eos_token_ids``: every id that ends generation. ``pad_token_id``: id used to pad prompts in a batch.
    ``chat_template``: jinja source, or None.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        chat_template: str | None,
    ):
        self._vocab_size = int(vocab_size)
        self._bos_token_id = None if bos_token_id is None else int(bos_token_id)
        self._eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self._pad_token_id = int(pad_token_id)
        self._chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def pad_token_id(self) -> int:
        return self._pad_token_id

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are recognised as such.

        add_special_tokens: also add the model's bos/eos where its tokenizer config asks for them.
        """

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens (e.g. ``<|im_end|>``) are dropped when ``skip_special_tokens``."""

    @abc.abstractmethod
    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template rendered for ``messages`` (``[{"role": ..., "content": ...}, ...]``), as text."""
        if self._chat_template is None:
            raise ValueError(
                "chat=True, but this tokenizer has no chat template; pass chat=False (plain text "
                "prompts) or use a checkpoint that ships one"
            )
        return self._render(messages, add_generation_prompt)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """``encode(apply_chat_template(messages))``: the template writes the special tokens itself."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


def _compile_template(source: str):
    """A jinja2 template compiled the way transformers compiles chat templates (sandboxed)."""
    import jinja2.ext
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; transformers' does not.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level BPE tokens are spelled in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _open_reader(path_or_reader):
    import gguf

    if isinstance(path_or_reader, gguf.GGUFReader):
        return path_or_reader
    path = Path(path_or_reader)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    return gguf.GGUFReader(str(path))


def _byte_level_backend(get, tokens: list[str], types: list[int]):
    """``tokenizer.ggml.model='gpt2'``: byte-level BPE from the file's tokens and merges (module docstring)."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    # Normal tokens are spelled in GPT-2's byte alphabet; respell any that are not (as transformers does).
    # CONTROL / USER_DEFINED tokens keep their text so they are matched whole and keep their own ids.
    byte_spelling = _bytes_to_unicode()
    alphabet = set(byte_spelling.values())
    vocab: dict[str, int] = {}
    special, added = [], []
    for i, (tok, ty) in enumerate(zip(tokens, types)):
        if ty == _CONTROL:
            special.append(tok)
        elif ty == _USER_DEFINED:
            added.append(tok)
        elif not alphabet.issuperset(tok):
            tok = "".join(byte_spelling[b] for b in tok.encode("utf-8"))
        vocab[tok] = i
    merges = get("tokenizer.ggml.merges")
    backend = Backend(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], fuse_unk=False))
    split = _PRE_SPLITS.get(get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary, best first: every split of a token into two vocabulary
    tokens, ordered by the token's score, then the lengths of the left and right piece (higher first).

    transformers' ``tokenization_utils_base.generate_merges(vocab, vocab_scores)``, step for step, so the
    order of ties (the same score) is the same: a token's splits in vocabulary order of their pieces, tokens in
    ``scores`` order, and a stable sort.
    """
    merges = []
    for token, score in scores.items():
        local = [
            (token[:k], token[k:], score) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece_backend(get, tokens: list[str], types: list[int]):
    """``tokenizer.ggml.model='llama'``: SentencePiece as a byte-fallback BPE (module docstring)."""
    from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    arch = get("general.architecture")
    gemma = arch in _GEMMA_ARCHS
    # Gemma files store a token of 2+ spaces as spaces; its vocabulary spells them with U+2581.
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens] if gemma else tokens
    vocab = {t: i for i, t in enumerate(spelled)}
    if gemma:  # Gemma's scores do not follow its merge order; the order of the tokens in the file does
        scores = {t: -i for i, t in enumerate(spelled)}
    else:
        file_scores = get("tokenizer.ggml.scores")
        scores = dict(zip(spelled, file_scores if file_scores is not None else [0.0] * len(spelled)))
    merges = get("tokenizer.ggml.merges")
    merges = [tuple(m.split(" ")) for m in merges] if merges is not None else _merges_from_scores(vocab, scores)
    # GemmaTokenizer names "<unk>" the unknown token; LlamaTokenizer names none (byte fallback covers every byte).
    unk = "<unk>" if gemma else None
    backend = Backend(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    spaces = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:  # GemmaTokenizer: no prefix space; every space becomes U+2581 and ends a piece
        backend.normalizer = normalizers.Replace(" ", "\u2581")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        backend.decoder = decoders.Sequence(spaces)
    elif arch == "phi3":  # a normalizer writes the prefix space (so text starting with a space gets two)
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        backend.decoder = decoders.Sequence([*spaces, decoders.Strip(content=" ", left=1)])
    else:  # LlamaTokenizer (legacy=False): U+2581 before the first piece only, stripped again on decode
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        backend.decoder = decoders.Sequence([*spaces, decoders.Strip(content=" ", left=1)])

    # CONTROL tokens and the named ones are special; USER_DEFINED ones that are in the vocabulary are added whole.
    named = {get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")} - {None}
    special = [t for i, (t, ty) in enumerate(zip(tokens, types)) if ty == _CONTROL or i in named]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    in_vocab = backend.get_vocab(with_added_tokens=True)
    added = [t for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in in_vocab]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return backend


_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
_BUILDERS = {"gpt2": _byte_level_backend, "llama": _sentencepiece_backend}


class GGUFTokenizer(Tokenizer):
    """A byte-level BPE or SentencePiece tokenizer built from a GGUF file's metadata (see the module docstring)."""

    def __init__(
        self,
        backend,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        unk_token_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
    ):
        """backend: a ``tokenizers.Tokenizer``; the ids index its vocabulary."""
        super().__init__(
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            pad_token_id=pad_token_id,
            chat_template=chat_template,
        )
        self._backend = backend
        self._unk_token_id = unk_token_id
        self._add_bos = add_bos and bos_token_id is not None
        self._add_eos = add_eos and bool(self.eos_token_ids)
        self._template = None  # compiled on first use

    @property
    def backend(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    @classmethod
    def from_gguf(cls, path_or_reader) -> GGUFTokenizer:
        """Build from a ``.gguf`` path or an open ``gguf.GGUFReader``."""
        reader = _open_reader(path_or_reader)

        def get(key: str, default: Any = None) -> Any:
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        kind = get("tokenizer.ggml.model")
        if kind not in _BUILDERS:
            raise ValueError(
                f"GGUF tokenizer.ggml.model={kind!r} is not supported: kvjax builds 'gpt2' (byte-level BPE) and "
                "'llama' (SentencePiece) tokenizers from GGUF files; load the Hugging Face checkpoint "
                "(with its tokenizer.json) instead"
            )
        tokens = get("tokenizer.ggml.tokens")
        if not tokens or (kind == "gpt2" and get("tokenizer.ggml.merges") is None):
            raise ValueError(
                f"GGUF tokenizer.ggml.model={kind!r} but tokenizer.ggml.tokens"
                f"{' or tokenizer.ggml.merges' if kind == 'gpt2' else ''} is missing; the file has no usable "
                "vocabulary"
            )
        types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend = _BUILDERS[kind](get, tokens, types)

        eos = get("tokenizer.ggml.eos_token_id")
        eos_ids = [
            i for i in (eos, get("tokenizer.ggml.eot_token_id"), get("tokenizer.ggml.eom_token_id")) if i is not None
        ]
        pad = get("tokenizer.ggml.padding_token_id")
        return cls(
            backend,
            bos_token_id=get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=pad if pad is not None else (eos if eos is not None else 0),
            unk_token_id=get("tokenizer.ggml.unknown_token_id"),
            # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise (as transformers).
            add_bos=bool(get("tokenizer.ggml.add_bos_token", kind == "llama")),
            add_eos=bool(get("tokenizer.ggml.add_eos_token", False)),
            chat_template=get("tokenizer.chat_template"),
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self._add_bos:
            ids = [self.bos_token_id, *ids]
        if add_special_tokens and self._add_eos:
            ids = [*ids, self.eos_token_ids[0]]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def _token(self, i: int | None) -> str:
        return "" if i is None else (self._backend.id_to_token(i) or "")

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token(self.bos_token_id),
            eos_token=self._token(eos),
            unk_token=self._token(self._unk_token_id),
            pad_token=self._token(self.pad_token_id),
        )


class HFTokenizer(Tokenizer):
    """``transformers.AutoTokenizer`` for a local Hugging Face folder, behind the kvjax interface."""

    def __init__(self, folder: str | Path):
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ValueError(
                f"loading the tokenizer of {folder} needs transformers, which is not installed: "
                "pip install transformers (or load a GGUF file, whose tokenizer needs only the "
                "tokenizers package)"
            ) from e
        folder = Path(folder)
        tok = AutoTokenizer.from_pretrained(str(folder))
        eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
        gen = folder / "generation_config.json"
        if gen.is_file():
            extra = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
            eos += [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)
        template = getattr(tok, "chat_template", None)
        super().__init__(
            vocab_size=len(tok),
            bos_token_id=tok.bos_token_id,
            eos_token_ids=eos,
            pad_token_id=pad,
            chat_template=template or None,
        )
        self._tok = tok

    @property
    def backend(self):
        """The underlying transformers tokenizer."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
