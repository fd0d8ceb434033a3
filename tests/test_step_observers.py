"""``engine/step_observers.py``: observers added and removed by another thread while the engine steps.

The engine loops over a tuple that ``add_observer`` and ``remove_observer`` replace whole
(NOTE 1), so a thread other than the engine's may change the observers mid-run: no step
raises, and each observer added for a while hears of a contiguous run of steps (none
skipped while it was attached), which a witness observer attached throughout numbers.
"""

from __future__ import annotations

import threading
import time

from tinyvllm import LLM, SamplingParams
from tinyvllm.trace.workloads import tiny_model_folder


class Witness:
    def __init__(self) -> None:
        self.steps = 0

    def on_step(self, engine, scheduler_output, core_outputs, error) -> None:
        self.steps += 1


class Visitor:
    """Notes the witness's count at each step it hears of."""

    def __init__(self, witness: Witness) -> None:
        self.witness, self.seen = witness, []

    def on_step(self, engine, scheduler_output, core_outputs, error) -> None:
        self.seen.append(self.witness.steps)


def test_observers_added_and_removed_from_another_thread_hear_of_contiguous_steps():
    llm = LLM(tiny_model_folder(), device="cpu", max_model_len=128, block_size=4, num_gpu_blocks_override=64,
              enable_prefix_caching=False)  # fmt: skip
    engine, witness = llm.engine, Witness()
    engine.add_observer(witness)  # first: a visitor reads the count of the steps before its own
    visitors, stop, errors = [], threading.Event(), []

    def churn() -> None:
        try:
            while not stop.is_set():
                visitor = Visitor(witness)
                engine.add_observer(visitor)
                time.sleep(0.002)
                engine.remove_observer(visitor)
                visitors.append(visitor)
        except Exception as error:  # noqa: BLE001  (reported below, in the test's thread)
            errors.append(error)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}], params, use_tqdm=False)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not errors and not thread.is_alive()
    assert [len(o.outputs[0].token_ids) for o in outs] == [60, 60]
    assert engine.observers == (witness,) and witness.steps >= 60
    heard = [v.seen for v in visitors if v.seen]
    assert heard, "no visitor was attached during a step"
    for seen in heard:
        assert seen == list(range(seen[0], seen[0] + len(seen))), f"a visitor skipped a step: {seen}"
    engine.remove_observer(witness)


def test_an_observer_whose_on_launch_raises_leaves_the_async_engine_and_the_others_alone(caplog):
    """Under async scheduling a launch that no read-back follows is told to each observer with
    an ``on_launch``; one that raises there is logged, the others still hear of it, and the
    engine's tokens are the synchronous engine's."""

    class Launches:
        def __init__(self, fail: bool) -> None:
            self.fail, self.launched = fail, []

        def on_step(self, engine, scheduler_output, core_outputs, error) -> None:
            pass

        def on_launch(self, engine, scheduler_output) -> None:
            self.launched.append(sorted(scheduler_output.num_scheduled_tokens))
            if self.fail:
                raise RuntimeError("the observer's own bug at a launch")

    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    kwargs = dict(device="cpu", max_model_len=64, block_size=4, num_gpu_blocks_override=32)
    sync = [o.outputs[0].token_ids for o in LLM(tiny_model_folder(), **kwargs).generate(prompts, params, use_tqdm=False)]
    llm = LLM(tiny_model_folder(), async_scheduling=True, **kwargs)
    failing, quiet = Launches(fail=True), Launches(fail=False)
    llm.engine.add_observer(failing)
    llm.engine.add_observer(quiet)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == sync
    request_ids = sorted(o.request_id for o in outs)
    assert failing.launched == quiet.launched == [request_ids], "one launch with no read-back: the first"
    assert "raised at a launch" in caplog.text
