"""Prompts in, token ids out: tokenizing (with or without the chat template), buckets and right-padding, the
checks a generation makes before it compiles anything (capacity, the method's budget against the context), and
where a generation ends (EOS). :mod:`kvjax.engine` re-exports these names.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np

from kvjax.config import ModelConfig
from kvjax.methods.plans.layers import method_of

MIN_BUCKET = 32


def bucket_length(n: int) -> int:
    """Prompt bucket: the next power of two >= ``n`` (at least 32)."""
    return max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length())


def prepare_prompts(model, prompts, chat: bool = False) -> list[list[int]]:
    """Token id lists from a string, strings (tokenized; ``chat=True`` applies the chat template) or id lists."""
    if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if len(prompts) == 0:
        raise ValueError("prompts=[] is empty; pass a string, a list of strings or a list of token id lists")
    ids = []
    for p in prompts:
        if isinstance(p, str):
            if model.tokenizer is None:
                raise ValueError(
                    "prompts are strings but this model was loaded without a tokenizer; pass token "
                    "id lists or load a checkpoint with tokenizer files"
                )
            ids.append(
                model.tokenizer.encode_chat([{"role": "user", "content": p}])
                if chat
                else model.tokenizer.encode(p, add_special_tokens=True)
            )
        else:
            ids.append([int(i) for i in p])
        if not ids[-1]:
            raise ValueError("an empty prompt cannot be generated from; give at least one token")
    return ids


class ChatTemplateWarning(UserWarning):
    """Strings were tokenized without the chat template of a model that has one, and an answer came out empty
    (:func:`warn_without_chat`)."""


def warn_without_chat(model, prompts, chat: bool, texts, argument: str = "chat") -> bool:
    """Warn (:class:`ChatTemplateWarning`) when string ``prompts`` were tokenized without the model's chat template
    (``chat=False``) and some output in ``texts`` is empty: an instruct model given raw text often ends at once.
    Returns whether it warned."""
    tok = model.tokenizer
    strings = isinstance(prompts, str) or any(isinstance(p, str) for p in prompts)
    if chat or not strings or tok is None or tok.chat_template is None or all(t for t in texts):
        return False
    empty = sum(1 for t in texts if not t)
    warnings.warn(
        f"{empty} of {len(texts)} outputs are empty: the prompts were tokenized without this model's chat template "
        f"({argument}=False) and an instruct model often ends at once on raw text; pass {argument}=True",
        ChatTemplateWarning,
        stacklevel=3,
    )
    return True


def check_method(cfg: ModelConfig, method) -> None:
    """A ValueError when the token budget of ``method`` (a method or a per-layer plan) exceeds the model context (the
    fix: a smaller count)."""
    from kvjax.budget import check_budget

    budget = method_of(method).budget  # declared (base.Method.budget); the method validated its type and range
    if budget is not None:
        check_budget(budget, "budget", max_tokens=cfg.max_position_embeddings)


def check_capacity(cfg: ModelConfig, lengths: Sequence[int], bucket: int, max_new_tokens: int):
    """A ValueError when ``max_new_tokens < 1``, a prompt is longer than the bucket, or a prompt plus the new tokens
    exceed the model context (each naming the fix); prompts are never truncated."""
    longest = max(lengths)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if longest > bucket:
        raise ValueError(
            f"prompt of {longest} tokens is longer than capacity prompt_len={bucket}; raise "
            "prompt_len (or leave it None to bucket automatically); prompts are never truncated"
        )
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model context "
            f"of {cfg.max_position_embeddings} tokens; shorten the prompt or generate fewer tokens"
        )


def until_eos(tokens: list[int], eos) -> list[int]:
    """``tokens`` up to (not including) the first one in ``eos``."""
    cut = next((j for j, tok in enumerate(tokens) if tok in eos), len(tokens))
    return tokens[:cut]


def eos_ids(model) -> tuple[int, ...]:
    """The token ids that end a generation: the model config's and the tokenizer's end-of-sequence ids."""
    ids = set(model.config.eos_token_ids)
    if model.tokenizer is not None:
        ids |= set(model.tokenizer.eos_token_ids)
    return tuple(sorted(ids))


def pad_prompts(ids: list[list[int]], bucket: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad id lists to ``bucket`` (default :func:`bucket_length` of the longest): ``(tokens [B, bucket]
    int32, lengths [B] int32)``. A prompt longer than ``bucket`` is an error, never truncated."""
    longest = max(len(s) for s in ids)
    bucket = bucket or bucket_length(longest)
    if longest > bucket:
        raise ValueError(
            f"prompt of {longest} tokens is longer than prompt_len={bucket}; raise prompt_len (or "
            "leave it None to bucket automatically); prompts are never truncated"
        )
    tokens = np.zeros((len(ids), bucket), np.int32)
    for i, seq in enumerate(ids):
        tokens[i, : len(seq)] = seq
    return tokens, np.asarray([len(s) for s in ids], np.int32)
