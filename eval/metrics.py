"""Scoring functions, written from the benchmarks' definitions (no third-party scorer is imported).

LongBench (Bai et al., 2024, Table 1 / its ``metrics.py``): ``qa_f1`` (token F1 after SQuAD answer
normalisation), ``rouge_l`` (ROUGE-L F1 over whitespace tokens), ``classification`` (LongBench's class-match
score) and ``edit_similarity`` (the normalised InDel similarity behind ``fuzz.ratio``, used for code).
RULER (Hsieh et al., 2024, §3 / kvpress's scorer): ``string_match_all`` and ``string_match_part``.
All scores are in [0, 1] per example; reports multiply means by 100.
"""

from __future__ import annotations

import collections
import re
import string
from typing import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation, drop articles (a/an/the), collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def token_f1(prediction_tokens: Sequence[str], truth_tokens: Sequence[str]) -> float:
    """F1 of the multiset overlap of two token lists (0 when either is empty)."""
    common = collections.Counter(prediction_tokens) & collections.Counter(truth_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_tokens)
    recall = same / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, truth: str) -> float:
    """LongBench ``qa_f1_score`` (English): token F1 of the normalised answers."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(truth).split())


def lcs_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common subsequence (O(len(a) * len(b)) dynamic programme, one row)."""
    if not a or not b:
        return 0
    row = [0] * (len(b) + 1)
    for x in a:
        prev_diag = 0
        for j, y in enumerate(b, 1):
            keep = row[j]
            row[j] = prev_diag + 1 if x == y else max(row[j], row[j - 1])
            prev_diag = keep
    return row[-1]


def rouge_l(prediction: str, truth: str) -> float:
    """ROUGE-L F1 (Lin, 2004, §3.1 with beta = 1): ``2PR / (P + R)``, ``P = LCS / |pred|``,
    ``R = LCS / |truth|`` over whitespace tokens. (LongBench calls the ``rouge`` package, whose
    summary-level variant weights P and R slightly differently; scores are close but not identical.)"""
    p, t = prediction.split(), truth.split()
    lcs = lcs_length(p, t)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(p), lcs / len(t)
    return 2 * precision * recall / (precision + recall)


def classification(prediction: str, truth: str, all_classes: Sequence[str]) -> float:
    """LongBench ``classification_score``: the classes named in the prediction, minus those that are a
    proper substring of the truth; ``1 / #matches`` if the truth is among them, else 0."""
    matches = [c for c in all_classes if c in prediction]
    matches = [c for c in matches if not (c in truth and c != truth)]
    return 1.0 / len(matches) if truth in matches else 0.0


def edit_similarity(prediction: str, truth: str) -> float:
    """Normalised InDel similarity ``2 * LCS / (|a| + |b|)`` over characters (``fuzz.ratio / 100``
    without its rounding); 1.0 for two empty strings."""
    if not prediction and not truth:
        return 1.0
    return 2 * lcs_length(prediction, truth) / (len(prediction) + len(truth))


def code_similarity(prediction: str, truth: str) -> float:
    """LongBench ``code_sim_score``: edit similarity of the first generated line that is not a comment or a
    code fence (lines containing a backtick, ``#`` or ``//`` are skipped) against the reference line."""
    first = ""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            first = line
            break
    return edit_similarity(first, truth)


def count_score(prediction: str, truth: str) -> float:
    """LongBench ``count_score`` (passage_count): the fraction of numbers in the prediction equal to truth."""
    numbers = re.findall(r"\d+", prediction)
    return sum(n == str(truth) for n in numbers) / len(numbers) if numbers else 0.0


def retrieval_score(prediction: str, truth: str) -> float:
    """LongBench ``retrieval_score`` (passage_retrieval_en): truth ``"Paragraph N"``; the fraction of numbers
    in the prediction equal to ``N``."""
    found = re.findall(r"Paragraph (\d+)", truth)
    if not found:
        raise ValueError(f"truth={truth!r} is not of the form 'Paragraph N'")
    numbers = re.findall(r"\d+", prediction)
    return sum(n == found[0] for n in numbers) / len(numbers) if numbers else 0.0


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER: the fraction of references found (case-insensitive substring) in the prediction."""
    if not references:
        raise ValueError("references is empty; give at least one expected string")
    low = prediction.lower()
    return sum(r.lower() in low for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """RULER (QA tasks): 1 if any reference is found in the prediction, else 0."""
    if not references:
        raise ValueError("references is empty; give at least one expected string")
    low = prediction.lower()
    return float(any(r.lower() in low for r in references))
