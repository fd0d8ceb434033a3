"""Tutorial 07: CUDA graphs step by step — which graph runs each batch, and what padding costs.

Run: ``PYTHONPATH=src python tutorials/07_cuda_graphs.py`` (CPU; about twenty seconds).

The engine runs a tiny Qwen3 (random weights) with ``cudagraph_mode=FULL_AND_PIECEWISE``,
capture sizes 1, 2, 4, 8 and 16, a budget of 16 tokens per step and at most 4 requests. It
runs on the CPU even on a machine with a GPU, so its printout is the same everywhere, and
there the graphs are *emulated* (``CUDAGraphWrapper(emulate=True)``): every replay is
checked against what a real graph would assume, but nothing gets faster. For each step the
script prints the batch (request:scheduled tokens; ``p`` marks prompt tokens, a prefill chunk
whole or partial: tutorial 02's ``*`` marks only a partial one), whether it
is a uniform decode batch, the runtime mode and ``BatchDescriptor`` the dispatcher chose,
and the padding: rows computed for nothing so that a captured shape fits.

What to look for (seed 000, vLLM's "CUDA Graphs" design doc):
- prefill and mixed batches dispatch to PIECEWISE graphs (FULL_AND_PIECEWISE's mixed
  routine): attention runs eagerly between the captured pieces;
- pure decode batches are uniform and dispatch to FULL graphs whose key names the
  (padded) request count;
- a batch of 3 tokens runs as 4: one padding row; a batch above 16 tokens would run eagerly.
Finally the same workload runs with NONE, and the tokens must be identical.
"""

import os
import tempfile

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The engine below runs on the CPU even where a GPU exists (so the printout, and its golden
# file, is the same on every machine), and Triton kernels reach CPU tensors only through the
# interpreter: set it before the kernels are imported, GPU or not.
os.environ["TRITON_INTERPRET"] = "1"

from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.models.tiny import build_tiny_model  # noqa: E402

NAMES = "ABCDE"
PROMPTS = [list(range(100, 120)), list(range(200, 207)), [300, 301, 302], list(range(100, 108)) + [7, 8, 9], [42]]
MAX_TOKENS = [4, 6, 3, 5, 7]


def make_llm(folder: str, mode: str) -> LLM:
    return LLM(
        folder, device="cpu", attention_backend="triton", max_model_len=64, block_size=16,
        max_num_batched_tokens=16, max_num_seqs=4,
        compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4, 8, 16]},
    )  # fmt: skip


def describe(desc) -> str:
    return f"({desc.num_tokens}, {desc.num_reqs}, {'uniform' if desc.uniform else 'mixed'})"


def run(folder: str, mode: str, verbose: bool) -> list[list[int]]:
    llm = make_llm(folder, mode)
    engine, runner = llm.engine, llm.engine.model_runner
    if verbose:
        print(f"resolved cudagraph_mode: {runner.cudagraph_mode.name} (emulated: {runner.emulate_cudagraphs})")
        for graph_mode, descs in runner.dispatcher.get_capture_descs():
            print(f"  captured {graph_mode.name:9} graphs: " + " ".join(describe(d) for d in descs))
        print()
        print("step | batch                      | tokens | uniform | mode      | descriptor          | padding")
        print("-----+----------------------------+--------+---------+-----------+---------------------+--------")
    schedule, outputs = engine.scheduler.schedule, []

    def peek():  # keep each SchedulerOutput to print the batch
        outputs.append(schedule())
        return outputs[-1]

    engine.scheduler.schedule = peek
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    for name, prompt, p in zip(NAMES, PROMPTS, params):
        engine.add_request(name, prompt, p)
    finished, step, padding, scheduled = {}, 0, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out.outputs[0].token_ids
        padding += runner.last_dispatch.num_padding_tokens
        scheduled += runner.last_dispatch.num_tokens
        if verbose:
            sched, d = outputs[-1], runner.last_dispatch
            prefill = {r.req_id for r in sched.scheduled_new_reqs}
            prefill |= {r.req_id for r in sched.scheduled_cached_reqs if r.num_computed_tokens < len(PROMPTS[NAMES.index(r.req_id)])}
            batch = " ".join(f"{r}:{n}{'p' if r in prefill else ''}" for r, n in sched.num_scheduled_tokens.items())
            print(
                f"{step:4} | {batch:26} | {d.num_tokens:6} | {'yes' if d.uniform_decode else 'no':7} | "
                f"{d.runtime_mode.name:9} | {describe(d.batch_descriptor):19} | {d.num_padding_tokens}"
            )
        step += 1
    if verbose:
        print("\nbatch      request:tokens scheduled; p = prompt tokens (a prefill chunk, whole or partial)")
        stats = runner.cudagraph_stats
        print("\nsteps by runtime mode: " + ", ".join(f"{m.name} {stats[m]}" for m in sorted(stats, key=lambda m: m.value)))
        print(f"padding rows: {padding} computed for nothing, beside {scheduled} scheduled tokens")
    return [finished[name] for name in NAMES]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(build_tiny_model(os.path.join(tmp, "qwen3"), "qwen3"))
        print("== FULL_AND_PIECEWISE, emulated on the CPU ==")
        graphs = run(folder, "FULL_AND_PIECEWISE", verbose=True)
        eager = run(folder, "NONE", verbose=False)
        print(f"\ntokens equal eager (NONE) execution: {'yes' if graphs == eager else 'NO'}")


if __name__ == "__main__":
    main()
