"""The speculative-decoding workload shared by ``test_spec_decode.py`` (emulated CUDA graphs on
the CPU) and its ``gpu`` twin ``test_spec_decode_gpu.py``: prompts that give the n-gram
proposer drafts at once, and two rounds of them through one engine, the second hitting the
first round's cached blocks, with an abort while drafts are in flight."""

from __future__ import annotations

SPEC = {"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
LOOP = [5, 6, 7, 8, 9, 10] * 3  # repeats itself: the proposer finds drafts at once
PROMPTS = [LOOP, list(range(20, 40)) * 2, [7, 300, 12, 44, 7, 300], LOOP[:9] + [99, 98, 97]]


def run_rounds_with_an_abort(engine, params, expected: list[list[int]], on_step=None) -> None:
    """Two rounds of ``PROMPTS``; in each, request 0 is aborted as soon as it carries drafts.
    The others must get ``expected``; the engine's invariants are checked after every step
    (after each rollback the runner's copies equal the scheduler's). ``on_step(engine)``, if
    given, is called after every step."""
    for round_ in range(2):  # the second round hits the first round's blocks
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"{round_}-{i}", prompt, params)
        victim, aborted, finished = engine.scheduler.requests[f"{round_}-0"], False, {}
        while engine.has_unfinished_requests():
            finished |= {o.request_id: o.outputs[0].token_ids for o in engine.step()}
            engine.check_invariants()
            if on_step is not None:
                on_step(engine)
            if victim.spec_token_ids and not aborted:
                engine.abort_request(victim.request_id)  # drafts in flight
                aborted = True
        assert aborted, f"round {round_}: request 0 never carried drafts"
        assert [finished[f"{round_}-{i}"] for i in range(1, 4)] == expected, f"round {round_}"
