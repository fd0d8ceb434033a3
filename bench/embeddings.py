"""Timing: ``LLM(runner="pooling").embed`` against transformers' base model, on the shipped model.

What it measures: the wall time to embed a batch of prompts (LAST pooling, normalised: the
pooling engine's default), by these systems in the same run:

- ``tinyvllm``: ``LLM.embed`` over all the prompts at once (the default engine: prefix
  caching on, token budget 8,192);
- ``tinyvllm_no_prefix_cache``: the same with ``enable_prefix_caching=False``;
- ``hf_batched``: transformers' ``AutoModel`` (the decoder without its LM head), prompts
  sorted by length and run in padded batches of ``--hf-batch`` (32, sentence-transformers'
  default batch size; sorting is what it does to pad less), the last real token's state
  taken and normalised;
- ``hf_per_prompt``: the same model, one prompt at a time, no padding.

Two workloads: ``plain``, chunks of standard-library source of 10 to 160 tokens, nothing
shared; and ``instruction``, the same texts each behind one instruction prefix of about 45
tokens, as embedding models built on LLMs ask of their queries (Qwen3-Embedding's "Instruct:
... Query: ..."). There the prefix cache finds the instruction's full blocks for every
prompt after the first, and a LAST pooling reads them (``pooling_params.py`` NOTE 4).

Each engine run has a ``cache_salt`` of its own, so it finds nothing cached by the run before
(the same prompts again would be found whole): only what its own prompts share. Each system
gets one warm-up, then ``--repeats`` (5) interleaved rounds; the record holds
every time, the medians, the ratios ``X_over_tinyvllm`` (above 1: tinyvllm is faster), the
prompt tokens the engine found in its prefix cache per run, and the largest difference of
any vector from transformers' per-prompt one (they must agree to float32 rounding).

Run: ``python bench/embeddings.py`` (about a minute on two threads) writes
``bench/results/embeddings.json``; ``--threads N`` sets torch's threads (2 by default, the
machine's cores). ``--quick`` runs 6 prompts, one round (the test suite runs it; its
timings mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, interleaved_rounds, median, run_header, set_threads, write_json  # noqa: E402
from tinyvllm import LLM  # noqa: E402
from tinyvllm.stdlib_tiny import STDLIB_TINY  # noqa: E402

INSTRUCTION = (
    "Instruct: Given a fragment of Python source code, retrieve the documentation page, tutorial or "
    "other source files that explain what this code does and how it is used.\nQuery: "
)


def texts(n: int, tokenizer) -> list[str]:
    """``n`` chunks of standard-library source, 10 to 160 tokens, lengths spread evenly."""
    source = (Path(json.__file__).parent / "decoder.py").read_text() + (Path(json.__file__).parent / "encoder.py").read_text()
    ids = tokenizer(source).input_ids
    out, start = [], 0
    for i in range(n):
        length = 10 + (150 * i) // max(n - 1, 1)
        out.append(tokenizer.decode(ids[start : start + length]))
        start = (start + length) % max(len(ids) - 200, 1)
    return out


def hf_embed(model, tokenizer, prompts: list[str], batch: int | None) -> list[torch.Tensor]:
    """transformers' LAST-token embeddings, normalised: per prompt (``batch`` None) or in
    length-sorted padded batches (right padding, the last real position gathered)."""
    out: list[torch.Tensor | None] = [None] * len(prompts)
    with torch.no_grad():
        if batch is None:
            for i, prompt in enumerate(prompts):
                ids = tokenizer(prompt, return_tensors="pt").input_ids
                out[i] = model(ids).last_hidden_state[0, -1]
        else:
            order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
            tokenizer.padding_side = "right"
            for k in range(0, len(order), batch):
                rows = order[k : k + batch]
                enc = tokenizer([prompts[i] for i in rows], return_tensors="pt", padding=True)
                states = model(**enc).last_hidden_state  # [b, T, hidden]
                last = enc.attention_mask.sum(dim=1) - 1
                for j, i in enumerate(rows):
                    out[i] = states[j, last[j]]
    return [torch.nn.functional.normalize(v, dim=-1) for v in out]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "embeddings.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.repeats = 6, 1
    threads = set_threads(args.threads)
    from transformers import AutoModel

    engines = {
        "tinyvllm": LLM(str(STDLIB_TINY), device="cpu", dtype="float32", runner="pooling"),
        "tinyvllm_no_prefix_cache": LLM(
            str(STDLIB_TINY), device="cpu", dtype="float32", runner="pooling", enable_prefix_caching=False
        ),
    }
    hf = AutoModel.from_pretrained(str(STDLIB_TINY), dtype=torch.float32).eval()
    tokenizer = engines["tinyvllm"].tokenizer
    plain = texts(args.prompts, tokenizer)
    workloads = {"plain": plain, "instruction": [INSTRUCTION + t for t in plain]}

    salts = itertools.count()

    def embed(llm: LLM, prompts: list[str]) -> list[torch.Tensor]:
        """Each run under a salt of its own: nothing is found from the run before (a new batch
        of documents), only what the prompts of this run share."""
        salt = f"run-{next(salts)}"
        outputs = llm.embed([{"prompt": p, "cache_salt": salt} for p in prompts], use_tqdm=False)
        return [torch.tensor(o.outputs.embedding) for o in outputs]

    record = {
        "benchmark": "embeddings",
        "quick": args.quick,
        **run_header("embeddings.py", argv),
        "threads": threads,
        "model": "stdlib_tiny",
        "pooling": "LAST, normalised",
        "repeats": args.repeats,
        "hf_batch": args.hf_batch,
        "workloads": {},
    }
    for workload, prompts in workloads.items():
        systems = {name: functools.partial(embed, llm, prompts) for name, llm in engines.items()}
        systems |= {
            "hf_batched": functools.partial(hf_embed, hf, tokenizer, prompts, args.hf_batch),
            "hf_per_prompt": functools.partial(hf_embed, hf, tokenizer, prompts, None),
        }
        vectors, times, cache = interleaved_rounds(systems, engines, args.repeats)  # the warm-up's vectors compared
        medians = {name: median(values) for name, values in times.items()}
        reference = vectors["hf_per_prompt"]
        record["workloads"][workload] = {
            "prompt_tokens": sum(len(tokenizer(p).input_ids) for p in prompts),
            "num_prompts": len(prompts),
            "seconds": times,
            "median_s": medians,
            "ratios": {f"{name}_over_tinyvllm": round(medians[name] / medians["tinyvllm"], 3) for name in systems
                       if name != "tinyvllm"},  # fmt: skip
            "prefix_cache_per_run": cache,
            "max_abs_diff_from_hf_per_prompt": {
                name: float(max((a - b).abs().max() for a, b in zip(vecs, reference))) for name, vecs in vectors.items()
            },
        }
        write_json(args.out, record)
    return record


if __name__ == "__main__":
    main()
