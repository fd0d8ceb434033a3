"""Helpers shared by the benchmark scripts.

Not a benchmark itself: the CPU model's shape and the folder it is written to, the thread
setting, what is recorded about the machine and the engine, the prefix-cache counters, and
the JSON record every script writes (``write_json``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

# A Qwen3 of 33.6M parameters (the embedding is tied to the LM head), float32: small enough
# to run the workloads on two CPU cores in minutes, large enough that the model's forward,
# not Python, is most of a step.
CPU_MODEL = dict(
    vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
    rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    initializer_range=0.1,  # peaked logits, as the tiny test models (tinyvllm.models.tiny, NOTE 1)
)  # fmt: skip


def build_cpu_model(folder: Path, dry_run: bool, seed: int = 0) -> Path:
    """Write the 33.6M-parameter Qwen3 (or, for a dry run, the tiny test Qwen3) into ``folder``.

    The tokenizer is the tiny models' byte-level BPE: the workloads are token ids, and the
    tokenizer only detokenises the outputs at the end.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    from tinyvllm.models.tiny import build_tiny_model, train_tokenizer

    if dry_run:
        return build_tiny_model(folder, "qwen3", seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    train_tokenizer(folder)
    config = Qwen3Config(**CPU_MODEL, dtype="float32", eos_token_id=0, bos_token_id=None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(folder), safe_serialization=True)
    GenerationConfig(eos_token_id=0, bos_token_id=None).save_pretrained(str(folder))
    return folder


def shared_model_folder(requested: Path | None, tmp: Path, build) -> Path:
    """The model folder a script runs on. With ``--model-folder``: the folder a script before
    it built there (``bench/gpu_check.py`` gives every step the same one, so the model is
    built once), or, when it holds no model yet, ``build`` into a sibling ``.partial`` folder
    renamed into place only once complete, so a step killed while building (its time budget)
    never leaves the next step a folder with a config and half its weights. Without:
    ``build`` into the script's own temporary folder."""
    if requested is None:
        return build(tmp / "model")
    if (requested / "config.json").is_file():
        return requested
    partial = requested.with_name(requested.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what a killed build left
    build(partial)
    shutil.rmtree(requested, ignore_errors=True)  # an empty folder, or one without a config
    partial.rename(requested)
    return requested


def num_params(folder: Path) -> int:
    """Parameters stored in the folder's safetensors file (a tied LM head is stored, and counted, once)."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return sum(f.get_tensor(name).numel() for name in f.keys())


def run_header(script: str, argv: list[str] | None, device: str = "cpu") -> dict:
    """What every record says about its run: when, the command (``argv`` as ``main`` got it,
    None for the command line), the machine and the versions."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": f"python bench/{script} " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine_info(device),
        "versions": versions(),
    }


def write_json(out: Path, record: dict) -> Path:
    """Write a benchmark's record to ``out`` as indented JSON (its folder made if needed) and say where."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return out


def set_threads(n: int) -> int:
    """``torch.set_num_threads(n)``; returns what torch reports afterwards (recorded in the JSON)."""
    torch.set_num_threads(n)
    return torch.get_num_threads()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    """Seconds ``fn(*args, **kwargs)`` took (the device synchronised on both sides), and its result."""
    sync()
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    sync()
    return time.perf_counter() - start, result


def median(values: list[float]) -> float:
    return statistics.median(values)


def _cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str = "cpu") -> dict:
    """What the figures were measured on; the load average says how busy the machine was."""
    info = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "cpu": _cpu_model_name(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
    }
    if hasattr(os, "getloadavg"):
        info["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


def versions() -> dict:
    import transformers

    import tinyvllm

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tinyvllm": tinyvllm.__version__,
    }


def engine_config(llm, requested_backend: str) -> dict:
    """The engine as it was built: the attention backend ``auto`` resolved to, the KV pool, the limits."""
    config = llm.config
    runner = llm.engine.model_runner
    mode = getattr(runner, "cudagraph_mode", None)
    return {
        "attention_backend_requested": requested_backend,
        "attention_backend": llm.model.attention_backend,
        "device": str(llm.device),
        "dtype": str(llm.dtype).removeprefix("torch."),
        "block_size": config.cache_config.block_size,
        "num_kv_blocks": config.cache_config.num_gpu_blocks,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "hash_algo": config.cache_config.hash_algo,
        "max_model_len": config.scheduler_config.max_model_len,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "enable_chunked_prefill": config.scheduler_config.enable_chunked_prefill,
        "cudagraph_mode": getattr(mode, "name", str(mode)),
        # What the graphs hold (None: not measured, as on the CPU) and the capture's time.
        "cudagraph_memory_bytes": llm.startup_report.cudagraph_memory_bytes,
        "capture_s": round(llm.startup_report.capture_s, 2),
    }


def prefix_counters(llm) -> tuple[int, int]:
    """(prompt tokens looked up, tokens found) in the prefix cache since the engine started."""
    stats = llm.engine.scheduler.kv_cache_manager.prefix_cache_stats
    return (0, 0) if stats is None else (stats.queries, stats.hits)


def interleaved_rounds(systems: dict, engines: dict, repeats: int) -> tuple[dict, dict, dict]:
    """Each system run once (the warm-up, whose results come back to be compared), then
    ``repeats`` rounds, each running every system once in turn: ``(results, seconds per
    round, each engine's prefix cache per round {"prompt_tokens_looked_up", "found"})``."""
    results = {name: run() for name, run in systems.items()}
    before = {name: prefix_counters(llm) for name, llm in engines.items()}
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(repeats):
        for name, run in systems.items():
            seconds[name].append(round(timed(run)[0], 4))
    after = {name: prefix_counters(llm) for name, llm in engines.items()}
    cache = {name: {"prompt_tokens_looked_up": (after[name][0] - before[name][0]) // repeats,
                    "found": (after[name][1] - before[name][1]) // repeats} for name in engines}  # fmt: skip
    return results, seconds, cache
