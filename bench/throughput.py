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
count as useful tokens.

Run on a GPU: ``python3 bench/throughput.py`` (writes ``bench/results/throughput-*.json``).
``--dry-run`` runs every code path on the CPU with a tiny model and a tiny workload; the
test suite runs it, and its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

QWEN3_0_6B = dict(  # the published Qwen3-0.6B config.json, shapes only
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)  # fmt: skip


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


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_tinyvllm(llm, prompts, max_tokens, temperature) -> dict:
    from tinyvllm import SamplingParams

    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m) for m in max_tokens]
    sync()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - start
    tokens = sum(max_tokens)
    return {"requests": len(prompts), "output_tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds}


def run_transformers(folder, prompts, max_tokens, temperature, batch_size, device, dtype) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    sync()
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, wants = prompts[i : i + batch_size], max_tokens[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(wants), do_sample=True,
                           temperature=temperature, top_k=0, top_p=1.0, pad_token_id=0)  # fmt: skip
    sync()
    seconds = time.perf_counter() - start
    tokens = sum(max_tokens)
    del model
    return {"requests": len(prompts), "output_tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model and workload, any device")
    parser.add_argument("--hf-requests", type=int, default=32, help="requests for the transformers baseline")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/...)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench/throughput.py: no CUDA device; use --dry-run for the CPU code path")
        return 0

    import tinyvllm
    import transformers
    from tinyvllm import LLM

    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if args.dry_run:
        prompts, max_tokens = make_workload(4, 24, 12, min_len=4, max_id=500)
        hf_n = 2
    else:
        prompts, max_tokens = make_workload(256, 1024, 1024)
        hf_n = args.hf_requests
    temperature = 0.6
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model_folder(Path(tmp) / "model", args.dry_run)
        kwargs = dict(max_model_len=64, block_size=4) if args.dry_run else dict(max_model_len=4096, block_size=16)
        kwargs["device"] = device
        llm = LLM(str(folder), **kwargs)
        llm.generate(["Benchmark: "], tinyvllm.SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        full = run_tinyvllm(llm, prompts, max_tokens, temperature)
        subset = run_tinyvllm(llm, prompts[:hf_n], max_tokens[:hf_n], temperature)
        del llm
        hf = run_transformers(folder, prompts[:hf_n], max_tokens[:hf_n], temperature, args.hf_batch_size,
                              device, torch.float32 if args.dry_run else torch.bfloat16)  # fmt: skip
    result = {
        "benchmark": "throughput (nano-vllm bench.py workload)",
        "dry_run": args.dry_run,
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tinyvllm": tinyvllm.__version__, "python": platform.python_version()},  # fmt: skip
        "tinyvllm_full_workload": full,
        "tinyvllm_on_hf_subset": subset,
        "transformers_on_hf_subset": hf,
        "speedup_vs_transformers_same_subset": subset["tok_per_s"] / hf["tok_per_s"],
    }
    out = args.out or ROOT / "bench" / "results" / f"throughput-{'dry' if args.dry_run else 'gpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
