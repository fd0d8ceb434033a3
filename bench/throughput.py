"""Benchmark: offline throughput on nano-vllm's workload, tinyvllm against transformers.

The workload is nano-vllm's ``bench.py``: 256 requests, prompts of ``randint(100, 1024)``
random token ids (``randint(0, 10000)`` each), outputs of ``randint(100, 1024)`` tokens with
``ignore_eos`` and temperature 0.6, Python's ``random`` seeded with 0; throughput =
requested output tokens / seconds. The model is a folder built from the Qwen3-0.6B config
with random weights (bf16) and the tiny test tokenizer (the workload is token ids only).

In the same run, the baseline: batched transformers ``generate`` (left padding, sampling
at the same temperature) on the first ``--hf-requests`` requests, and tinyvllm on the same
subset, so the two can be compared as a ratio on identical work. Transformers generates
``max(max_tokens)`` of its batch for every row; only each request's own ``max_tokens``
count as useful tokens (the padded counts are in the JSON's ``token_counts``).

tinyvllm runs with prefix caching off: the random prompts share no prefix, and with
caching on every repeat after the first (and the subset after the full workload) would
find its prompts in the cache. Both sides get a warm-up; then ``--repeats`` rounds (default
3) run interleaved (tinyvllm full, tinyvllm subset, transformers subset, again ...) and
the medians count. The record is written after every timed run (``"complete": false`` until
the last), the full workload first: a run cut short by its time budget keeps the headline.

``--async-ab``: after those rounds, the synchronous engine is shut down and the same engine
with ``async_scheduling=True`` runs the full workload once more (same draws, same run): the
A/B of async scheduling, ``tinyvllm_full_workload_async`` beside the synchronous figure.
``--cudagraph-mode-ab MODE`` (with ``--async-ab``): then the async engine once more with
``cudagraph_mode=MODE`` (``FULL``, say, against the default ``FULL_AND_PIECEWISE``): the full
workload once, ``tinyvllm_full_workload_async_mode_ab`` and ``mode_ab_speedup`` against the
async run, same draws, same run: the figure that decides the default mode.
``--no-transformers``: no baseline and no subset runs (a second GPU call that wants only the
A/Bs: the transformers subset alone took 77-99 s on the GPUs so far).

Run on a GPU: ``python3 bench/throughput.py`` (writes ``bench/results/throughput-*.json``).
``--dry-run`` runs every code path on the CPU with a tiny model and a tiny workload; the
test suite runs it, and its timings mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import datetime
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    ROOT,
    engine_config,
    machine_info,
    median,
    prefix_counters,
    set_threads,
    shared_model_folder,
    timed,
    versions,
    write_json,
)
from harness import sync  # noqa: E402, F401  (cudagraphs.py imports it from here)

QWEN3_0_6B = dict(  # the published Qwen3-0.6B config.json, shapes only
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)  # fmt: skip


GPU_MEMORY_UTILIZATION = 0.6  # the rest of the device is left to transformers' KV cache and logits


def make_workload(num_seqs: int, max_input_len: int, max_output_len: int, min_len: int = 100, max_id: int = 10000):
    """nano-vllm's bench.py workload, draw for draw (``max_id`` only shrinks for the dry run)."""
    random.seed(0)
    prompts = [[random.randint(0, max_id) for _ in range(random.randint(min_len, max_input_len))] for _ in range(num_seqs)]
    max_tokens = [random.randint(min_len, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def build_model_folder(folder: Path, dry_run: bool) -> Path:
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    from tinyvllm.models.tiny import build_tiny_model, train_tokenizer

    if dry_run:
        return build_tiny_model(folder, "qwen3")
    train_tokenizer(folder)
    config = Qwen3Config(**QWEN3_0_6B, dtype="bfloat16", eos_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(folder), safe_serialization=True)
    GenerationConfig(eos_token_id=0).save_pretrained(str(folder))
    del model
    torch.cuda.empty_cache()
    return folder


def run_tinyvllm(llm, prompts, max_tokens, temperature) -> dict:
    """One timed ``generate``; the output tokens and the prefix-cache hits are counted, not assumed."""
    from tinyvllm import SamplingParams

    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m) for m in max_tokens]
    before = prefix_counters(llm)
    seconds, outs = timed(llm.generate, [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    after = prefix_counters(llm)
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != sum(max_tokens):
        raise RuntimeError(f"tinyvllm produced {produced} output tokens, expected {sum(max_tokens)}")
    return {"seconds": seconds, "output_tokens": produced, "hit_tokens": after[1] - before[1]}


def load_transformers(folder, device, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: every row runs to max_new_tokens
    return model


def run_transformers(model, prompts, max_tokens, temperature, batch_size, device) -> dict:
    """One timed pass over ``prompts`` in left-padded batches of ``batch_size``."""

    def go() -> int:
        generated = 0
        for i in range(0, len(prompts), batch_size):
            batch, wants = prompts[i : i + batch_size], max_tokens[i : i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=max(wants), do_sample=True,
                                     temperature=temperature, top_k=0, top_p=1.0, pad_token_id=0)  # fmt: skip
            generated += out[:, width:].numel()
        return generated

    seconds, generated = timed(go)
    return {"seconds": seconds, "generated_tokens": generated}


def summarise(runs: list[dict], prompts, max_tokens) -> dict:
    """Medians over the repeats; throughput counts each request's own ``max_tokens``."""
    seconds = [r["seconds"] for r in runs]
    tokens = sum(max_tokens)
    out = {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "output_tokens": tokens,
           "seconds": median(seconds), "seconds_per_repeat": seconds, "tok_per_s": tokens / median(seconds)}  # fmt: skip
    for key in ("hit_tokens", "generated_tokens"):
        if key in runs[0]:
            out[key] = [r[key] for r in runs]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model and workload, any device")
    parser.add_argument("--hf-requests", type=int, default=32, help="requests for the transformers baseline")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds, interleaved; medians count (default 3)")
    parser.add_argument("--attention-backend", default="auto", help="tinyvllm's attention_backend (default auto)")
    parser.add_argument("--num-seqs", type=int, default=256, help="requests of the full workload (default 256, nano-vllm's)")
    parser.add_argument("--async-ab", action="store_true",
                        help="then the full workload once more with async_scheduling=True (same run)")
    parser.add_argument("--cudagraph-mode-ab", default=None, metavar="MODE",
                        help="with --async-ab: the async engine once more with this cudagraph_mode (same run)")
    parser.add_argument("--no-transformers", action="store_true", help="no transformers baseline, no subset runs")
    parser.add_argument("--model-folder", type=Path, default=None,
                        help="reuse the model built there, or build it there (default: a temporary folder)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/...)")
    args = parser.parse_args(argv)
    if args.cudagraph_mode_ab is not None and not args.async_ab:
        parser.error("--cudagraph-mode-ab compares with --async-ab's run: give both")
    if not args.dry_run and not torch.cuda.is_available():
        print("bench/throughput.py: no CUDA device; use --dry-run for the CPU code path")
        return 0

    import tinyvllm
    from tinyvllm import LLM

    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if args.dry_run:
        set_threads(1)  # two threads on a busy machine make tiny ops many times slower (recorded below)
        prompts, max_tokens = make_workload(4, 24, 12, min_len=4, max_id=500)
        hf_n = 2
    else:
        prompts, max_tokens = make_workload(args.num_seqs, 1024, 1024)
        hf_n = min(args.hf_requests, args.num_seqs)
    sub_prompts, sub_tokens = prompts[:hf_n], max_tokens[:hf_n]
    temperature = 0.6
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    out = args.out or ROOT / "bench" / "results" / f"throughput-{'dry' if args.dry_run else 'gpu'}.json"
    batches = [range(i, min(i + args.hf_batch_size, hf_n)) for i in range(0, hf_n, args.hf_batch_size)]
    header = {
        "benchmark": "throughput (nano-vllm bench.py workload)",
        "dry_run": args.dry_run,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "machine": machine_info(device),
        "torch_threads": torch.get_num_threads(),
        "versions": versions(),
        "transformers": {"batch_size": args.hf_batch_size, "dtype": str(dtype).removeprefix("torch."),
                         "cache": "default (dynamic)", "padding": "left"},  # fmt: skip
        "repeats": args.repeats,
    }
    runs: dict[str, list[dict]] = {"full": [], "subset": [], "hf": [], "full_async": [], "full_async_mode_ab": []}
    engine: dict = {}
    mode_ab_engine: dict = {}
    began = time.perf_counter()

    def say(what: str) -> None:
        """A progress line with the seconds since the start: a run cut off by its budget
        shows which phase took the time."""
        print(f"[{time.perf_counter() - began:6.1f} s] {what}", flush=True)

    def record(complete: bool) -> dict:
        """What is measured so far; written after every timed run, so a run cut short keeps it."""
        result = {**header, "complete": complete, "engine": engine}
        parts = {"full": (prompts, max_tokens), "subset": (sub_prompts, sub_tokens), "hf": (sub_prompts, sub_tokens),
                 "full_async": (prompts, max_tokens), "full_async_mode_ab": (prompts, max_tokens)}  # fmt: skip
        names = {"full": "tinyvllm_full_workload", "subset": "tinyvllm_on_hf_subset", "hf": "transformers_on_hf_subset",
                 "full_async": "tinyvllm_full_workload_async", "full_async_mode_ab": "tinyvllm_full_workload_async_mode_ab"}  # fmt: skip
        for key, (ps, ms) in parts.items():
            if runs[key]:
                result[names[key]] = summarise(runs[key], ps, ms)
        if runs["full"] and runs["full_async"]:
            result["async_speedup_full_workload"] = (
                result["tinyvllm_full_workload_async"]["tok_per_s"] / result["tinyvllm_full_workload"]["tok_per_s"]
            )
        if runs["full_async"] and runs["full_async_mode_ab"]:
            result["mode_ab"] = {"cudagraph_mode": args.cudagraph_mode_ab, "engine": mode_ab_engine}
            result["mode_ab_speedup"] = (
                result["tinyvllm_full_workload_async_mode_ab"]["tok_per_s"] / result["tinyvllm_full_workload_async"]["tok_per_s"]
            )
        if runs["subset"] and runs["hf"]:
            ratio = result["tinyvllm_on_hf_subset"]["tok_per_s"] / result["transformers_on_hf_subset"]["tok_per_s"]
            result["speedup_vs_transformers_same_subset"] = ratio
        result["token_counts"] = {
            "full_prompt": sum(map(len, prompts)), "full_output": sum(max_tokens),
            "subset_prompt": sum(map(len, sub_prompts)), "subset_output": sum(sub_tokens),
            "hf_padded_prompt": sum(len(b) * max(len(sub_prompts[i]) for i in b) for b in batches),
            "hf_generated": sum(len(b) * max(sub_tokens[i] for i in b) for b in batches),
        }  # fmt: skip
        write_json(out, result)
        return result

    with tempfile.TemporaryDirectory() as tmp:
        folder = shared_model_folder(args.model_folder, Path(tmp), lambda f: build_model_folder(f, args.dry_run))
        say(f"model folder ready: {folder}")
        kwargs = dict(max_model_len=64, block_size=4) if args.dry_run else dict(max_model_len=4096, block_size=16)
        if device == "cuda":  # transformers, alive at the same time, needs ~10 GB for its batch of 32
            kwargs["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION
        llm = LLM(str(folder), device=device, enable_prefix_caching=False, attention_backend=args.attention_backend, **kwargs)
        engine.update(engine_config(llm, args.attention_backend))
        if device == "cuda":
            engine["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION
        say("tinyvllm started")
        llm.generate(["Benchmark: "], tinyvllm.SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        torch.manual_seed(0)
        runs["full"].append(run_tinyvllm(llm, prompts, max_tokens, temperature))  # the headline, first
        record(complete=False)
        say(f"tinyvllm, full workload: {runs['full'][-1]['seconds']:.2f} s")
        hf = None if args.no_transformers else load_transformers(folder, device, dtype)
        if hf is not None:
            warm = sub_prompts[:2]
            run_transformers(hf, warm, [4] * len(warm), temperature, args.hf_batch_size, device)  # warm-up
            say(f"transformers loaded and warm; its subset: {hf_n} requests, up to {max(sub_tokens)} new tokens")
        for r in range(args.repeats):
            if r:
                torch.manual_seed(r)
                runs["full"].append(run_tinyvllm(llm, prompts, max_tokens, temperature))
                say(f"round {r}: tinyvllm, full workload: {runs['full'][-1]['seconds']:.2f} s")
            if hf is None:
                continue
            torch.manual_seed(r)
            runs["subset"].append(run_tinyvllm(llm, sub_prompts, sub_tokens, temperature))
            say(f"round {r}: tinyvllm, subset: {runs['subset'][-1]['seconds']:.2f} s")
            torch.manual_seed(r)
            runs["hf"].append(run_transformers(hf, sub_prompts, sub_tokens, temperature, args.hf_batch_size, device))
            record(complete=False)
            say(f"round {r}: transformers, subset: {runs['hf'][-1]['seconds']:.2f} s")
        del hf
        def rebuilt(old, what: str, **more):
            """``old`` shut down and freed, then the engine once more with ``more``, warmed up."""
            old.shutdown()
            del old
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            new = LLM(str(folder), device=device, enable_prefix_caching=False, attention_backend=args.attention_backend,
                      async_scheduling=True, **more, **kwargs)  # fmt: skip
            new.generate(["Benchmark: "], tinyvllm.SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
            say(f"tinyvllm with {what} started")
            return new

        ab_runs = [("full_async", "async scheduling", {})] if args.async_ab else []  # (module header)
        if args.cudagraph_mode_ab is not None:
            ab_runs.append(("full_async_mode_ab", f"async scheduling, cudagraph_mode {args.cudagraph_mode_ab}",
                            {"compilation_config": {"cudagraph_mode": args.cudagraph_mode_ab}}))  # fmt: skip
        for key, what, more in ab_runs:  # each the full workload once, the same draws
            llm = rebuilt(llm, what, **more)
            if key == "full_async_mode_ab":
                mode_ab_engine.update(engine_config(llm, args.attention_backend))
            torch.manual_seed(0)
            runs[key].append(run_tinyvllm(llm, prompts, max_tokens, temperature))
            record(complete=False)
            say(f"tinyvllm, full workload, {what}: {runs[key][-1]['seconds']:.2f} s")
        del llm
    result = record(complete=True)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
