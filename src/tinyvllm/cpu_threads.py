"""How many CPU threads torch runs the engine's ops on: chosen from the model's size.

Concept: torch splits an op across ``torch.get_num_threads()`` OpenMP threads (one per
core by default). For a small model that buys nothing: an op of a decode step is a few
microseconds of work, and the threads only meet at the op's end. On a machine where other
processes want the same cores, those meetings are where the time goes (NOTE 1). So the
command line runs a small model on one thread and a large one on torch's default;
``--threads N`` (``LLM(torch_threads=N)``) overrides, and ``OMP_NUM_THREADS`` in the
environment is the user's choice, kept. The start-up report says the count.

Mirrors: nothing in vLLM's GPU engine; its CPU worker sets ``torch.set_num_threads`` from
``VLLM_CPU_OMP_THREADS_BIND`` the same way, once, at start-up.

Invariants: ``choose_torch_threads`` is a pure function of its arguments; nothing here
changes torch's state (``LLM`` calls ``torch.set_num_threads`` after its checks).

NOTE 1 (why a busy machine hurts, and why the main thread was slower than a worker
thread): torch's CPU build uses GNU OpenMP. At the end of each parallel region a thread
that finished first spins, waiting for the others, up to ``GOMP_SPINCOUNT`` (300,000 spins
by default) before it sleeps. With two cores and another busy process, the team's other
thread is often not running, so the spinning one burns the core it would need. libgomp
throttles the spin to 1,000 once the process holds more OpenMP threads than there are CPUs:
a worker thread's team, added to the main thread's, crosses that line, so the same op ran
3-4x faster on a worker thread (the server steps on one) than on the main thread, where
``tinyvllm generate`` runs; per-thread CPU time showed the main thread's team burning about
ten times the CPU for the same work, and ``GOMP_SPINCOUNT=1000`` or ``OMP_WAIT_POLICY=PASSIVE``
made the main thread as fast as the worker. One thread has no team and nothing to wait for.
NOTE 2 (the rule): under ``SMALL_MODEL_PARAMETERS`` one thread, else torch's default.
Measured on the 2-core CI machine (docs/generating_text_cli.md, "CPU threads"): the shipped 5.7M model ran
as fast on one thread as on two with the machine to itself, and 3-6x faster with another
process busy; a decode matmul of Qwen3-0.6B's shape gained at most 1.2x from a second
thread, and nothing with the machine busy. The line between (100M) is a judgement: where
one op's work starts to outweigh the threads' meeting.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

SMALL_MODEL_PARAMETERS = 100_000_000  # NOTE 2


def count_parameters(
    vocab_size: int, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
    num_attention_heads: int, num_key_value_heads: int, head_dim: int, tie_word_embeddings: bool,
) -> int:  # fmt: skip
    """The weights of a Qwen3/Qwen2/Llama decoder from its config (norms and biases left out)."""
    q, kv = num_attention_heads * head_dim, num_key_value_heads * head_dim
    layer = hidden_size * (q + 2 * kv) + q * hidden_size + 3 * hidden_size * intermediate_size
    embeddings = vocab_size * hidden_size * (1 if tie_word_embeddings else 2)
    return embeddings + num_hidden_layers * layer


def choose_torch_threads(num_parameters: int, on_cpu: bool, environ: Mapping[str, str] = os.environ) -> int | None:
    """The thread count for the engine, or None to leave torch's as it is (NOTE 2): on a GPU,
    when ``OMP_NUM_THREADS`` is set, or for a model of ``SMALL_MODEL_PARAMETERS`` or more."""
    if not on_cpu or environ.get("OMP_NUM_THREADS"):
        return None
    return 1 if num_parameters < SMALL_MODEL_PARAMETERS else None
