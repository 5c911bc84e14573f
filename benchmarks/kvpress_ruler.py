"""NVIDIA kvpress on the leaderboard's own contexts: its presses beside kvjax's methods in one table.

    python benchmarks/kvpress_ruler.py --torch-python /path/to/venv/bin/python \
        --out benchmarks/results/leaderboard-gemma3-270m --ratios 0.5,0.875 \
        --protocol question-after-context,question-in-context

**Same contexts.** The contexts, questions and expected answers are those of the ``kvjax-eval leaderboard`` run in
``--out`` (its ``rows.jsonl`` settings: model, tasks, length, contexts, seed), rebuilt by kvjax and passed to the torch
side as token ids, so both sides read the same tokens.

**kvpress's own pipeline.** The torch side loads the same GGUF with transformers (float32, dequantised) and calls
kvpress's ``KVPressTextGenerationPipeline._forward`` on the token ids: the context prefilled under the press, the
question fed uncompressed, greedy answers of ``max_new_tokens`` tokens (the leaderboard's). **The papers' protocol**
(``--protocol question-in-context``, the leaderboard's rows of the same name): the whole prompt (context, question,
answer prefix) is prefilled under the press as one forward pass, the first answer token taken from that pass's
logits (full attention, as kvpress's hooks compress each layer's cache after it attends) and the rest decoded greedily
on the compressed cache at the prompt's positions, as the pipeline's ``generate_answer`` does
(:func:`generate_in_context`); kvjax's in-context rows do the same. Presses: ``SnapKVPress``,
``StreamingLLMPress``, ``ChunkKVPress(SnapKVPress())`` and ``KnormPress`` at each ``--ratios`` (kvpress's
``compression_ratio``), and no press (transformers' full cache). A press that fails on this model is recorded with its
error. Answers are scored on the kvjax side with the leaderboard's ``string_match_all``. ``<Press>-global`` (e.g.
``SnapKVPress-global``, a diagnostic): kvpress's ``PerLayerCompressionPress`` with the ratio on the global
(``full_attention``) layers and 0 on the sliding-window ones, which is what kvjax compresses on a hybrid model.

**Agreement.** The leaderboard's table then counts, per method both run (kvjax ``full``/``snapkv``/
``streaming_llm``/``chunkkv`` beside transformers' full cache and kvpress's ``SnapKVPress``/``StreamingLLMPress``/
``ChunkKVPress``), ratio and protocol, the contexts whose answers are identical (:func:`eval.leaderboard.agreement`).

**Order and resume.** Context-major (each context under every press before the next context), so a run stopped early
has the same contexts in every cell; every answer is appended to ``kvpress.jsonl`` in ``--out`` and a rerun skips
those. ``kvjax-eval leaderboard`` (or this script when it ends) merges them into ``leaderboard.json/.md/.png`` as
methods named ``kvpress <Press>``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESSES = ("none", "SnapKVPress", "StreamingLLMPress", "ChunkKVPress", "KnormPress")
AFTER, IN_CONTEXT = "question-after-context", "question-in-context"  # eval.leaderboard's protocols


# ------------------------------------------------------------------------------------------------------- torch side


def _press(name: str, ratio: float, model):
    import kvpress

    if name == "ChunkKVPress":  # ChunkKV's paper scores chunks with SnapKV's observation window
        return kvpress.ChunkKVPress(press=kvpress.SnapKVPress(compression_ratio=ratio))
    if name.endswith("-global"):  # the diagnostic: compress the global layers only, as kvjax does on a hybrid model
        kinds = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
        ratios = [ratio if kind == "full_attention" else 0.0 for kind in kinds]
        return kvpress.PerLayerCompressionPress(getattr(kvpress, name[: -len("-global")])(), compression_ratios=ratios)
    return getattr(kvpress, name)(compression_ratio=ratio)


def generate_in_context(model, tokenizer, prompt_ids, max_new_tokens: int, press=None) -> str:
    """The papers' protocol on the torch side: ``prompt_ids`` (``[1, T]``: context, question, answer prefix) prefilled
    in one pass under ``press`` (a kvpress press, or None for the full cache), the first token from that pass's
    last logits, then greedy decoding on the compressed cache at positions ``T, T + 1, ...`` outside the press,
    stopping at the model's end-of-sequence token (kvpress's ``generate_answer``)."""
    import contextlib

    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    length = prompt_ids.shape[1]
    with press(model) if press is not None else contextlib.nullcontext():
        logits = model(input_ids=prompt_ids, past_key_values=cache, logits_to_keep=1).logits
    ids = [logits[0, -1].argmax()]
    stop = model.generation_config.eos_token_id
    stop = set(stop if isinstance(stop, list) else [stop])
    for i in range(max_new_tokens - 1):
        if ids[-1].item() in stop:
            break
        out = model(input_ids=ids[-1].view(1, 1), past_key_values=cache, position_ids=torch.tensor([[length + i]]))
        ids.append(out.logits[0, -1].argmax())
    return str(tokenizer.decode(torch.stack(ids), skip_special_tokens=True))


def torch_side(a) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    import kvpress  # noqa: F401  (registers the kv-press-text-generation pipeline)

    torch.set_num_threads(a.threads)
    work = json.loads(Path(a.work).read_text())
    gguf = Path(work["gguf"])
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    out = Path(a.rows)
    failed = set()
    with torch.inference_mode(), out.open("a", encoding="utf-8") as f:
        for job in work["jobs"]:
            key = (job["press"], job["ratio"], job.get("protocol", AFTER))
            if key in failed:
                continue
            t0 = time.perf_counter()
            try:
                press = None if job["press"] == "none" else _press(job["press"], job["ratio"], model)
                if job.get("protocol", AFTER) == IN_CONTEXT:
                    prompt = torch.tensor([job["context"] + job["question"]])
                    answer = generate_in_context(model, tok, prompt, work["max_new_tokens"], press)
                else:
                    answer = pipe._forward(
                        {
                            "context_ids": torch.tensor([job["context"]]),
                            "questions_ids": [torch.tensor([job["question"]])],
                        },
                        max_new_tokens=work["max_new_tokens"],
                        press=press,
                    )[0]
                rec = {"answer": answer}
            except Exception as e:  # a press this model cannot run: recorded once, with its error
                failed.add(key)
                rec = {"error": f"{type(e).__name__}: {e}"}
            rec.update(
                {k: job[k] for k in ("key", "press", "ratio", "protocol", "subtask", "expected", "context_index")}
            )
            rec.update(job_key=rec.pop("key"), seconds=time.perf_counter() - t0)
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
            print(f"[kvpress] {job['key']}: {rec.get('answer', rec.get('error'))!r:.80} ({rec['seconds']:.1f}s)")


# ------------------------------------------------------------------------------------------------------- kvjax side


def _jobs(examples, presses, ratios, protocol: str = AFTER) -> list[dict]:
    """One job per (context, press, ratio), context-major; ``none`` (no press) once per context. ``examples``: the
    leaderboard's contexts in ``protocol`` (in the papers' protocol each context holds its question; the key then
    says so, and a folder's earlier keys keep their meaning)."""
    jobs = []
    tag = "" if protocol == AFTER else f"|{protocol}"
    for index, e in enumerate(examples):
        for press in presses:
            for ratio in [0.0] if press == "none" else ratios:
                jobs.append(
                    {
                        "key": f"{index}|{press}|{ratio:g}{tag}",
                        "press": press,
                        "ratio": ratio,
                        "protocol": protocol,
                        "context": list(e.context),
                        "question": list(e.question),
                        "context_index": index,
                        "subtask": e.task,
                        "expected": list(e.answers),
                    }
                )
    return jobs


def gguf_of(model_name: str) -> Path:
    """The GGUF file the torch side loads for the leaderboard's ``model`` (an embedded model's name or a path)."""
    from kvjax.loading import assets

    embedded = {assets.GEMMA3_270M_NAME: assets.gemma3_270m_gguf_path, assets.SMOLLM2_NAME: assets.smollm2_gguf_path}
    path = embedded[model_name]() if model_name in embedded else Path(model_name)
    if path.suffix != ".gguf":
        raise ValueError(f"the leaderboard in --out ran {model_name}; this script runs kvpress on GGUF models only")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="the leaderboard folder (its rows.jsonl names the settings)")
    ap.add_argument("--torch-python", default=sys.executable, help="a Python with kvpress installed (its own venv)")
    ap.add_argument("--ratios", default="0.5,0.875", help="kvpress compression ratios")
    ap.add_argument("--presses", default=",".join(PRESSES), help="kvpress presses ('none': no press)")
    ap.add_argument(
        "--protocol",
        default=AFTER,
        help=f"comma-separated: {AFTER} (kvpress's pipeline) and/or {IN_CONTEXT} (the papers': the question "
        "compressed with the context)",
    )
    ap.add_argument("--contexts", type=int, default=None, help="only the first N contexts (in the leaderboard's order)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rows", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.mode == "torch":
        torch_side(a)
        return 0

    import kvjax
    from eval import leaderboard

    out = Path(a.out)
    protocols = [p.strip() for p in a.protocol.split(",") if p.strip()]
    if not protocols or set(protocols) - {AFTER, IN_CONTEXT}:
        raise ValueError(f"--protocol {a.protocol!r}: use {AFTER} and/or {IN_CONTEXT}, comma-separated")
    settings = leaderboard.read_settings(out)
    board = leaderboard.board_of(settings)
    gguf = gguf_of(board.model)
    model = kvjax.load_model(board.model)
    ratios = [float(r) for r in a.ratios.split(",") if r.strip()]
    presses = [p.strip() for p in a.presses.split(",") if p.strip()]
    done = {r["job_key"] for r in leaderboard.read_jsonl(out / leaderboard.PEER_ROWS)}
    jobs = []
    for protocol in protocols:
        _, prepared = leaderboard.fit_contexts(model, board, protocol)
        examples = [e for b in prepared[1] for e in b][: a.contexts]
        jobs += [j for j in _jobs(examples, presses, ratios, protocol) if j["key"] not in done]
    jobs.sort(key=lambda j: j["context_index"])  # context-major across the protocols too (a stable sort)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "work.json"
        work.write_text(json.dumps({"gguf": str(gguf), "max_new_tokens": board.max_new_tokens, "jobs": jobs}))
        cmd = [a.torch_python, __file__, "--mode", "torch", "--out", str(out), "--work", str(work)]
        cmd += ["--rows", str(out / leaderboard.PEER_ROWS), "--threads", str(a.threads)]
        print(f"[kvpress_ruler] {len(jobs)} answers to run ({len(done)} done)", flush=True)
        subprocess.run(cmd, check=True)
    if (out / "leaderboard.json").is_file():  # else the leaderboard run merges them when it ends
        leaderboard.rewrite(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
