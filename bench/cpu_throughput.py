"""Benchmark: tinyvllm against transformers on the CPU, side by side in one run.

Three comparisons, each measured at ``torch.set_num_threads(1)`` and then at 2 (``--threads``):

1. **Throughput.** 32 requests, prompts of ``randint(16, 256)`` random token ids, outputs of
   ``randint(16, 128)`` tokens, temperature 0.6, ``ignore_eos``; Python's ``random`` seeded
   with 0. Three systems run the same requests:
   (a) tinyvllm ``LLM.generate`` with prefix caching off (random prompts share nothing,
   and the repeats must not hit the blocks of the run before);
   (b) transformers ``generate`` with its dynamic cache: the 32 prompts as one left-padded
   batch, ``attn_implementation="sdpa"``;
   (c) the same with ``cache_implementation="static"``.
   Each system gets a short warm-up, then the repeats run interleaved (a, b, c, a, b, c, ...)
   and the median counts. Throughput = (prompt tokens + requested output tokens) / seconds.
   Transformers computes more than that: every row is padded to the longest prompt and
   generates the batch's largest ``max_tokens``; those padded counts are in the JSON too,
   but only the requested tokens count as useful work.
2. **Batch-1 decode.** One 64-token prompt, 128 new tokens, greedy; tinyvllm against
   transformers with the static cache. Each side is timed generating 128 tokens and 1 token;
   decode seconds per token = (t(128) - t(1)) / 127, which leaves the prefill out.
3. **Prefix caching.** 32 prompts of 256 shared + 256 unique token ids, 8 output tokens
   each, through tinyvllm with caching on and off. Input throughput = prompt tokens /
   seconds; the hit rate is the prefix cache's (tokens found / tokens looked up). Every
   repeat draws new prompts, so a repeat never hits the blocks of the one before. Each
   engine first runs the full workload once on prompts of its own: after a warm-up of four
   requests, the first timed repeat of each ran 1.5-1.8x slower than the next two (one-time
   costs of the full batch's shapes), and with three repeats that one could set a median.

Ratios are "tinyvllm's speed / the baseline's speed" (above 1: tinyvllm is faster), each
from medians measured in the same run; timings alone, on a shared machine, mean little.

Usage::

    python bench/cpu_throughput.py            # about 10 minutes on two cores
    python bench/cpu_throughput.py --quick    # 8 shorter requests, smaller pairs, 1 repeat
    python bench/cpu_throughput.py --dry-run  # tiny model, seconds; the test suite runs it

Writes ``bench/results/cpu_throughput.json`` (``--out`` to change; a dry or quick run
writes ``cpu_throughput-dry.json`` / ``cpu_throughput-quick.json`` unless told otherwise).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    CPU_MODEL,
    ROOT,
    build_cpu_model,
    engine_config,
    median,
    num_params,
    prefix_counters,
    run_header,
    set_threads,
    timed,
    write_json,
)

# Workload sizes for the full run, ``--quick`` and ``--dry-run``.
SIZES = {
    "full": dict(num_seqs=32, prompt_len=(16, 256), output_len=(16, 128), warmup_seqs=4, warmup_tokens=8,
                 batch1_prompt=64, batch1_tokens=128, prefix_seqs=32, prefix_shared=256, prefix_unique=256,
                 prefix_output=8, repeats=3),
    "quick": dict(num_seqs=8, prompt_len=(16, 128), output_len=(8, 32), warmup_seqs=2, warmup_tokens=4,
                  batch1_prompt=64, batch1_tokens=32, prefix_seqs=8, prefix_shared=128, prefix_unique=128,
                  prefix_output=4, repeats=1),
    "dry": dict(num_seqs=4, prompt_len=(4, 24), output_len=(2, 8), warmup_seqs=2, warmup_tokens=2,
                batch1_prompt=8, batch1_tokens=4, prefix_seqs=4, prefix_shared=32, prefix_unique=32,
                prefix_output=2, repeats=1),
}  # fmt: skip
TEMPERATURE = 0.6
BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
NUM_KV_BLOCKS = 2048  # fixed, so the pool (512 MiB for the 33.6M model) does not depend on the machine
SYSTEMS = ("tinyvllm", "hf_dynamic", "hf_static")


def make_workload(num_seqs: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int = 0):
    """Random prompts (token ids) and output lengths, from Python's ``random`` seeded with ``seed``."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(num_seqs)]
    max_tokens = [rng.randint(*output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def make_prefix_workload(num_seqs: int, shared: int, unique: int, vocab: int, seed: int):
    """``num_seqs`` prompts: one shared prefix of ``shared`` random ids, then ``unique`` ids each."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(vocab) for _ in range(unique)] for _ in range(num_seqs)]


# -- the systems ---------------------------------------------------------------------------


def tinyvllm_generate(llm, prompts, max_tokens, temperature: float) -> tuple[float, int]:
    """Seconds for ``LLM.generate`` on the requests, and the output tokens it produced (checked)."""
    from tinyvllm import SamplingParams

    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m) for m in max_tokens]
    seconds, outs = timed(llm.generate, [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    produced = [len(o.outputs[0].token_ids) for o in outs]
    if produced != list(max_tokens):
        raise RuntimeError(f"tinyvllm produced {produced} tokens, expected {list(max_tokens)}")
    return seconds, sum(produced)


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None  # ignore_eos: every row runs to max_new_tokens
    return model


def hf_batch(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One left-padded batch (pad id 0, masked out)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def hf_generate(model, prompts, max_new_tokens: int, temperature: float, static: bool) -> tuple[float, torch.Tensor]:
    """Seconds for one ``generate`` call over all prompts, and the generated ids [rows, new] (checked)."""
    ids, mask = hf_batch(prompts)
    if temperature > 0:
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        sampling = dict(do_sample=False)
    extra = dict(cache_implementation="static") if static else {}
    with torch.inference_mode():
        seconds, out = timed(model.generate, ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=0,
                             **sampling, **extra)  # fmt: skip
    new = out[:, ids.shape[1] :]
    if tuple(new.shape) != (len(prompts), max_new_tokens):
        raise RuntimeError(f"transformers generated {tuple(new.shape)}, expected ({len(prompts)}, {max_new_tokens})")
    return seconds, new


def run_system(name: str, llm, hf_model, prompts, max_tokens, temperature: float) -> tuple[float, int]:
    """One timed run of a system; returns (seconds, output tokens it computed)."""
    if name == "tinyvllm":
        return tinyvllm_generate(llm, prompts, max_tokens, temperature)
    seconds, new = hf_generate(hf_model, prompts, max(max_tokens), temperature, static=name == "hf_static")
    return seconds, new.numel()


# -- the three comparisons -----------------------------------------------------------------


def bench_throughput(llm, hf_model, size: dict, vocab: int, repeats: int) -> dict:
    prompts, max_tokens = make_workload(size["num_seqs"], size["prompt_len"], size["output_len"], vocab, seed=0)
    warm_prompts, _ = make_workload(size["warmup_seqs"], size["prompt_len"], size["output_len"], vocab, seed=1)
    warm_tokens = [size["warmup_tokens"]] * len(warm_prompts)
    useful = sum(map(len, prompts)) + sum(max_tokens)
    for name in SYSTEMS:  # warm-up: the same code paths on a few short requests
        run_system(name, llm, hf_model, warm_prompts, warm_tokens, TEMPERATURE)
    seconds: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    computed: dict[str, int] = {}
    for r in range(repeats):
        for name in SYSTEMS:
            torch.manual_seed(r)
            s, computed[name] = run_system(name, llm, hf_model, prompts, max_tokens, TEMPERATURE)
            seconds[name].append(s)
    result = {}
    for name in SYSTEMS:
        med = median(seconds[name])
        result[name] = {"seconds": seconds[name], "median_s": med, "tok_per_s": useful / med,
                        "output_tokens_computed": computed[name]}  # fmt: skip
    return result


def bench_batch1(llm, hf_model, size: dict, vocab: int, repeats: int) -> dict:
    (prompt,), _ = make_workload(1, (size["batch1_prompt"],) * 2, (1, 1), vocab, seed=2)
    n = size["batch1_tokens"]
    runs = {"tinyvllm": {n: [], 1: []}, "hf_static": {n: [], 1: []}}
    tokens = {}

    def once(name: str, new: int) -> float:
        if name == "tinyvllm":
            from tinyvllm import SamplingParams

            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new)
            s, outs = timed(llm.generate, [{"prompt_token_ids": prompt}], params, use_tqdm=False)
            got = list(outs[0].outputs[0].token_ids)
        else:
            s, ids = hf_generate(hf_model, [prompt], new, 0.0, static=True)
            got = ids[0].tolist()
        if len(got) != new:
            raise RuntimeError(f"{name} generated {len(got)} tokens, expected {new}")
        if new == n:
            tokens[name] = got
        return s

    for name in runs:  # warm-up
        once(name, n)
    for _ in range(repeats):
        for name in runs:
            for new in (n, 1):
                runs[name][new].append(once(name, new))
    result = {"prompt_tokens": len(prompt), "new_tokens": n}
    for name, by_len in runs.items():
        t_n, t_1 = median(by_len[n]), median(by_len[1])
        result[name] = {
            "seconds_n_tokens": by_len[n], "seconds_1_token": by_len[1], "median_s": t_n,
            "decode_s_per_token": (t_n - t_1) / (n - 1), "tokens_generated": tokens[name],
        }  # fmt: skip
    result["greedy_tokens_match"] = tokens["tinyvllm"] == tokens["hf_static"]
    return result


def bench_prefix_pair(llm_off, llm_on, size: dict, vocab: int, repeats: int, seed: int) -> dict:
    """Caching on against off; ``seed`` must differ between calls, so no call hits another's prompts."""
    from tinyvllm import SamplingParams

    n, shared, unique = size["prefix_seqs"], size["prefix_shared"], size["prefix_unique"]
    params = SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=size["prefix_output"])
    engines = {"caching_off": llm_off, "caching_on": llm_on}

    def once(name: str, prompts) -> tuple[float, int, int, int]:
        llm = engines[name]
        before = prefix_counters(llm)
        s, outs = timed(llm.generate, [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        after = prefix_counters(llm)
        cached = sum(o.num_cached_tokens for o in outs)
        return s, after[0] - before[0], after[1] - before[1], cached

    for name in engines:  # warm-up at full size, on prompts of its own (module header)
        once(name, make_prefix_workload(n, shared, unique, vocab, seed=seed))
    keys = ("seconds", "looked_up_tokens", "hit_tokens", "cached_tokens_in_outputs")
    runs = {name: {key: [] for key in keys} for name in engines}
    for r in range(repeats):
        prompts = make_prefix_workload(n, shared, unique, vocab, seed=seed + 1 + r)  # no hits across repeats
        for name in engines:
            torch.manual_seed(r)
            s, looked, hits, cached = once(name, prompts)
            for key, value in zip(runs[name], (s, looked, hits, cached)):
                runs[name][key].append(value)
    prompt_tokens = n * (shared + unique)
    result = {"num_seqs": n, "shared_tokens": shared, "unique_tokens": unique, "output_tokens": n * size["prefix_output"],
              "prompt_tokens": prompt_tokens}  # fmt: skip
    for name, run in runs.items():
        med = median(run["seconds"])
        result[name] = {**run, "median_s": med, "input_tok_per_s": prompt_tokens / med,
                        "hit_rate": sum(run["hit_tokens"]) / max(1, sum(run["looked_up_tokens"]))}  # fmt: skip
    return result


# -- the run -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="8 shorter requests, smaller pair, 1 repeat")
    group.add_argument("--dry-run", action="store_true", help="tiny model and workload: every code path in seconds")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per system (default 3; 1 if quick)")
    parser.add_argument("--threads", default=None, help="torch thread counts, comma-separated (default 1,2; dry run 1)")
    parser.add_argument("--attention-backend", default="auto", help="tinyvllm's attention_backend (default auto)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/cpu_throughput*.json)")
    args = parser.parse_args(argv)
    mode = "dry" if args.dry_run else "quick" if args.quick else "full"
    size = SIZES[mode]
    repeats = args.repeats or size["repeats"]
    threads = [int(t) for t in (args.threads or ("1" if args.dry_run else "1,2")).split(",")]

    import transformers  # noqa: F401  (imported before the timed work)

    from tinyvllm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_cpu_model(Path(tmp) / "model", dry_run=args.dry_run)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        max_model_len = 512 if args.dry_run else MAX_MODEL_LEN  # the tiny model's positions stop at 512
        common = dict(device="cpu", block_size=BLOCK_SIZE, max_model_len=max_model_len, num_gpu_blocks_override=NUM_KV_BLOCKS,
                      attention_backend=args.attention_backend, seed=0)  # fmt: skip
        llm_off = LLM(str(folder), enable_prefix_caching=False, **common)
        llm_on = LLM(str(folder), enable_prefix_caching=True, **common)
        hf_model = load_hf(folder)
        params = num_params(folder)
        per_threads, ratios = {}, {}
        for i, n in enumerate(threads):
            actual = set_threads(n)
            tp = bench_throughput(llm_off, hf_model, size, vocab, repeats)
            b1 = bench_batch1(llm_off, hf_model, size, vocab, repeats)
            pc = bench_prefix_pair(llm_off, llm_on, size, vocab, repeats, seed=100 + 100 * i)
            per_threads[str(n)] = {"torch_threads": actual, "throughput": tp, "batch1": b1, "prefix_caching": pc}
            ours, dynamic, static = (tp[name]["tok_per_s"] for name in SYSTEMS)
            ratios[str(n)] = {
                "tinyvllm_over_hf_dynamic": ours / dynamic,
                "tinyvllm_over_hf_static": ours / static,
                "tinyvllm_over_hf_best": ours / max(dynamic, static),
                "batch1_decode_tinyvllm_over_hf_static":
                    b1["hf_static"]["decode_s_per_token"] / b1["tinyvllm"]["decode_s_per_token"],
                "prefix_caching_on_over_off_input":
                    pc["caching_on"]["input_tok_per_s"] / pc["caching_off"]["input_tok_per_s"],
            }  # fmt: skip
        engines = {"throughput_and_batch1": engine_config(llm_off, args.attention_backend),
                   "prefix_caching_on": engine_config(llm_on, args.attention_backend)}  # fmt: skip

    prompts, max_tokens = make_workload(size["num_seqs"], size["prompt_len"], size["output_len"], vocab, seed=0)
    width, rows, new = max(map(len, prompts)), len(prompts), max(max_tokens)
    prompt_tokens, output_tokens = sum(map(len, prompts)), sum(max_tokens)
    token_counts = {
        "prompt": prompt_tokens, "output": output_tokens, "useful_total": prompt_tokens + output_tokens,
        "hf_padded_prompt": rows * width, "hf_generated": rows * new, "hf_padded_total": rows * (width + new),
    }  # fmt: skip
    result = {
        "benchmark": "cpu_throughput",
        "mode": mode,
        "dry_run": args.dry_run,
        **run_header("cpu_throughput.py", argv),
        "model": {"family": "qwen3", "config": "tiny test model (tinyvllm.models.tiny)" if args.dry_run else CPU_MODEL,
                  "dtype": "float32", "params": params},  # fmt: skip
        "engine": engines,
        "transformers": {
            "attn_implementation": "sdpa", "batch": "all requests in one left-padded batch",
            "systems": {"hf_dynamic": "default (dynamic) cache", "hf_static": "cache_implementation='static'"},
        },  # fmt: skip
        "workload": {
            **{k: size[k] for k in ("num_seqs", "prompt_len", "output_len")},
            "temperature": TEMPERATURE, "ignore_eos": True, "seed": 0, "token_ids": f"uniform in [0, {vocab})",
            "prompt_lens": list(map(len, prompts)), "output_lens": max_tokens,
            "warmup": f"{size['warmup_seqs']} requests of {size['warmup_tokens']} output tokens per system",
        },  # fmt: skip
        "token_counts": token_counts,
        "repeats": repeats,
        "threads": per_threads,
        "ratios": ratios,
    }
    name = "cpu_throughput.json" if mode == "full" else f"cpu_throughput-{mode}.json"
    out = args.out or ROOT / "bench" / "results" / name
    print_table(result)
    write_json(out, result)
    return 0


def print_table(result: dict) -> None:
    backend = result["engine"]["throughput_and_batch1"]["attention_backend"]
    print(f"\ncpu_throughput ({result['mode']}, {result['repeats']} repeat(s), tinyvllm attention backend {backend!r})")
    print(f"{'ratio (above 1: tinyvllm faster)':<42}" + "".join(f"{'threads ' + t:>12}" for t in result["ratios"]))
    names = next(iter(result["ratios"].values())).keys()
    for name in names:
        print(f"{name:<42}" + "".join(f"{r[name]:>12.2f}" for r in result["ratios"].values()))
    for t, per in result["threads"].items():
        tp, pc = per["throughput"], per["prefix_caching"]
        figures = ", ".join(f"{k} {v['tok_per_s']:.0f} tok/s" for k, v in tp.items())
        print(f"threads {t}: {figures}; prefix hit rate {pc['caching_on']['hit_rate']:.1%}")


if __name__ == "__main__":
    sys.exit(main())
