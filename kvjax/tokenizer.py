"""Tokenizers: built from a GGUF file's own vocabulary (no torch, no transformers), or a HF folder's.

``GGUFTokenizer.from_gguf``: for ``tokenizer.ggml.model == "gpt2"`` a byte-level BPE from
``tokenizer.ggml.tokens`` and ``tokenizer.ggml.merges`` (the construction transformers' GGUF converter uses),
with CONTROL/USER_DEFINED tokens registered as special tokens, bos/eos/pad ids from the file and the chat
template from ``tokenizer.chat_template`` rendered with jinja2 as transformers renders it.
``HFTokenizer``: ``transformers.AutoTokenizer`` on a Hugging Face folder, behind the same interface.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

_CONTROL, _USER_DEFINED = 3, 4


def _render(template: str, messages: list[dict], add_generation_prompt: bool, **special) -> str:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            **special)


class Tokenizer:
    """Common interface: ``encode``, ``decode``, ``apply_chat_template``, ``encode_chat`` and special ids."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        raise NotImplementedError

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Render the chat template, then encode it (special tokens in the text are recognised)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


class GGUFTokenizer(Tokenizer):
    def __init__(self, backend, *, bos_token_id, eos_token_id, pad_token_id, add_bos: bool,
                 chat_template: str | None, special_ids: set[int]):
        self._tok = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = () if eos_token_id is None else (int(eos_token_id),)
        self.pad_token_id = int(pad_token_id if pad_token_id is not None else (eos_token_id or 0))
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._special = special_ids

    @classmethod
    def from_gguf(cls, path_or_reader) -> "GGUFTokenizer":
        from tokenizers import AddedToken, Tokenizer as HFBackend, decoders, models, pre_tokenizers

        from kvjax.gguf_loader import field, open_gguf

        reader = open_gguf(path_or_reader) if isinstance(path_or_reader, (str, Path)) else path_or_reader
        kind = field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer.ggml.model={kind!r} is not supported; kvjax builds 'gpt2' "
                             "(byte-level BPE) tokenizers from GGUF files")
        tokens = field(reader, "tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", [])]
        types = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
        vocab = {t: i for i, t in enumerate(tokens)}
        backend = HFBackend(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        special = [i for i, ty in enumerate(types) if ty in (_CONTROL, _USER_DEFINED)]
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
        return cls(backend, bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
                   eos_token_id=field(reader, "tokenizer.ggml.eos_token_id"),
                   pad_token_id=field(reader, "tokenizer.ggml.padding_token_id"),
                   add_bos=bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
                   chat_template=field(reader, "tokenizer.chat_template"), special_ids=set(special))

    def _token(self, i):
        return None if i is None else self._tok.id_to_token(int(i))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [int(self.bos_token_id)] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("chat=True but this tokenizer has no chat template; pass chat=False")
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        return _render(self.chat_template, messages, add_generation_prompt,
                       bos_token=self._token(self.bos_token_id) or "", eos_token=self._token(eos) or "")


class HFTokenizer(Tokenizer):
    """``transformers.AutoTokenizer`` for a Hugging Face folder."""

    def __init__(self, folder: str | Path):
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ValueError("loading a Hugging Face tokenizer needs transformers: pip install 'kvjax[hf]'") from e
        folder = Path(folder)
        self._tok = AutoTokenizer.from_pretrained(str(folder))
        self.vocab_size = len(self._tok)
        self.bos_token_id = self._tok.bos_token_id
        eos = set() if self._tok.eos_token_id is None else {int(self._tok.eos_token_id)}
        gen = folder / "generation_config.json"
        if gen.is_file():
            value = json.loads(gen.read_text()).get("eos_token_id")
            eos |= {int(v) for v in ([] if value is None else [value] if isinstance(value, int) else value)}
        self.eos_token_ids = tuple(sorted(eos))
        pad = self._tok.pad_token_id
        self.pad_token_id = int(pad if pad is not None else (min(eos) if eos else 0))
        self.chat_template = getattr(self._tok, "chat_template", None)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("chat=True but this tokenizer has no chat template; pass chat=False")
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
