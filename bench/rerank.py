"""Timing: a cross-encoder's ``LLM.score`` (one query against many documents) against transformers.

What it measures: the wall time to score one query against ``--docs`` documents with a
cross-encoder, each pair read as one prompt (the tokenizer's pair encoding), by these
systems in the same run:

- ``tinyvllm``: ``LLM.score(query, documents)`` (the default engine: prefix caching on,
  token budget 8,192);
- ``tinyvllm_no_prefix_cache``: the same with ``enable_prefix_caching=False``;
- ``hf_batched``: transformers' ``AutoModelForSequenceClassification``, the pairs sorted by
  length and run in right-padded batches of ``--hf-batch`` (32, sentence-transformers'
  ``CrossEncoder`` default), each pair's last real token's logit through a sigmoid;
- ``hf_per_pair``: the same model, one pair at a time, no padding.

The model: the shipped model's decoder (Qwen3 shapes, 6 layers, hidden 256) with a seeded
random one-label ``score`` head, written as a ``Qwen3ForSequenceClassification`` folder in a
temporary directory: the timings depend on the shapes, not on what the head learned. The
query is an instruction of about 45 tokens and a question, as rerankers built on LLMs take
it; every pair starts with it, so the prefix cache finds its full blocks for every pair
after the first, and the LAST pooling reads them (``pooling_params.py`` NOTE 4).

Each engine run scores a query with a suffix of its own (``run-N``), so it finds nothing
cached by the run before, only what its own pairs share. Each system gets one warm-up, then
``--repeats`` (5) interleaved rounds; the record holds every time, the medians, the ratios
``X_over_tinyvllm`` (above 1: tinyvllm is faster), the prompt tokens the engine found per
run, and the largest difference of any score from transformers' per-pair one.

Run: ``python bench/rerank.py`` (about a minute on two threads) writes
``bench/results/rerank.json``; ``--threads N`` sets torch's threads (2 by default). ``--quick``
scores 6 documents, one round (the test suite runs it; its timings mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embeddings import texts  # noqa: E402
from harness import ROOT, interleaved_rounds, median, run_header, set_threads, write_json  # noqa: E402
from tinyvllm import LLM  # noqa: E402
from tinyvllm.stdlib_tiny import STDLIB_TINY  # noqa: E402

QUERY = (
    "Instruct: Given a question about Python, judge whether the document, a fragment of source code, "
    "answers it.\nQuery: how does the JSON decoder turn a string into Python objects?\nDocument: "
)


def cross_encoder_folder(root: Path) -> Path:
    """The shipped model as a one-label ``Qwen3ForSequenceClassification``: its config with the
    architecture and one label, its weights plus a seeded ``score.weight``, its tokenizer."""
    from safetensors.torch import load_file, save_file

    folder = root / "stdlib-cross-encoder"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(STDLIB_TINY) / name, folder / name)
    config = json.loads((Path(STDLIB_TINY) / "config.json").read_text())
    config |= {"architectures": ["Qwen3ForSequenceClassification"], "id2label": {"0": "LABEL_0"},
               "label2id": {"LABEL_0": 0}, "pad_token_id": config.get("eos_token_id")}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(Path(STDLIB_TINY) / "model.safetensors")
    score = torch.randn(1, config["hidden_size"], generator=torch.Generator().manual_seed(0)) * 0.05
    save_file({**tensors, "score.weight": score}, folder / "model.safetensors")
    return folder


def hf_scores(model, tokenizer, query: str, docs: list[str], batch: int | None) -> list[float]:
    """transformers' sigmoid scores: per pair (``batch`` None) or in length-sorted padded batches
    (right padding; the model takes each row's last non-pad token, as it does for one row)."""
    out: list[float | None] = [None] * len(docs)
    with torch.no_grad():
        if batch is None:
            for i, doc in enumerate(docs):
                enc = tokenizer(query, text_pair=doc, return_tensors="pt")
                out[i] = torch.sigmoid(model(enc.input_ids).logits[0, 0]).item()
        else:
            order = sorted(range(len(docs)), key=lambda i: len(docs[i]))
            tokenizer.padding_side = "right"
            for k in range(0, len(order), batch):
                rows = order[k : k + batch]
                enc = tokenizer([query] * len(rows), text_pair=[docs[i] for i in rows], return_tensors="pt", padding=True)
                logits = model(**enc).logits[:, 0]  # [b]
                for j, i in enumerate(rows):
                    out[i] = torch.sigmoid(logits[j]).item()
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "rerank.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.docs, args.repeats = 6, 1
    threads = set_threads(args.threads)
    from transformers import AutoModelForSequenceClassification

    with tempfile.TemporaryDirectory() as tmp:
        folder = cross_encoder_folder(Path(tmp))
        engines = {
            "tinyvllm": LLM(str(folder), device="cpu", dtype="float32"),  # runner "auto": a classifier pools
            "tinyvllm_no_prefix_cache": LLM(str(folder), device="cpu", dtype="float32", enable_prefix_caching=False),
        }
        hf = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
        tokenizer = engines["tinyvllm"].tokenizer
    docs = texts(args.docs, tokenizer)
    runs = itertools.count()

    def score(llm: LLM) -> list[float]:
        """A query of its own each run (``run-N`` at its end: the instruction still shared), so
        nothing is found from the run before, only what this run's pairs share."""
        query = QUERY.replace("Document: ", f"Document ({next(runs)}): ")
        return [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]

    systems = {name: functools.partial(score, llm) for name, llm in engines.items()}
    systems |= {
        "hf_batched": functools.partial(hf_scores, hf, tokenizer, QUERY, docs, args.hf_batch),
        "hf_per_pair": functools.partial(hf_scores, hf, tokenizer, QUERY, docs, None),
    }
    scores, times, cache = interleaved_rounds(systems, engines, args.repeats)  # the warm-up's scores compared
    reference = hf_scores(hf, tokenizer, QUERY.replace("Document: ", "Document (0): "), docs, None)
    medians = {name: median(values) for name, values in times.items()}
    record = {
        "benchmark": "rerank",
        "quick": args.quick,
        **run_header("rerank.py", argv),
        "threads": threads,
        "model": "stdlib_tiny's decoder with a seeded one-label score head (Qwen3ForSequenceClassification)",
        "num_docs": len(docs),
        "pair_tokens": sum(len(tokenizer(QUERY, text_pair=d).input_ids) for d in docs),
        "query_tokens": len(tokenizer(QUERY).input_ids),
        "repeats": args.repeats,
        "hf_batch": args.hf_batch,
        "seconds": times,
        "median_s": medians,
        "ratios": {f"{name}_over_tinyvllm": round(medians[name] / medians["tinyvllm"], 3) for name in systems
                   if name != "tinyvllm"},  # fmt: skip
        "prefix_cache_per_run": cache,
        "max_abs_diff_from_hf_per_pair": {
            "tinyvllm": max(abs(a - b) for a, b in zip(scores["tinyvllm"], reference)),
            "hf_batched": max(abs(a - b) for a, b in zip(scores["hf_batched"], scores["hf_per_pair"])),
        },
    }
    write_json(args.out, record)
    return record


if __name__ == "__main__":
    main()
