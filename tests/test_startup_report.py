"""``LLM``'s start-up report (``worker/startup_report.py``): what start-up chose, as one block
of lines: logged on every device, printed by the command line on a GPU."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys

import pytest
import torch

from tinyvllm import LLM
from tinyvllm.models.loader import find_weight_files, read_tensor_infos
from tinyvllm.models.model_files import weights_nbytes
from tinyvllm.worker.startup_report import StartupReport, format_bytes, report_lines, summarize_sizes


def test_format_bytes_and_summarize_sizes():
    assert [format_bytes(n) for n in (0, 1023, 1536, 5 * 2**20, 3 * 2**30, 2**50)] == [
        "0 B", "1023 B", "1.50 KiB", "5.00 MiB", "3.00 GiB", "1048576.00 GiB",
    ]  # fmt: skip
    assert summarize_sizes(()) == "none"
    assert summarize_sizes((1, 2, 4)) == "1, 2, 4"
    assert summarize_sizes((1, 2, 4, 8, 16, 24, 32, 512)) == "1, 2, 4, 8, 16, ..., 512 (8 sizes)"


def test_the_report_says_every_choice():
    report = StartupReport(
        device="cuda:0 (NVIDIA H100 80GB HBM3)", dtype="bfloat16", attention_backend="triton",
        cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=(1, 2, 4, 8, 16, 24, 32), block_size=16,
        num_kv_blocks=4096, kv_cache_bytes=4096 * 16 * 2**10, cudagraph_memory_bytes=3 * 2**29,
        max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192, load_s=1.24, memory_s=5.0, capture_s=12.31,
        torch_threads=8,
    )  # fmt: skip
    assert report.lines() == [
        "device cuda:0 (NVIDIA H100 80GB HBM3), dtype bfloat16, attention backend triton, torch threads 8",
        "cudagraph_mode FULL_AND_PIECEWISE, capture sizes: 1, 2, 4, 8, 16, ..., 32 (7 sizes)",
        "KV cache: 4096 blocks of 16 tokens = 65536 tokens, 64.00 MiB; 16.0x max_model_len 4096 at once",
        "CUDA graphs hold 1.50 GiB (taken from the KV budget)",
        "limits: max_num_seqs 256, max_num_batched_tokens 8192",
        "took: loading 1.2 s, sizing the KV cache 5.0 s, warm-up and capture 12.3 s",
    ]
    rank1 = dataclasses.replace(
        report, tensor_parallel_size=2, rank=1, num_kv_heads=4, total_num_kv_heads=8, weight_bytes=3 * 2**29
    )
    assert rank1.lines() == report.lines() + ["rank 1 of 2: weights 1.50 GiB, KV heads 4 of 8"]
    alone = dataclasses.replace(report, num_kv_heads=8, total_num_kv_heads=8, weight_bytes=2**30)
    assert alone.lines() == report.lines()  # one rank: no rank line
    rank0 = dataclasses.replace(rank1, rank=0, weight_bytes=3 * 2**29 + 2**20)
    assert report_lines([rank0, rank1]) == report.lines() + [
        "rank 0 of 2: weights 1.50 GiB, KV heads 4 of 8",
        "rank 1 of 2: weights 1.50 GiB, KV heads 4 of 8",
    ]  # every rank's own line after rank 0's report
    assert report_lines([alone]) == report.lines()


def test_an_llm_on_the_cpu_reports_what_it_chose_and_logs_it(tiny_model_dirs, caplog):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with caplog.at_level(logging.INFO, logger="tinyvllm.engine.llm_engine"):
            llm = LLM(str(tiny_model_dirs["qwen3"]), device="cpu", max_model_len=64, block_size=4, num_gpu_blocks_override=40,
                      compilation_config={"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4]},
                      torch_threads=1)  # fmt: skip
        assert torch.get_num_threads() == 1  # set for the process (cpu_threads.py)
    finally:
        torch.set_num_threads(before)
    report = llm.startup_report
    assert (report.device, report.dtype, report.attention_backend, report.torch_threads) == ("cpu", "float32", "torch", 1)
    assert report.lines()[0] == "device cpu, dtype float32, attention backend torch, torch threads 1"
    assert (report.cudagraph_mode, report.capture_sizes) == ("PIECEWISE", (1, 2, 4))  # emulated on the CPU
    assert (report.num_kv_blocks, report.block_size, report.max_model_len) == (40, 4, 64)
    kv = llm.engine.model_runner.kv_caches
    assert report.kv_cache_bytes == sum(t.numel() * t.element_size() for t in kv)
    assert report.cudagraph_memory_bytes is None  # no trial capture on the CPU
    infos = read_tensor_infos(find_weight_files(tiny_model_dirs["qwen3"]))
    assert "lm_head.weight" not in infos  # tied: the checkpoint stores the matrix once, and so do we
    assert report.weight_bytes == weights_nbytes(infos.values()) == 427520
    assert (report.tensor_parallel_size, report.rank, report.num_kv_heads, report.total_num_kv_heads) == (1, 0, 2, 2)
    assert report.capture_s > 0 and report.load_s > 0
    logged = [r.getMessage() for r in caplog.records if r.name == "tinyvllm.engine.llm_engine"]
    assert len(logged) == 1 and all(line in logged[0] for line in report.lines())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_start_up_measures_graph_memory_and_the_cli_prints_the_report(tiny_model_dirs):
    folder = str(tiny_model_dirs["qwen3"])
    llm = LLM(folder, device="cuda", max_model_len=256, gpu_memory_utilization=0.3, max_num_seqs=8)
    report = llm.startup_report
    assert report.device.startswith("cuda") and torch.cuda.get_device_name() in report.device
    assert report.cudagraph_mode != "NONE" and report.capture_sizes
    assert report.cudagraph_memory_bytes is not None and report.cudagraph_memory_bytes > 0
    out = subprocess.run([sys.executable, "-m", "tinyvllm", "generate", "--model", folder, "--device", "cuda",
                          "--max-model-len", "256", "--prompt", "def f(x):", "--max-tokens", "4"],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "[tinyvllm] device cuda" in out.stderr and "[tinyvllm] cudagraph_mode" in out.stderr


@pytest.mark.parametrize("value, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError), ("2", TypeError)])
def test_torch_threads_is_checked_before_anything_changes(tiny_model_dirs, value, error):
    before = torch.get_num_threads()
    with pytest.raises(error, match=f"torch_threads.*{value!r}" if error is TypeError else f"torch_threads.*{value}"):
        LLM(str(tiny_model_dirs["qwen3"]), device="cpu", torch_threads=value)
    assert torch.get_num_threads() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_garbage_an_earlier_engine_left_does_not_skew_the_graph_memory(tiny_model_dirs):
    """The first ``gpu.sh`` run after the engine seams (H200) measured 0 bytes of graph memory:
    an earlier test's model, kept by a reference cycle (its ``pieces`` were then its own bound
    methods), was collected by the ``gc.collect(); empty_cache()`` that ``torch.cuda.graph``
    runs when a capture starts, so the trial capture's ``memory_reserved`` delta went below 0.
    Here 256 MiB of cyclic garbage waits for the collector while an engine starts: the
    measurement must match a clean start's, since the worker collects before its baselines."""
    import gc

    common = dict(device="cuda", max_model_len=256, gpu_memory_utilization=0.3, max_num_seqs=8)
    clean = LLM(str(tiny_model_dirs["qwen3"]), **common)
    clean_bytes = clean.cudagraph_memory_bytes
    del clean
    gc.collect()
    torch.cuda.empty_cache()
    assert clean_bytes > 0
    gc.disable()  # the garbage waits for a collect the engine runs
    try:
        garbage: list = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda")]
        garbage.append(garbage)  # a cycle: only the collector frees it
        del garbage
        llm = LLM(str(tiny_model_dirs["qwen3"]), **common)
    finally:
        gc.enable()
    assert clean_bytes / 2 <= llm.cudagraph_memory_bytes <= clean_bytes * 2, (llm.cudagraph_memory_bytes, clean_bytes)
