"""LongBench (Bai et al., 2023; ACL 2024): the official data format, prompts, generation lengths, truncation, chat rule
and scoring, for any kvjax method.

Written from the THUDM/LongBench repository's protocol (``config/dataset2prompt.json``,
``config/dataset2maxlen.json``, ``pred.py``, ``eval.py``, ``metrics.py``):

- Data: one JSON object per line with ``input``, ``context``, ``answers`` (list), ``length``, ``dataset``,
  ``language``, ``all_classes`` (list or null) and ``_id``; read from ``DIR/<dataset>.jsonl`` or
  ``DIR/data/<dataset>.jsonl`` (the layout of the unzipped ``data.zip``), or from the Hugging Face hub when
  ``data`` is a dataset id (``THUDM/LongBench``) and the hub is reachable.
- Prompt: ``PROMPTS[dataset].format(context=..., input=...)``; when its tokens (counted with the model's
  special tokens, as ``pred.py``'s ``tokenizer(prompt)``) exceed ``max_length`` the middle is cut: the first
  and last ``max_length // 2`` tokens are decoded and joined, and every row records ``truncated``, the
  original token count and ``max_length``. The chat template is applied except for the datasets in
  ``NO_CHAT`` (few-shot and code completion, as ``pred.py``). Greedy generation of ``MAX_NEW_TOKENS[dataset]``.
- Score (``eval.py``): for trec, triviaqa, samsum, lsht the prediction is cut at its first newline; the
  example's score is the max of the dataset's metric over its answers; a dataset's score is the mean x 100
  (:func:`dataset_scores`; the report's "LongBench (%)" column is the mean over all rows, which equals the
  mean of the dataset scores when every dataset has ``samples`` examples).
- Metrics (``metrics.py``): all in ``eval.metrics`` except the Chinese ones. ROUGE-L is
  ``metrics.rouge_l_longbench``: the ``rouge`` package (as the official scorer) when installed, otherwise a
  re-implementation of its summary-level ROUGE-L written here because the package is missing (identical
  except that the package's recursive LCS fails -- and LongBench scores 0 -- on ~1000-word sentences).
  Classification keeps the official remove-while-iterating loop. Code similarity is ``fuzz.ratio / 100``:
  fuzzywuzzy when installed, otherwise ``difflib.SequenceMatcher`` with fuzz.ratio's rules (equal 100, one
  empty 0, integer rounding) -- fuzzywuzzy's own pure-Python path; fuzzywuzzy with python-Levenshtein uses
  the InDel ratio instead, which can differ by a few points. qa-F1 zh and ROUGE zh tokenise with ``jieba``
  (an ImportError naming it when missing). ``LongBenchTask.describe()`` records which backends scored.
- LongBench-E: ``<name>_e`` datasets (``E_DATASETS``) use ``<name>``'s prompt, length and metric;
  :func:`length_bucket` gives ``eval.py``'s 0-4k / 4-8k / 8k+ buckets.
- Generation differences from ``pred.py``: samsum's extra stop at a newline is not applied (the first-line
  rule makes the scored text identical, only generation runs longer), and ``max_new_tokens`` can be
  overridden for smoke runs (recorded in every row).
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

_QA_PASSAGES = ("Answer the question based on the given passages. Only give me the answer and do not output any "
                "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
                "given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\n"
                "Answer:")
_QASPER_RULE = ("Answer the question as concisely as you can, using a single phrase or sentence if possible. If the "
                "question cannot be answered based on the information in the article, write \"unanswerable\". If the "
                "question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any "
                "explanation.")

#: The official prompt templates (config/dataset2prompt.json).
PROMPTS: dict[str, str] = {
    "narrativeqa": ("You are given a story, which can be either a novel or a movie script, and a question. Answer the "
                    "question asconcisely as you can, using a single phrase if possible. Do not provide any "
                    "explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as "
                    "you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: "
                    "{input}\n\nAnswer:"),
    "qasper": ("You are given a scientific article and a question. " + _QASPER_RULE + "\n\nArticle: {context}\n\n "
               "Answer the question based on the above article as concisely as you can, using a single phrase or "
               "sentence if possible. If the question cannot be answered based on the information in the article, "
               "write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or "
               "\"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"),
    "multifieldqa_en": ("Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question "
                        "based on the above text, only give me the answer and do not output any other words.\n\n"
                        "Question: {input}\nAnswer:"),
    "multifieldqa_zh": ("阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。"
                        "\n\n问题：{input}\n回答："),
    "hotpotqa": _QA_PASSAGES,
    "2wikimqa": _QA_PASSAGES,
    "musique": _QA_PASSAGES,
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": ("You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
                   "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"),
    "qmsum": ("You are given a meeting transcript and a query containing a question or instruction. Answer the query in "
              "one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
              "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"),
    "multi_news": ("You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
                   "Now, write a one-page summary of all the news.\n\nSummary:"),
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": ("Answer the question based on the given passage. Only give me the answer and do not output any other "
                 "words. The following are some examples.\n\n{context}\n\n{input}"),
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": ("There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
                      "carefully read these paragraphs and determine how many unique paragraphs there are after "
                      "removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n"
                      "{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The "
                      "output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer "
                      "is: "),
    "passage_retrieval_en": ("Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which "
                             "paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\n"
                             "Please enter the number of the paragraph that the abstract is from. The answer format "
                             "must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: "),
    "passage_retrieval_zh": ("以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n"
                             "请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式\n\n答案是："),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

#: Maximum generated tokens per dataset (config/dataset2maxlen.json).
MAX_NEW_TOKENS: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32,
    "2wikimqa": 32, "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512,
    "vcsum": 512, "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32,
    "passage_retrieval_en": 32, "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
}

#: Datasets prompted without the chat template (pred.py: few-shot and code completion).
NO_CHAT = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
#: Datasets whose prediction is cut at its first newline before scoring (eval.py).
FIRST_LINE = frozenset({"trec", "triviaqa", "samsum", "lsht"})
#: LongBench-E (length-balanced subsets, ``<name>_e.jsonl``).
E_DATASETS = ("qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa",
              "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p")
FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")


def _jieba():
    try:
        import jieba
    except ImportError as e:
        raise ImportError("the Chinese LongBench metrics tokenise with jieba: `pip install jieba`") from e
    return jieba


_ZH_PUNCT = set("！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏.")


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
    """LongBench ``rouge_zh_score``: ROUGE-L (``metrics.rouge_l_longbench``) over jieba tokens joined by spaces."""
    jieba = _jieba()
    return metrics.rouge_l_longbench(" ".join(jieba.cut(prediction, cut_all=False)),
                                     " ".join(jieba.cut(truth, cut_all=False)))


def retrieval_zh(prediction: str, truth: str) -> float:
    """LongBench ``retrieval_zh_score``: truth ``"段落N"``; the fraction of numbers in the prediction equal to N."""
    found = re.findall(r"段落(\d+)", truth)
    if not found:
        raise ValueError(f"truth={truth!r} is not of the form '段落N'")
    numbers = re.findall(r"\d+", prediction)
    return sum(n == found[0] for n in numbers) / len(numbers) if numbers else 0.0


#: dataset -> metric(prediction, truth, all_classes) (eval.py's dataset2metric).
METRICS: dict[str, Any] = {
    **{d: lambda p, t, c: metrics.qa_f1(p, t) for d in ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa",
                                                        "2wikimqa", "musique", "triviaqa")},
    **{d: lambda p, t, c: qa_f1_zh(p, t) for d in ("multifieldqa_zh",)},
    **{d: lambda p, t, c: metrics.rouge_l_longbench(p, t) for d in ("gov_report", "qmsum", "multi_news", "samsum")},
    **{d: lambda p, t, c: rouge_zh(p, t) for d in ("dureader", "vcsum")},
    "trec": lambda p, t, c: metrics.classification(p, t, c),
    "lsht": lambda p, t, c: metrics.classification(p, t, c),
    "passage_retrieval_en": lambda p, t, c: metrics.retrieval_score(p, t),
    "passage_retrieval_zh": lambda p, t, c: retrieval_zh(p, t),
    "passage_count": lambda p, t, c: metrics.count_score(p, t),
    "lcc": lambda p, t, c: metrics.code_similarity(p, t),
    "repobench-p": lambda p, t, c: metrics.code_similarity(p, t),
}
#: dataset -> name of its official metric function (for rows and docs).
METRIC_NAMES: dict[str, str] = {
    **dict.fromkeys(("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa"),
                    "qa_f1_score"),
    "multifieldqa_zh": "qa_f1_zh_score",
    **dict.fromkeys(("gov_report", "qmsum", "multi_news", "samsum"), "rouge_score"),
    **dict.fromkeys(("dureader", "vcsum"), "rouge_zh_score"), "trec": "classification_score",
    "lsht": "classification_score", "passage_retrieval_en": "retrieval_score",
    "passage_retrieval_zh": "retrieval_zh_score", "passage_count": "count_score", "lcc": "code_sim_score",
    "repobench-p": "code_sim_score",
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


def _parse_jsonl(text: str, where: str) -> list[dict]:
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} line {n} is not valid JSON ({e.msg}); LongBench files hold one JSON "
                             "object per line") from e
    return records


def validate(records: list, dataset: str, where: str) -> list[dict]:
    """Every record is an object with ``FIELDS``: ``input``/``context`` strings, ``answers`` a non-empty list of
    strings, ``all_classes`` a list of strings (non-empty for trec and lsht) or null. A ValueError names the
    file, the line's record index and the field otherwise."""
    for i, r in enumerate(records):
        at = f"{where} record {i}"
        if not isinstance(r, dict):
            raise ValueError(f"{at} is a {type(r).__name__}, not a JSON object")
        missing = [f for f in FIELDS if f not in r]
        if missing:
            raise ValueError(f"{at} lacks the LongBench field(s) {missing}; expected {list(FIELDS)}")
        for f in ("input", "context"):
            if not isinstance(r[f], str):
                raise ValueError(f"{at}: {f!r} must be a string, got {type(r[f]).__name__}")
        answers = r["answers"]
        if not isinstance(answers, list) or not answers or not all(isinstance(x, str) for x in answers):
            raise ValueError(f"{at}: 'answers' must be a non-empty list of strings, got {answers!r:.80}")
        classes = r["all_classes"]
        if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
            raise ValueError(f"{at}: 'all_classes' must be a list of strings or null, got {classes!r:.80}")
        if base_dataset(dataset) in ("trec", "lsht") and not classes:
            raise ValueError(f"{at}: {dataset} is scored by class match and needs a non-empty 'all_classes'")
    return records


def load(data: str | Path, dataset: str, limit: int | None = None) -> list[dict]:
    """Examples of ``dataset`` from a local folder (``<dataset>.jsonl`` or ``data/<dataset>.jsonl``) or a hub
    dataset id (e.g. ``THUDM/LongBench``: its ``data.zip`` through ``huggingface_hub``); the first ``limit``
    if given. Records are checked by :func:`validate`. No fallback: a folder without the file, or a hub id
    that cannot be reached, is an error naming ``data``."""
    check_dataset(dataset)
    if limit is not None and limit < 1:
        raise ValueError(f"samples={limit} must be >= 1")
    path = Path(data)
    if path.is_dir():
        for cand in (path / f"{dataset}.jsonl", path / "data" / f"{dataset}.jsonl"):
            if cand.is_file():
                where = str(cand)
                records = _parse_jsonl(cand.read_text(encoding="utf-8"), where)
                break
        else:
            raise FileNotFoundError(f"data={str(data)!r} has neither {dataset}.jsonl nor data/{dataset}.jsonl; "
                                    "unzip LongBench's data.zip there or pass the hub id THUDM/LongBench")
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", str(data)) and not path.exists():  # owner/name: a hub id
        where = f"{data}:data/{dataset}.jsonl"
        records = _load_hub(str(data), dataset)
    else:
        raise FileNotFoundError(f"data={str(data)!r} is not a folder; pass a folder of LongBench jsonl files or "
                                "the hub id THUDM/LongBench")
    records = validate(records, dataset, where)
    return records[:limit] if limit else records


def _load_hub(repo: str, dataset: str) -> list[dict]:
    import zipfile

    try:
        from huggingface_hub import hf_hub_download
    except ImportError as e:
        raise FileNotFoundError(f"data={repo!r} is not a local folder, and reading it as a hub dataset needs "
                                "huggingface_hub (`pip install huggingface_hub`); or pass a folder") from e
    try:
        archive = hf_hub_download(repo, "data.zip", repo_type="dataset")
    except Exception as e:  # offline, no such repo, no data.zip, ...
        raise FileNotFoundError(f"data={repo!r} is not a local folder, and we could not download data.zip of the "
                                f"hub dataset {repo!r} ({type(e).__name__}: {e}); download THUDM/LongBench's data.zip "
                                "where the hub is reachable and pass the unzipped folder as --data") from e
    with zipfile.ZipFile(archive) as z:
        name = f"data/{dataset}.jsonl"
        if name not in z.namelist():
            raise FileNotFoundError(f"data={repo!r}: its data.zip has no {name}")
        return _parse_jsonl(z.read(name).decode("utf-8"), f"{repo}:{name}")


def format_prompt(dataset: str, record: dict) -> str:
    """The official prompt text: ``PROMPTS[dataset]`` filled with the record's ``context`` and ``input``."""
    return PROMPTS[base_dataset(dataset)].format(context=record["context"], input=record["input"])


def uses_chat(dataset: str) -> bool:
    """``pred.py``: the chat template is applied to every dataset except those in ``NO_CHAT``."""
    return base_dataset(dataset) not in NO_CHAT


def truncate_middle(tokenizer, prompt: str, max_length: int) -> tuple[str, bool, int]:
    """``pred.py``'s truncation: tokenise ``prompt`` (with special tokens, as ``tokenizer(prompt)``); over
    ``max_length`` tokens, keep the first and last ``max_length // 2`` and decode each half (special tokens
    skipped) and join them. Returns ``(prompt, truncated, tokens before truncation)``."""
    if max_length < 2:
        raise ValueError(f"max_length={max_length} must be >= 2 tokens")
    ids = tokenizer.encode(prompt, add_special_tokens=True)
    n = len(ids)
    if n <= max_length:
        return prompt, False, n
    half = max_length // 2
    return tokenizer.decode(ids[:half]) + tokenizer.decode(ids[-half:]), True, n


def build_prompt(tokenizer, dataset: str, record: dict, max_length: int) -> tuple[list[int], bool, int]:
    """Token ids of the official prompt: :func:`format_prompt`, :func:`truncate_middle` to ``max_length``,
    then the chat template (``tokenizer.encode_chat``) unless the dataset is in ``NO_CHAT``, where the text is
    encoded with the model's special tokens (BOS) as ``pred.py`` does. Returns ``(ids, truncated, tokens
    before truncation)``; the chat template may add a few tokens beyond ``max_length``, as in ``pred.py``."""
    prompt, cut, n = truncate_middle(tokenizer, format_prompt(dataset, record), max_length)
    if uses_chat(dataset):
        return tokenizer.encode_chat([{"role": "user", "content": prompt}]), cut, n
    return tokenizer.encode(prompt, add_special_tokens=True), cut, n


def default_max_length(model, datasets: Sequence[str], max_new_tokens: int | None = None) -> int:
    """Prompt tokens before truncation when none is given: the model's context minus the longest generation of
    ``datasets``, the chat template's own tokens (an empty user turn) and 16 tokens for re-tokenising the two
    decoded halves (LongBench's ``model2maxlen`` plays this role, e.g. 3500 for 4k-context models)."""
    new = max_new_tokens or max(MAX_NEW_TOKENS[base_dataset(d)] for d in datasets)
    chat = (len(model.tokenizer.encode_chat([{"role": "user", "content": ""}]))
            if any(uses_chat(d) for d in datasets) else 0)
    limit = model.config.max_position_embeddings - new - chat - 16
    if limit < 2:
        raise ValueError(f"the model's context ({model.config.max_position_embeddings} tokens) leaves no room for a "
                         f"LongBench prompt after {new} generated tokens; pass max_length explicitly")
    return limit


def dataset_scores(rows: Sequence[dict]) -> dict[tuple[str, float | None], dict[str, float]]:
    """``eval.py``'s table: per (method, budget), each dataset's mean score x 100 rounded to 2 decimals, and
    ``"average"`` (the mean of the dataset scores, as LongBench's overall)."""
    groups: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        if r.get("task") == "longbench":
            groups.setdefault((r["method"], r["budget"]), {}).setdefault(r["dataset"], []).append(r["score"])
    out = {}
    for key, by in groups.items():
        table = {d: round(100 * sum(v) / len(v), 2) for d, v in by.items()}
        table["average"] = round(sum(table.values()) / len(table), 2)
        out[key] = table
    return out


def dataset_table(rows: Sequence[dict]) -> str:
    """:func:`dataset_scores` as a markdown table (one row per method and budget, one column per dataset)."""
    scores = dataset_scores(rows)
    if not scores:
        return ""
    cols = list(dict.fromkeys(d for t in scores.values() for d in t if d != "average")) + ["average"]
    lines = ["| method | budget | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for (m, b), t in scores.items():
        cells = [f"{t[c]:.2f}" if c in t else "-" for c in cols]
        lines.append(f"| {m} | {'full' if b is None else f'{b:g}'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class LongBenchTask:
    """``kvjax-eval longbench``: the first ``samples`` examples of each dataset, one row per example (``score``
    in [0, 1]; the report shows the mean x 100). Batches never mix datasets (each generates its own
    ``MAX_NEW_TOKENS``) and are padded to ``batch`` so every batch of a dataset shares compiled shapes.
    ``max_length``: prompt tokens before middle truncation (default :func:`default_max_length`).
    ``max_new_tokens``: overrides the official generation lengths (smoke runs only; recorded per row)."""

    data: str
    datasets: tuple[str, ...] = ("qasper", "hotpotqa", "triviaqa")
    samples: int = 8
    max_length: int | None = None
    batch: int = 1
    max_new_tokens: int | None = None
    name = "longbench"

    def describe(self) -> dict:
        """Recorded in the results' config: which scorer backends ran (``metrics.backends()``)."""
        return {"scorer": metrics.backends()}

    def new_tokens(self, dataset: str) -> int:
        return self.max_new_tokens or MAX_NEW_TOKENS[base_dataset(dataset)]

    def prepare(self, model):
        if model.tokenizer is None:
            raise ValueError("the LongBench task needs a model loaded with its tokenizer")
        if not self.datasets:
            raise ValueError("datasets is empty; pass e.g. --datasets qasper,hotpotqa")
        if self.batch < 1 or (self.max_new_tokens is not None and self.max_new_tokens < 1):
            raise ValueError(f"batch={self.batch} and max_new_tokens={self.max_new_tokens} must be >= 1")
        for d in self.datasets:
            check_dataset(d)
        limit = self.max_length or default_max_length(model, self.datasets, self.max_new_tokens)
        batches, longest = [], 1
        for d in self.datasets:
            items = []
            for r in load(self.data, d, self.samples):
                ids, cut, n = build_prompt(model.tokenizer, d, r, limit)
                harness.check_context(model, len(ids), self.new_tokens(d), "max_length")
                items.append({"dataset": d, "record": r, "ids": ids, "truncated": cut, "original_tokens": n,
                              "max_length": limit})
                longest = max(longest, len(ids))
            batches += [items[i: i + self.batch] for i in range(0, len(items), self.batch)]
        return bucket_length(longest), batches

    def run_batch(self, model, method, prepared, batch, meta) -> list[dict]:
        bucket = prepared[0]
        d = batch[0]["dataset"]
        padded, real = harness.pad_batch([it["ids"] for it in batch], self.batch)
        answers = harness.generate_answers(model, method, padded, bucket, self.new_tokens(d))[:real]
        rows = []
        for it, text in zip(batch, answers):
            r = it["record"]
            rows.append({**meta, "dataset": d, "_id": r["_id"], "language": r["language"], "length": r["length"],
                         "prompt_tokens": len(it["ids"]), "original_tokens": it["original_tokens"],
                         "truncated": it["truncated"], "max_length": it["max_length"],
                         "length_bucket": length_bucket(r["length"]),
                         "max_new_tokens": self.new_tokens(d), "chat": uses_chat(d),
                         "metric": METRIC_NAMES[base_dataset(d)],
                         "answer": text, "score": score(d, text, r["answers"], r["all_classes"])})
        return rows
