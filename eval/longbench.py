"""LongBench (Bai et al., 2024): the official data format, prompts, generation lengths, truncation, chat rule
and scoring, for any kvjax method.

Written from the THUDM/LongBench repository's protocol (``config/dataset2prompt.json``,
``config/dataset2maxlen.json``, ``pred.py``, ``eval.py``, ``metrics.py``):

- Data: one JSON object per line with ``input``, ``context``, ``answers`` (list), ``length``, ``dataset``,
  ``language``, ``all_classes`` (list or null) and ``_id``; read from ``DIR/<dataset>.jsonl`` or
  ``DIR/data/<dataset>.jsonl`` (the layout of the unzipped ``data.zip``), or from the Hugging Face hub when
  ``data`` is a dataset id (``THUDM/LongBench``) and the hub is reachable.
- Prompt: ``PROMPTS[dataset].format(context=..., input=...)``; when its tokens exceed ``max_length`` the
  middle is cut (the first and last ``max_length // 2`` tokens kept, as ``pred.py``), and the row records
  ``truncated`` and the original token count. The chat template is applied except for the datasets in
  ``NO_CHAT`` (few-shot and code completion, as ``pred.py``). Greedy generation of ``MAX_NEW_TOKENS[dataset]``.
- Score (``eval.py``): for trec, triviaqa, samsum, lsht the prediction is cut at its first newline; the
  example's score is the max of the dataset's metric over its answers; a dataset's score is the mean x 100.
  Metrics (``eval.metrics``): qa-F1 (English), ROUGE-L, classification, retrieval, count, code edit
  similarity; the Chinese ones (qa-F1 zh, ROUGE zh) tokenise with ``jieba`` (an ImportError naming it when it
  is not installed). Differences from the official scorer: ROUGE-L is computed directly (LCS F1 over
  whitespace tokens) rather than with the ``rouge`` package, and code similarity is the InDel ratio without
  fuzzywuzzy's rounding.
"""

from __future__ import annotations

import dataclasses
import json
import re
import string
from pathlib import Path
from typing import Any, Sequence

from eval import harness, metrics
from kvjax.engine import bucket_length

_QA_PASSAGES = (
    "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
    "given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\n"
    "Answer:"
)
_QASPER_RULE = (
    "Answer the question as concisely as you can, using a single phrase or sentence if possible. If the "
    'question cannot be answered based on the information in the article, write "unanswerable". If the '
    'question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any '
    "explanation."
)

#: The official prompt templates (config/dataset2prompt.json).
PROMPTS: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
        "question asconcisely as you can, using a single phrase if possible. Do not provide any "
        "explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as "
        "you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: "
        "{input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. " + _QASPER_RULE + "\n\nArticle: {context}\n\n "
        "Answer the question based on the above article as concisely as you can, using a single phrase or "
        "sentence if possible. If the question cannot be answered based on the information in the article, "
        'write "unanswerable". If the question is a yes/no question, answer "yes", "no", or '
        '"unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:'
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question "
        "based on the above text, only give me the answer and do not output any other words.\n\n"
        "Question: {input}\nAnswer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。"
        "\n\n问题：{input}\n回答："
    ),
    "hotpotqa": _QA_PASSAGES,
    "2wikimqa": _QA_PASSAGES,
    "musique": _QA_PASSAGES,
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",  # noqa: E501 (the official prompt)
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
        "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in "
        "one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
        "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
        "Now, write a one-page summary of all the news.\n\nSummary:"
    ),
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",  # noqa: E501 (the official prompt)
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other "
        "words. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",  # noqa: E501 (the official prompt)
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
        "carefully read these paragraphs and determine how many unique paragraphs there are after "
        "removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n"
        "{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The "
        "output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer "
        "is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which "
        "paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\n"
        "Please enter the number of the paragraph that the abstract is from. The answer format "
        'must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: '
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n"
        '请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：'
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

#: Maximum generated tokens per dataset (config/dataset2maxlen.json).
MAX_NEW_TOKENS: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}

#: Datasets prompted without the chat template (pred.py: few-shot and code completion).
NO_CHAT = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
#: Datasets whose prediction is cut at its first newline before scoring (eval.py).
FIRST_LINE = frozenset({"trec", "triviaqa", "samsum", "lsht"})
FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")


def _jieba():
    try:
        import jieba
    except ImportError as e:
        raise ImportError("the Chinese LongBench metrics tokenise with jieba: `pip install jieba`") from e
    return jieba


_ZH_PUNCT = set(
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)


def _normalize_zh(text: str) -> str:
    """LongBench ``normalize_zh_answer``: lower case, no punctuation (ASCII and CJK), no whitespace."""
    punct = _ZH_PUNCT | set(string.punctuation)
    return "".join(ch for ch in text.lower() if ch not in punct and not ch.isspace())


def qa_f1_zh(prediction: str, truth: str) -> float:
    """LongBench ``qa_f1_zh_score``: token F1 over jieba tokens after ``normalize_zh_answer``."""
    jieba = _jieba()
    p = [t for t in (_normalize_zh(w) for w in jieba.cut(prediction, cut_all=False)) if t]
    g = [t for t in (_normalize_zh(w) for w in jieba.cut(truth, cut_all=False)) if t]
    return metrics.token_f1(p, g)


def rouge_zh(prediction: str, truth: str) -> float:
    """LongBench ``rouge_zh_score``: ROUGE-L over jieba tokens."""
    jieba = _jieba()
    return metrics.rouge_l(" ".join(jieba.cut(prediction, cut_all=False)), " ".join(jieba.cut(truth, cut_all=False)))


def retrieval_zh(prediction: str, truth: str) -> float:
    """LongBench ``retrieval_zh_score``: truth ``"段落N"``; the fraction of numbers in the prediction equal to N."""
    found = re.findall(r"段落(\d+)", truth)
    if not found:
        raise ValueError(f"truth={truth!r} is not of the form '段落N'")
    numbers = re.findall(r"\d+", prediction)
    return sum(n == found[0] for n in numbers) / len(numbers) if numbers else 0.0


#: dataset -> metric(prediction, truth, all_classes) (eval.py's dataset2metric).
METRICS: dict[str, Any] = {
    **{
        d: lambda p, t, c: metrics.qa_f1(p, t)
        for d in ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa")
    },
    **{d: lambda p, t, c: qa_f1_zh(p, t) for d in ("multifieldqa_zh",)},
    **{d: lambda p, t, c: metrics.rouge_l(p, t) for d in ("gov_report", "qmsum", "multi_news", "samsum")},
    **{d: lambda p, t, c: rouge_zh(p, t) for d in ("dureader", "vcsum")},
    "trec": lambda p, t, c: metrics.classification(p, t, c),
    "lsht": lambda p, t, c: metrics.classification(p, t, c),
    "passage_retrieval_en": lambda p, t, c: metrics.retrieval_score(p, t),
    "passage_retrieval_zh": lambda p, t, c: retrieval_zh(p, t),
    "passage_count": lambda p, t, c: metrics.count_score(p, t),
    "lcc": lambda p, t, c: metrics.code_similarity(p, t),
    "repobench-p": lambda p, t, c: metrics.code_similarity(p, t),
}


def check_dataset(name: str) -> str:
    if name not in PROMPTS:
        raise ValueError(f"dataset={name!r} is not a LongBench dataset; choose from {', '.join(PROMPTS)}")
    return name


def score(dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None) -> float:
    """One example's score in [0, 1]: the first-line rule, then the max of the metric over ``answers``."""
    check_dataset(dataset)
    if dataset in FIRST_LINE:
        prediction = prediction.lstrip("\n").split("\n")[0]
    return max((METRICS[dataset](prediction, a, all_classes or []) for a in answers), default=0.0)


def load(data: str | Path, dataset: str, limit: int | None = None) -> list[dict]:
    """Examples of ``dataset`` from a local folder (``<dataset>.jsonl`` or ``data/<dataset>.jsonl``) or a hub
    dataset id (e.g. ``THUDM/LongBench``); the first ``limit`` if given. Every record must have ``FIELDS``."""
    check_dataset(dataset)
    path = Path(data)
    if path.is_dir():
        for cand in (path / f"{dataset}.jsonl", path / "data" / f"{dataset}.jsonl"):
            if cand.is_file():
                lines = cand.read_text(encoding="utf-8").splitlines()
                records = [json.loads(line) for line in lines if line.strip()]
                break
        else:
            raise FileNotFoundError(
                f"data={str(data)!r} has neither {dataset}.jsonl nor data/{dataset}.jsonl; "
                "unzip LongBench's data.zip there or pass the hub id THUDM/LongBench"
            )
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", str(data)) and not path.exists():  # a hub id: owner/name
        records = _load_hub(str(data), dataset)
    else:
        raise FileNotFoundError(
            f"data={str(data)!r} is not a folder; pass a folder of LongBench jsonl files or the hub id THUDM/LongBench"
        )
    for i, r in enumerate(records):
        missing = [f for f in FIELDS if f not in r]
        if missing:
            raise ValueError(f"{dataset} record {i} lacks the LongBench field(s) {missing}; expected {FIELDS}")
        if not isinstance(r["answers"], list):
            raise ValueError(f"{dataset} record {i}: 'answers' must be a list, got {type(r['answers']).__name__}")
    return records[:limit] if limit else records


def _load_hub(repo: str, dataset: str) -> list[dict]:
    import zipfile

    try:
        from huggingface_hub import hf_hub_download

        archive = hf_hub_download(repo, "data.zip", repo_type="dataset")
    except Exception as e:  # offline, no such repo, ...
        raise FileNotFoundError(
            f"could not download data.zip of the hub dataset {repo!r} ({e}); download it where "
            "the hub is reachable and pass the unzipped folder as --data"
        ) from e
    with zipfile.ZipFile(archive) as z:
        name = f"data/{dataset}.jsonl"
        if name not in z.namelist():
            raise FileNotFoundError(f"{repo}'s data.zip has no {name}")
        return [json.loads(line) for line in z.read(name).decode("utf-8").splitlines() if line.strip()]


def build_prompt(tokenizer, dataset: str, record: dict, max_length: int) -> tuple[list[int], bool, int]:
    """Token ids of the official prompt (middle-truncated to ``max_length`` tokens, chat template unless the
    dataset is in ``NO_CHAT``). Returns ``(ids, truncated, tokens before truncation)``."""
    if max_length < 2:
        raise ValueError(f"max_length={max_length} must be >= 2 tokens")
    prompt = PROMPTS[check_dataset(dataset)].format(context=record["context"], input=record["input"])
    ids = tokenizer.encode(prompt)
    n = len(ids)
    if n > max_length:
        half = max_length // 2
        prompt = tokenizer.decode(ids[:half]) + tokenizer.decode(ids[-half:])
    if dataset in NO_CHAT:
        out = tokenizer.encode(prompt)
    else:
        out = tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return out, n > max_length, n


@dataclasses.dataclass(frozen=True)
class LongBenchTask:
    """``kvjax-eval longbench``: ``samples`` examples of each dataset, one row per example (``score`` in [0, 1];
    the table shows the mean x 100 over all rows). ``max_length``: prompt tokens (default: the model's context
    minus the longest generation)."""

    data: str
    datasets: tuple[str, ...] = ("qasper", "hotpotqa", "triviaqa")
    samples: int = 8
    max_length: int | None = None
    batch: int = 1
    name = "longbench"

    def prepare(self, model):
        if model.tokenizer is None:
            raise ValueError("the LongBench task needs a model loaded with its tokenizer")
        limit = self.max_length or model.config.max_position_embeddings - max(MAX_NEW_TOKENS[d] for d in self.datasets)
        items = []
        for d in self.datasets:
            for r in load(self.data, d, self.samples):
                ids, cut, n = build_prompt(model.tokenizer, d, r, limit)
                harness.check_context(model, len(ids), MAX_NEW_TOKENS[d], "max_length")
                items.append((d, r, ids, cut, n))
        bucket = bucket_length(max(len(it[2]) for it in items)) if items else 1
        return bucket, [items[i : i + self.batch] for i in range(0, len(items), self.batch)]

    def run_batch(self, model, method, prepared, batch, meta) -> list[dict]:
        bucket = prepared[0]
        new = max(MAX_NEW_TOKENS[d] for d, *_ in batch)
        padded, real = harness.pad_batch([ids for _, _, ids, _, _ in batch], self.batch)  # fixed batch shape
        answers, mem = harness.generate_answers(model, method, padded, bucket, new, memory=True)
        rows = []
        for (d, r, ids, cut, n), text, m in zip(batch, answers[:real], mem[:real]):
            rows.append(
                {
                    **meta,
                    "dataset": d,
                    "_id": r["_id"],
                    "prompt_tokens": len(ids),
                    "truncated": cut,
                    "original_tokens": n,
                    "answer": text,
                    "score": score(d, text, r["answers"], r.get("all_classes")),
                    **m,
                }
            )
        return rows
