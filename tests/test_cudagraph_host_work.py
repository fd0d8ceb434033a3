"""What the host still does around a FULL decode graph, counted on the CPU (emulated graphs,
Triton under the interpreter): the LM head runs inside the graph (``cudagraph_capture.py``
NOTE 4), the step's inputs go up in one copy (``input_buffers.py`` NOTE 3), and what is left
for the host to dispatch is a handful of ops. The ``gpu`` twin, counted by the profiler, is
``test_gpu_a_full_decode_step_sends_its_inputs_up_in_one_copy`` in ``test_cudagraph_gpu.py``."""

import pytest
import torch
from test_cudagraph_generate import ENGINE, M
from test_generate import PROMPTS

from tinyvllm import LLM, SamplingParams


@pytest.mark.seed("000:capture")
@pytest.mark.slow
def test_a_full_step_takes_its_logits_from_the_graph(tiny_model_dirs, monkeypatch):
    """The LM head is part of what a FULL graph runs (``cudagraph_capture.py`` NOTE 4): a step
    that replays one launches no LM head of its own. Every other step runs it once, eagerly;
    the tokens are eager's."""
    from tinyvllm.worker.cuda_graph import CUDAGraphWrapper

    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm = LLM(str(tiny_model_dirs["qwen3"]), attention_backend="triton", async_scheduling=True,
              compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4]},
              **ENGINE)  # fmt: skip
    runner = llm.engine.model_runner
    calls = {"in_graph": 0, "outside": 0}
    replaying = []
    replay = CUDAGraphWrapper._replay

    def traced_replay(self, entry):
        replaying.append(self.runtime_mode)
        try:
            return replay(self, entry)
        finally:
            replaying.pop()

    compute_logits = runner.model.compute_logits

    def counted(hidden):
        calls["in_graph" if M.FULL in replaying else "outside"] += 1
        return compute_logits(hidden)

    def recording(engine_llm):  # the logits each step's sampler gets, copied: a graph's are overwritten
        runner, logits = engine_llm.engine.model_runner, []
        sampler = runner.sampler
        runner.sampler = lambda rows, metadata: (logits.append(rows.clone()), sampler(rows, metadata))[1]
        return logits

    monkeypatch.setattr(CUDAGraphWrapper, "_replay", traced_replay)
    monkeypatch.setattr(runner.model, "compute_logits", counted)
    logits = recording(llm)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = runner.cudagraph_stats
    assert stats[M.FULL] >= 4, dict(stats)
    assert calls == {"in_graph": stats[M.FULL], "outside": sum(stats.values()) - stats[M.FULL]}
    eager = LLM(str(tiny_model_dirs["qwen3"]), attention_backend="triton",
                compilation_config={"cudagraph_mode": "NONE"}, **ENGINE)  # fmt: skip
    eager_logits = recording(eager)
    assert tokens == [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert len(logits) == len(eager_logits)
    for a, b in zip(logits, eager_logits):  # the real requests' rows, not the padded ones
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_full_decode_step_dispatches_few_ops_besides_its_graph(tiny_model_dirs, async_scheduling):
    """What the host dispatches in a greedy decode step that replays a FULL graph, besides the
    replay itself: on a GPU each op is a launch or a call the host pays for while the device
    may idle. No LM head (``cudagraph_capture.py`` NOTE 4), no upload of indices, and the
    step's inputs in one copy (``input_buffers.py`` NOTE 3; on the CPU the buffer is the
    device's, so not even that): the last step's ids fed in (async only), the sampler's one
    reduction and its verdict, the ids for the host."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from tinyvllm.worker.cuda_graph import CUDAGraphWrapper

    llm = LLM(str(tiny_model_dirs["qwen3"]), attention_backend="triton", async_scheduling=async_scheduling,
              compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4]},
              **(ENGINE | {"num_gpu_blocks_override": 32}))  # fmt: skip
    engine, runner = llm.engine, llm.engine.model_runner
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(f"r{i}", prompt, params)
    while runner.last_dispatch is None or not runner.last_dispatch.uniform_decode or engine.scheduler.waiting:
        engine.step()
    engine.step()  # the first decode step after a prefill feeds nothing from the device yet
    ops: Counter = Counter()
    replaying = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not replaying:
                ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    replay = CUDAGraphWrapper._replay

    def traced_replay(self, entry):
        replaying.append(entry)
        try:
            return replay(self, entry)
        finally:
            replaying.pop()

    CUDAGraphWrapper._replay = traced_replay
    try:
        with Count():
            for _ in range(3):
                engine.step()
                assert runner.last_dispatch.runtime_mode == M.FULL and runner.last_dispatch.num_reqs == 4
    finally:
        CUDAGraphWrapper._replay = replay
    per_step = {name: n / 3 for name, n in ops.items()}
    expected = {"slice": 1, "to": 1, "max": 1, "gt": 1, "bitwise_not": 1, "where": 1, "resolve_conj": 1, "resolve_neg": 1}
    if async_scheduling:
        expected |= {"index": 1, "index_copy_": 1}  # the last step's ids, fed in on the device
    assert per_step == expected
