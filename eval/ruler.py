"""RULER-style synthetic tasks (Hsieh et al., 2024, §3.2), following kvpress's RULER protocol: the context is
compressed at prefill and the question is not (it is teacher-forced after compression, see
:func:`eval.harness.answer_after_context`), with an answer prefix starting the assistant's turn.

- ``multikey`` (RULER ``niah_multikey_1``): ``keys`` "special magic number for <word>" needles in the
  essays; the question asks for one of them.
- ``variable_tracking`` (RULER ``vt``): a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... spread through the
  essays; the question asks every variable holding the value.
- ``common_words`` (RULER ``cwe``): a numbered list of words in which ``top`` words repeat ``freq_common``
  times and the others ``freq_rare`` times (words from the King James Bible); the question asks for the
  ``top`` most common ones.

Score: RULER's ``string_match_all`` (fraction of expected strings in the answer).

Several questions per context (``RulerTask(questions=Q)``, ``kvjax-eval ruler --questions-per-context Q``;
``multikey`` only): the context holds ``max(keys, Q)`` needles and ``Q`` questions ask for distinct ones. The
context is compressed once (:func:`kvjax.engine.questions.compress_context`) and its questions answered in one batch
(:func:`kvjax.engine.questions.answer`), as kvpress's pipeline answers every question of a context from one
compression; each question is a row.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Sequence

import numpy as np

from kernels_pallas.checks import check_int
from eval import harness, metrics
from kvjax.loading import assets
from kvjax.engine import bucket_length

#: the tasks of ``kvjax-eval ruler`` by default (chat models)
TASKS = ("multikey", "variable_tracking", "common_words")


@dataclasses.dataclass(frozen=True)
class RulerExample:
    task: str
    length: int
    context: tuple[int, ...]  # compressed: chat template start + instructions + haystack
    question: tuple[int, ...]  # not compressed: question + end of the user turn + answer prefix
    answers: tuple[str, ...]
    more: tuple = ()  # ((question, answers), ...): further questions on the same context (multikey, questions > 1)

    @property
    def all_questions(self) -> tuple:
        """``((question ids, answers), ...)``: the first question and any further ones."""
        return ((self.question, self.answers),) + tuple(self.more)


@functools.lru_cache(maxsize=2)
def _essay_ids(tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer.encode(assets.essays_text()))


@functools.lru_cache(maxsize=1)
def _bible_words() -> tuple[str, ...]:
    words = sorted({w.lower() for w in re.findall(r"[A-Za-z]{4,9}", assets.bible_text("Genesis"))})
    return tuple(words)


def _split(tok, context: str, question: str, answer_prefix: str, chat: bool = True) -> tuple[list[int], list[int]]:
    """Render the chat template for ``context + question`` and cut it after the context (kvpress's split). With
    ``chat=False`` (a base model): plain text, the context with the tokenizer's BOS, then the question, a newline and
    the answer prefix (context and question tokenized apart, as kvpress's pipeline does)."""
    if not chat:
        return tok.encode(context, add_special_tokens=True), tok.encode(question + "\n" + answer_prefix.strip())
    text = tok.apply_chat_template([{"role": "user", "content": context + question}])
    cut = text.index(context) + len(context)
    return tok.encode(text[:cut]), tok.encode(text[cut:] + answer_prefix)


def _fill(tok, pieces: list[str], room: int, rng) -> str:
    """Essay text of about ``room`` tokens with ``pieces`` inserted at random sentence boundaries, in order."""
    hay = tok.decode(list(_essay_ids(tok)[: max(room, 1)]))
    sentences = re.split(r"(?<=[.!?])\s+", hay)
    at = sorted(rng.choice(np.arange(len(sentences) + 1), size=len(pieces), replace=len(pieces) > len(sentences)))
    for offset, (i, piece) in enumerate(zip(at, pieces)):
        sentences.insert(i + offset, piece)
    return " ".join(sentences)


def _room(tok, length: int, frame_tokens: int) -> int:
    room = length - frame_tokens - 16
    if room < 32:
        raise ValueError(
            f"length={length} leaves no room for the haystack (the task's text takes {frame_tokens} "
            f"tokens); use lengths >= {frame_tokens + 64}"
        )
    return room


def multikey(tok, length: int, rng, keys: int = 4, questions: int = 1, chat: bool = True) -> RulerExample:
    keys = max(keys, questions)
    words = rng.choice(_bible_words(), size=keys, replace=False)
    values = [str(rng.randint(1000000, 10000000)) for _ in range(keys)]
    needles = [f"One of the special magic numbers for {w} is: {v}." for w, v in zip(words, values)]
    targets = [int(rng.randint(keys))] if questions == 1 else [int(t) for t in rng.permutation(keys)[:questions]]
    intro = (
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards.\n"
    )

    def ask(target):
        question = f"\nWhat is the special magic number for {words[target]} mentioned in the provided text?"
        prefix = f"The special magic number for {words[target]} mentioned in the provided text is"
        return question, prefix

    longest = max(len(tok.encode(q + p)) for q, p in map(ask, targets))
    frame = len(tok.encode(intro + " ".join(needles))) + longest + 20
    text = intro + _fill(tok, needles, _room(tok, length, frame), rng)
    split = [_split(tok, text, *ask(t), chat) for t in targets]
    ctx = split[0][0]
    if any(c != ctx for c, _ in split):  # the template puts nothing question-dependent before the context
        raise ValueError("the chat template tokenizes the context differently per question; use questions=1")
    qs = [(tuple(q), (values[t],)) for (_, q), t in zip(split, targets)]
    return RulerExample("multikey", length, tuple(ctx), qs[0][0], qs[0][1], tuple(qs[1:]))


def variable_tracking(tok, length: int, rng, hops: int = 4, chat: bool = True) -> RulerExample:
    names = ["".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), size=5)) for _ in range(hops + 1)]
    value = str(rng.randint(10000, 100000))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    intro = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    question = f"\nQuestion: Find all variables that are assigned the value {value} in the text above."
    prefix = (
        f" Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} "
        "variables are assigned the value {value}, they are:"
    ).replace("{value}", value)
    frame = len(tok.encode(intro + " ".join(chain) + question + prefix)) + 20
    text = intro + _fill(tok, chain, _room(tok, length, frame), rng)
    ctx, q = _split(tok, text, question, prefix, chat)
    return RulerExample("variable_tracking", length, tuple(ctx), tuple(q), tuple(names))


def common_words(
    tok, length: int, rng, top: int = 5, freq_common: int = 6, freq_rare: int = 1, chat: bool = True
) -> RulerExample:
    intro = (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
        "ones that appear most often.\n"
    )
    question = f"\nQuestion: What are the {top} most common words in the above list?"
    prefix = f" Answer: The top {top} words that appear most often in the list are:"
    frame = len(tok.encode(intro + question + prefix)) + 20
    room = _room(tok, length, frame)
    vocab = _bible_words()
    numbered = lambda words: " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
    sample = numbered(vocab[: min(len(vocab), 400)])
    per_word = len(tok.encode(sample)) / min(len(vocab), 400)  # "123. word" in this tokenizer
    n_rare = max(0, int((room / per_word - top * freq_common) // freq_rare))
    chosen = rng.choice(len(vocab), size=top + n_rare, replace=False)
    common, rare = [vocab[i] for i in chosen[:top]], [vocab[i] for i in chosen[top:]]
    words = common * freq_common + rare * freq_rare
    rng.shuffle(words)
    while len(words) > top * freq_common and len(tok.encode(numbered(words))) > room:  # the estimate ran over
        rare_at = max(i for i, w in enumerate(words) if w not in common)
        words.pop(rare_at)
    text = intro + numbered(words)
    ctx, q = _split(tok, text, question, prefix, chat)
    return RulerExample("common_words", length, tuple(ctx), tuple(q), tuple(common))


def single_needle(tok, length: int, rng, chat: bool = True) -> RulerExample:
    """RULER ``niah_single_2``: one needle "special magic number for <word>" (a 7-digit number) in the essays; the
    question asks for it."""
    word = str(rng.choice(_bible_words()))
    value = str(rng.randint(1000000, 10000000))
    needle = f"One of the special magic numbers for {word} is: {value}."
    intro = (
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\n"
    )
    question = f"\nWhat is the special magic number for {word} mentioned in the provided text?"
    prefix = f"The special magic number for {word} mentioned in the provided text is"
    frame = len(tok.encode(intro + needle + question + prefix)) + 20
    text = intro + _fill(tok, [needle], _room(tok, length, frame), rng)
    ctx, q = _split(tok, text, question, prefix, chat)
    return RulerExample("single_needle", length, tuple(ctx), tuple(q), (value,))


def multivalue(tok, length: int, rng, values: int = 4, chat: bool = True) -> RulerExample:
    """RULER ``niah_multivalue``: ``values`` needles "special magic number for <word>" with one word and different
    numbers; the question asks for all of them."""
    word = str(rng.choice(_bible_words()))
    numbers = [str(rng.randint(1000000, 10000000)) for _ in range(values)]
    needles = [f"One of the special magic numbers for {word} is: {v}." for v in numbers]
    intro = (
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards.\n"
    )
    question = f"\nWhat are all the special magic numbers for {word} mentioned in the provided text?"
    prefix = f"The special magic numbers for {word} mentioned in the provided text are"
    frame = len(tok.encode(intro + " ".join(needles) + question + prefix)) + 20
    text = intro + _fill(tok, needles, _room(tok, length, frame), rng)
    ctx, q = _split(tok, text, question, prefix, chat)
    return RulerExample("multivalue", length, tuple(ctx), tuple(q), tuple(numbers))


BUILDERS = {
    "single_needle": single_needle,
    "multikey": multikey,
    "multivalue": multivalue,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
}


def build(
    model,
    tasks: Sequence[str],
    lengths: Sequence[int],
    samples: int,
    seed: int = 0,
    questions: int = 1,
    chat: bool = True,
) -> list[RulerExample]:
    """``samples`` examples per (task, length); ``questions`` > 1 asks that many questions per context
    (``multikey`` only); ``chat=False``: plain-text prompts for a base model (no chat template)."""
    if model.tokenizer is None:
        raise ValueError("the RULER tasks need a model loaded with its tokenizer")
    for t in tasks:
        if t not in BUILDERS:
            raise ValueError(f"ruler task={t!r} is unknown; choose from {', '.join(BUILDERS)}")
    check_int("questions", questions, numpy_ok=True)
    if questions > 1 and tuple(tasks) != ("multikey",):
        raise ValueError(
            f"questions={questions} (several questions per context) applies to the multikey task only; "
            f"pass tasks=('multikey',) (--ruler-tasks multikey), not {','.join(tasks)}"
        )
    rng = np.random.RandomState(seed)
    kw = {"questions": questions} if questions > 1 else {}
    return [
        BUILDERS[t](model.tokenizer, int(n), rng, chat=chat, **kw)
        for t in tasks
        for n in lengths
        for _ in range(samples)
    ]


@dataclasses.dataclass(frozen=True)
class RulerTask:
    lengths: tuple[int, ...] = (1024,)
    tasks: tuple[str, ...] = TASKS
    samples: int = 4
    batch: int = 4
    max_new_tokens: int = 32
    seed: int = 0
    questions: int = 1  # questions per context (multikey): the context compressed once for all of them
    chat: bool = True  # False: plain-text prompts for a base model
    in_context: bool = False  # True: the question compressed with the context (the papers' protocol), one prompt
    name = "ruler"

    def prepare(self, model):
        examples = build(model, self.tasks, self.lengths, self.samples, self.seed, self.questions, self.chat)
        if self.in_context:
            if self.questions > 1:
                raise ValueError("in_context=True compresses each question with its context; use questions=1")
            examples = [dataclasses.replace(e, context=e.context + e.question, question=()) for e in examples]
        longest_q = max(len(q) for e in examples for q, _ in e.all_questions)
        for e in examples:
            harness.check_context(model, len(e.context), longest_q + self.max_new_tokens)
        bucket = bucket_length(max(len(e.context) for e in examples))
        batches = [examples[i : i + self.batch] for i in range(0, len(examples), self.batch)]
        return (bucket, longest_q + self.max_new_tokens), batches

    def capacity(self, prepared):
        from kvjax.methods.base import Capacity

        return Capacity(*prepared[0])

    def ends(self, prepared) -> list[tuple[int, int]]:
        """``(context tokens, decode steps)`` of each example at most at the end (question + answer decoded)."""
        return [(len(e.context), prepared[0][1] - 1) for batch in prepared[1] for e in batch]

    def prefill_batch(self, prepared, batch):
        """``(tokens [B, T], lengths [B])``: the contexts ``run_batch`` prefills (shared by every method,
        :class:`eval.runner.Shared`), or None with several questions per context (each context compressed once by
        :mod:`kvjax.engine.questions`)."""
        from kvjax import engine

        if self.questions > 1:
            return None
        return engine.pad_prompts(
            [list(e.context) for e in harness.pad_batch(list(batch), self.batch)[0]], prepared[0][0]
        )

    def run_batch(self, model, method, prepared, batch, meta, prefilled=None, on_phase=None) -> list[dict]:
        bucket, cap_new = prepared[0]
        if self.questions > 1:
            return self._run_shared_contexts(model, method, bucket, cap_new, batch, meta)
        padded, real = harness.pad_batch(list(batch), self.batch)
        answers, mem = harness.answer_after_context(
            model,
            method,
            [list(e.context) for e in padded],
            [list(e.question) for e in padded],
            bucket,
            self.max_new_tokens,
            capacity_new=cap_new,
            memory=True,
            prefilled=prefilled,
            on_phase=on_phase,
        )
        return [
            {
                **meta,
                "subtask": e.task,
                "length": e.length,
                "context_tokens": len(e.context),
                "expected": list(e.answers),
                "answer": a,
                "score": metrics.string_match_all(a, e.answers),
                **m,
            }
            for e, a, m in zip(batch, answers[:real], mem[:real])
        ]

    def _run_shared_contexts(self, model, method, bucket, cap_new, batch, meta) -> list[dict]:
        """Each context compressed once, its questions answered in one batch (:mod:`kvjax.engine.questions`)."""
        from kvjax.engine import questions as Q

        rows = []
        for e in batch:
            ctx = Q.compress_context(model, list(e.context), method, max_new_tokens=cap_new, prompt_len=bucket)
            qa = e.all_questions
            res = Q.answer(model, ctx, [list(q) for q, _ in qa], max_new_tokens=self.max_new_tokens)
            for i, ((_, expected), text, st) in enumerate(zip(qa, res.text, res.stats)):
                rows.append(
                    {
                        **meta,
                        "subtask": e.task,
                        "length": e.length,
                        "context_tokens": len(e.context),
                        "question": i,
                        "expected": list(expected),
                        "answer": text,
                        "score": metrics.string_match_all(text, expected),
                        **harness.memory_from_stats(st),
                    }
                )
        return rows
