"""NVIDIA kvpress on the leaderboard's own contexts: its presses beside kvjax's methods in one table.

    python benchmarks/kvpress_ruler.py --torch-python /path/to/venv/bin/python \
        --out benchmarks/results/leaderboard-gemma3-270m --ratios 0.5,0.875

**Same contexts.** The contexts, questions and expected answers are those of the ``kvjax-eval leaderboard`` run in
``--out`` (its ``rows.jsonl`` settings: model, tasks, length, contexts, seed), rebuilt by kvjax and passed to the torch
side as token ids, so both sides read the same tokens.

**kvpress's own pipeline.** The torch side loads the same GGUF with transformers (float32, dequantised) and calls
kvpress's ``KVPressTextGenerationPipeline._forward`` on the token ids: the context prefilled under the press, the
question fed uncompressed, greedy answers of ``max_new_tokens`` tokens (the leaderboard's). Presses: ``SnapKVPress``,
``StreamingLLMPress``, ``ChunkKVPress(SnapKVPress())`` and ``KnormPress`` at each ``--ratios`` (kvpress's
``compression_ratio``), and no press (transformers' full cache). A press that fails on this model is recorded with its
error. Answers are scored on the kvjax side with the leaderboard's ``string_match_all``. ``<Press>-global`` (e.g.
``SnapKVPress-global``, a diagnostic): kvpress's ``PerLayerCompressionPress`` with the ratio on the global
(``full_attention``) layers and 0 on the sliding-window ones, which is what kvjax compresses on a hybrid model.

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
            key = (job["press"], job["ratio"])
            if key in failed:
                continue
            t0 = time.perf_counter()
            try:
                press = None if job["press"] == "none" else _press(job["press"], job["ratio"], model)
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
            rec.update({k: job[k] for k in ("key", "press", "ratio", "subtask", "expected", "context_index")})
            rec.update(job_key=rec.pop("key"), seconds=time.perf_counter() - t0)
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
            print(f"[kvpress] {job['key']}: {rec.get('answer', rec.get('error'))!r:.80} ({rec['seconds']:.1f}s)")


# ------------------------------------------------------------------------------------------------------- kvjax side


def _jobs(examples, presses, ratios) -> list[dict]:
    """One job per (context, press, ratio), context-major; ``none`` (no press) once per context."""
    jobs = []
    for index, e in enumerate(examples):
        for press in presses:
            for ratio in [0.0] if press == "none" else ratios:
                jobs.append(
                    {
                        "key": f"{index}|{press}|{ratio:g}",
                        "press": press,
                        "ratio": ratio,
                        "context": list(e.context),
                        "question": list(e.question),
                        "context_index": index,
                        "subtask": e.task,
                        "expected": list(e.answers),
                    }
                )
    return jobs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="the leaderboard folder (its rows.jsonl names the settings)")
    ap.add_argument("--torch-python", default=sys.executable, help="a Python with kvpress installed (its own venv)")
    ap.add_argument("--ratios", default="0.5,0.875", help="kvpress compression ratios")
    ap.add_argument("--presses", default=",".join(PRESSES), help="kvpress presses ('none': no press)")
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
    settings = leaderboard.read_settings(out)
    board = leaderboard.board_of(settings)
    model = kvjax.load_model(board.model)
    _, prepared = leaderboard.fit_contexts(model, board)
    examples = [e for b in prepared[1] for e in b][: a.contexts]
    ratios = [float(r) for r in a.ratios.split(",") if r.strip()]
    presses = [p.strip() for p in a.presses.split(",") if p.strip()]
    done = {r["job_key"] for r in leaderboard.read_jsonl(out / leaderboard.PEER_ROWS)}
    jobs = [j for j in _jobs(examples, presses, ratios) if j["key"] not in done]
    from kvjax.loading import assets

    gguf = assets.gemma3_270m_gguf_path() if board.model == assets.GEMMA3_270M_NAME else Path(board.model)
    if gguf.suffix != ".gguf":
        raise ValueError(f"the leaderboard in --out ran {board.model}; this script runs kvpress on GGUF models only")
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
