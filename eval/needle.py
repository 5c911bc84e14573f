"""Needle-in-a-haystack / passkey retrieval over the Paul Graham essays (Kamradt's NIAH; the passkey needle
of Mohtashami & Jaggi, 2023, §4.2), scored as exact retrieval of the number.

A prompt of about ``length`` tokens (chat template included) is the essays' text cut to fit, with the needle
sentence inserted at ``depth`` (0 = start, 1 = end of the haystack, moved back to the previous sentence end)
as its own paragraph, and the question after the haystack; the assistant's turn starts with
``ANSWER_PREFIX`` (SmolLM2-135M retrieves reliably only with the paragraph breaks and the prefix). The whole prompt,
question included, is compressed at prefill (the SnapKV/PyramidKV needle protocol). Score: 1 if the passkey's digits
appear in the answer, else 0.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from kvjax.loading import assets

NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
INSTRUCTION = "Read the text and find the pass key.\n\n"
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"  # starts the assistant's turn (as RULER/kvpress's answer_prefix)


@dataclasses.dataclass(frozen=True)
class NeedleExample:
    length: int  # target prompt length in tokens
    depth: float  # needle position as a fraction of the haystack
    key: str  # the passkey (digits)
    prompt: tuple[int, ...]  # token ids, chat template applied


@functools.lru_cache(maxsize=4)
def _haystack_ids(tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer.encode(assets.essays_text()))


def _prompt(tok, text: str) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": INSTRUCTION + text + "\n\n" + QUESTION}]) + tok.encode(
        ANSWER_PREFIX
    )


def sentence_start(ids: Sequence[int], at: int, period_ids: set[int]) -> int:
    """The index after the last sentence-ending token at or before ``at`` (0 if none)."""
    for i in range(min(at, len(ids)) - 1, -1, -1):
        if ids[i] in period_ids:
            return i + 1
    return 0


def build_example(model, length: int, depth: float, key: str) -> NeedleExample:
    """A prompt of about ``length`` tokens with the passkey ``key`` at ``depth`` of the haystack."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must be in [0, 1] (fraction of the haystack)")
    tok = model.tokenizer
    if tok is None:
        raise ValueError("the needle task needs a model loaded with its tokenizer")
    needle = NEEDLE.format(key=key)
    frame = _prompt(tok, needle)
    room = length - len(frame) - 8  # a few tokens of slack for merges at the seams
    if room < 16:
        raise ValueError(
            f"length={length} leaves no room for a haystack (template, needle and question take "
            f"{len(frame)} tokens); use lengths >= {len(frame) + 32}"
        )
    hay = _haystack_ids(tok)
    if room > len(hay):
        raise ValueError(f"length={length} needs {room} haystack tokens but the essays have {len(hay)}")
    hay = list(hay[:room])
    period_ids = {i for i in set(hay) if tok.decode([i]).rstrip().endswith((".", "!", "?"))}
    at = sentence_start(hay, int(round(depth * len(hay))), period_ids) if depth < 1.0 else len(hay)
    prompt = _prompt(tok, (tok.decode(hay[:at]) + "\n\n" + needle + "\n\n" + tok.decode(hay[at:])).strip())
    return NeedleExample(length, float(depth), key, tuple(prompt))


def build(
    model, lengths: Sequence[int], depths: Sequence[float], seed: int = 0, trials: int = 1
) -> list[NeedleExample]:
    """The (length x depth) grid, ``trials`` random 5-digit passkeys per cell (seeded), length-major."""
    rng = np.random.RandomState(seed)
    return [
        build_example(model, int(n), float(d), str(rng.randint(10000, 100000)))
        for n in lengths
        for d in depths
        for _ in range(trials)
    ]


def score(answer: str, key: str) -> float:
    """1.0 if the passkey appears verbatim in the answer, else 0.0."""
    return float(key in answer)
