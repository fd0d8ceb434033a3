"""StartupReport: what ``LLM(...)`` chose at start-up, as one block of lines.

Concept: an engine decides a lot on its own at start-up: the attention backend ``auto``
resolves to, the CPU threads torch runs on (``cpu_threads.py``), the CUDA-graph mode after the backend's downgrade, the capture sizes that fit
the token budget, how many KV blocks the memory left over holds, how much of it the graphs
took, and how long loading, warm-up and capture took. A user who cannot see those choices
cannot tell a slow run from a misconfigured one. The worker (``worker.py``), which made
those choices, builds this record once it has captured; ``LLM`` logs it (INFO, logger
``tinyvllm.engine.llm``), and the command line prints it on a GPU.
With tensor parallelism every rank builds its own, with one more line: the rank, its
weights' bytes and the KV heads its cache holds (each rank holds a slice of both).

Mirrors: the start-up lines of vLLM's ``gpu_model_runner.py`` and ``kv_cache_utils.py``
("Model loading took ...", "GPU KV cache size: ... tokens", "Maximum concurrency ...",
"Graph capturing finished in ... secs, took ... GiB").

Invariants: a frozen record; ``lines()`` is a pure function of it.
Left out: per-layer memory, the profile run's activation peak (``Worker.profile_run``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def format_bytes(num_bytes: int) -> str:
    """``1536`` -> ``"1.5 KiB"``: the largest binary unit that keeps the number at least 1."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def summarize_sizes(sizes: tuple[int, ...], shown: int = 6) -> str:
    """Capture sizes on one line: all of a short list, else the first few, "...", the last."""
    if not sizes:
        return "none"
    if len(sizes) <= shown:
        return ", ".join(map(str, sizes))
    return ", ".join(map(str, sizes[: shown - 1])) + f", ..., {sizes[-1]} ({len(sizes)} sizes)"


# --8<-- [start:report]
@dataclass(frozen=True)
class StartupReport:
    """What start-up chose (see the module header)."""

    device: str  # "cuda:0 (NVIDIA H100 80GB HBM3)" or "cpu"
    dtype: str
    attention_backend: str
    cudagraph_mode: str  # after the downgrade to what the backend supports
    capture_sizes: tuple[int, ...]  # () in mode NONE
    block_size: int
    num_kv_blocks: int
    kv_cache_bytes: int
    cudagraph_memory_bytes: int | None  # measured by the trial capture; None when none was made
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    load_s: float  # reading the weights onto the device
    memory_s: float  # the profile run and the trial capture that sized the KV cache
    capture_s: float  # warm-up and CUDA-graph capture of the real runner
    torch_threads: int  # torch.get_num_threads() once start-up set it (cpu_threads.py)
    # Tensor parallelism: which rank this report is, what it holds (its own line when N > 1).
    tensor_parallel_size: int = 1
    rank: int = 0
    num_kv_heads: int = 0  # the KV heads this rank's cache holds
    total_num_kv_heads: int = 0  # the model's
    weight_bytes: int = 0  # this rank's parameters, a tied matrix counted once

    def rank_line(self) -> str:
        """What this rank holds: its weights and its KV heads (tensor parallelism)."""
        return (
            f"rank {self.rank} of {self.tensor_parallel_size}: weights {format_bytes(self.weight_bytes)}, "
            f"KV heads {self.num_kv_heads} of {self.total_num_kv_heads}"
        )

    def lines(self) -> list[str]:
        kv_tokens = self.num_kv_blocks * self.block_size
        rank = [self.rank_line()]
        return [
            f"device {self.device}, dtype {self.dtype}, attention backend {self.attention_backend}, "
            f"torch threads {self.torch_threads}",
            f"cudagraph_mode {self.cudagraph_mode}, capture sizes: {summarize_sizes(self.capture_sizes)}",
            f"KV cache: {self.num_kv_blocks} blocks of {self.block_size} tokens = {kv_tokens} tokens, "
            f"{format_bytes(self.kv_cache_bytes)}; {kv_tokens / self.max_model_len:.1f}x max_model_len "
            f"{self.max_model_len} at once",
            "CUDA graphs hold " + (
                f"{format_bytes(self.cudagraph_memory_bytes)} (taken from the KV budget)"
                if self.cudagraph_memory_bytes is not None
                else "memory not measured (no trial capture: the CPU, mode NONE, or num_gpu_blocks_override)"
            ),
            f"limits: max_num_seqs {self.max_num_seqs}, max_num_batched_tokens {self.max_num_batched_tokens}",
            f"took: loading {self.load_s:.1f} s, sizing the KV cache {self.memory_s:.1f} s, "
            f"warm-up and capture {self.capture_s:.1f} s",
        ] + (rank if self.tensor_parallel_size > 1 else [])


def report_lines(reports: Sequence[StartupReport]) -> list[str]:
    """The engine's start-up report: rank 0's lines, then each other rank's own line (every
    rank holds the same KV blocks, its own weights and KV heads)."""
    return reports[0].lines() + [report.rank_line() for report in reports[1:]]
# --8<-- [end:report]
