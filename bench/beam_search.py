"""Timing: ``LLM.beam_search`` against transformers' beam search, on the shipped model.

What it measures: the wall time of one beam search of ``--beam-width`` (4) over
``--max-tokens`` (32) for each of the prompts below (EOS ignored, so every system does
the same number of steps), by four systems in the same run:

- ``tinyvllm``: ``LLM.beam_search`` over all the prompts at once (prefix caching on, the
  default);
- ``tinyvllm_no_prefix_cache``: the same engine built with ``enable_prefix_caching=False``,
  so each step recomputes every beam's whole sequence: what the cache saves;
- ``tinyvllm_block_size_4`` and ``tinyvllm_block_size_1``: the engine with smaller KV blocks.
  The cache shares only full blocks, so each step recomputes the tokens of a beam past its
  parent's last full block: on average about half a block (8.5 tokens at the default 16,
  1 at block size 1). These two show what that tail costs;
- ``tinyvllm_short_queries_alone``: the default engine with ``torch_sdpa.SHORT_QUERY_MAX``
  set to 1 while it searches, so each beam's few query tokens get an SDPA call of their own
  instead of joining a group (NOTE 8 of ``attention/torch_sdpa.py``);
- ``hf_per_prompt``: transformers' ``generate(num_beams=W, num_return_sequences=W)``, one
  prompt at a time (its KV cache reorders along with the beams);
- ``hf_batched``: the same with every prompt in one batch, padded on the left.

Each system gets one warm-up, then ``--repeats`` (5) interleaved rounds (a, b, c, d, a, ...);
the record holds every time, the medians, and the ratios ``hf_*_over_tinyvllm`` and
``no_prefix_cache_over_tinyvllm``, ``short_queries_alone_over_tinyvllm`` and
``tinyvllm_over_block_size_N`` (above 1: the second is faster). Also recorded, per engine: the prompt tokens it looked up in the
prefix cache and found in one search, and whether tinyvllm's beams are
transformers' per-prompt beams token for token (they must be: the sampling defaults of the
model's ``generation_config.json`` are turned off for transformers, as ``beam_search``
ignores them).

Run: ``python bench/beam_search.py`` (about a minute on two threads) writes
``bench/results/beam_search.json``; ``--threads N`` sets torch's threads (2 by default, the
machine's cores). ``--quick`` runs 2 prompts, width 2, 4 tokens, one round (the test suite
runs it; its timings mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, interleaved_rounds, median, run_header, set_threads, write_json  # noqa: E402
from tinyvllm import LLM, BeamSearchParams  # noqa: E402
from tinyvllm.attention import torch_sdpa  # noqa: E402
from tinyvllm.stdlib_tiny import STDLIB_TINY  # noqa: E402

PROMPTS = [
    "def main(",
    "import os\n",
    "class Config:",
    "for i in range(",
    "    def __init__(self, name",
    "if __name__ == ",
    "with open(path) as f:",
    "    return sorted(",
]


def hf_beam_search(model, tokenizer, prompts: list[str], width: int, max_tokens: int, batched: bool) -> list[list[list[int]]]:
    """transformers' beams of each prompt (generated ids, best first)."""
    kwargs = dict(
        num_beams=width, num_return_sequences=width, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
        pad_token_id=0, early_stopping=False, length_penalty=1.0, repetition_penalty=1.0, top_k=None, temperature=None,
    )  # fmt: skip
    with torch.no_grad():
        if batched:
            tokenizer.padding_side = "left"
            enc = tokenizer(prompts, return_tensors="pt", padding=True)
            rows = model.generate(**enc, **kwargs)
            n = enc.input_ids.shape[1]
            return [[row[n:].tolist() for row in rows[i * width : (i + 1) * width]] for i in range(len(prompts))]
        beams = []
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            rows = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            beams.append([row[ids.shape[1] :].tolist() for row in rows])
        return beams


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "beam_search.json")
    args = parser.parse_args(argv)
    prompts = PROMPTS
    if args.quick:
        prompts, args.beam_width, args.max_tokens, args.repeats = PROMPTS[:2], 2, 4, 1
    threads = set_threads(args.threads)
    from transformers import AutoModelForCausalLM

    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {
        "tinyvllm": LLM(str(STDLIB_TINY), device="cpu", dtype="float32"),
        "tinyvllm_no_prefix_cache": LLM(str(STDLIB_TINY), device="cpu", dtype="float32", enable_prefix_caching=False),
        "tinyvllm_block_size_4": LLM(str(STDLIB_TINY), device="cpu", dtype="float32", block_size=4),
        "tinyvllm_block_size_1": LLM(str(STDLIB_TINY), device="cpu", dtype="float32", block_size=1),
    }
    hf = AutoModelForCausalLM.from_pretrained(str(STDLIB_TINY), dtype=torch.float32).eval()
    tokenizer = engines["tinyvllm"].tokenizer

    def search(llm: LLM) -> list[list[list[int]]]:
        return [[list(s.output_token_ids) for s in o.sequences] for o in llm.beam_search(prompts, params)]

    def search_alone(llm: LLM) -> list[list[list[int]]]:
        saved, torch_sdpa.SHORT_QUERY_MAX = torch_sdpa.SHORT_QUERY_MAX, 1
        try:
            return search(llm)
        finally:
            torch_sdpa.SHORT_QUERY_MAX = saved

    systems = {name: functools.partial(search, llm) for name, llm in engines.items()}
    systems["tinyvllm_short_queries_alone"] = functools.partial(search_alone, engines["tinyvllm"])
    systems |= {
        "hf_per_prompt": lambda: hf_beam_search(hf, tokenizer, prompts, args.beam_width, args.max_tokens, False),
        "hf_batched": lambda: hf_beam_search(hf, tokenizer, prompts, args.beam_width, args.max_tokens, True),
    }
    beams, times, cache = interleaved_rounds(systems, engines, args.repeats)  # the warm-up's beams compared
    medians = {name: median(values) for name, values in times.items()}
    record = {
        "benchmark": "beam_search",
        "quick": args.quick,
        **run_header("beam_search.py", argv),
        "threads": threads,
        "model": "stdlib_tiny",
        "workload": {"prompts": prompts, "beam_width": args.beam_width, "max_tokens": args.max_tokens, "ignore_eos": True},
        "repeats": args.repeats,
        "seconds": times,
        "median_s": medians,
        "ratios": {
            "hf_per_prompt_over_tinyvllm": round(medians["hf_per_prompt"] / medians["tinyvllm"], 3),
            "hf_batched_over_tinyvllm": round(medians["hf_batched"] / medians["tinyvllm"], 3),
            "no_prefix_cache_over_tinyvllm": round(medians["tinyvllm_no_prefix_cache"] / medians["tinyvllm"], 3),
            "short_queries_alone_over_tinyvllm": round(medians["tinyvllm_short_queries_alone"] / medians["tinyvllm"], 3),
            "tinyvllm_over_block_size_4": round(medians["tinyvllm"] / medians["tinyvllm_block_size_4"], 3),
            "tinyvllm_over_block_size_1": round(medians["tinyvllm"] / medians["tinyvllm_block_size_1"], 3),
        },
        "prefix_cache_per_search": cache,
        "beams_equal_hf_per_prompt": {name: beams[name] == beams["hf_per_prompt"] for name in systems},
    }
    write_json(args.out, record)
    return record


if __name__ == "__main__":
    main()
