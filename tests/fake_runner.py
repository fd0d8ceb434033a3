"""A fake model runner for scheduler tests: no weights, deterministic tokens.

The next token is a fixed function of the request's whole token sequence, so a request's
outputs do not depend on how its steps were chunked, batched or preempted. That is the
property a real model has too (up to floating point), which lets tests compare runs.
"""

from tinyvllm.core.sched_output import SchedulerOutput
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.outputs import ModelRunnerOutput

VOCAB = 1000


def next_token(token_ids: list[int]) -> int:
    h = 17
    for t in token_ids:
        h = (h * 31 + t) % 1_000_003
    return h % VOCAB


def fake_execute(scheduler: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """Sample one token for every scheduled request whose step reached its last token."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        r = scheduler.requests[rid]
        sampled.append([next_token(r.all_token_ids)] if r.num_computed_tokens == r.num_tokens else [])
    return ModelRunnerOutput(req_ids, {rid: i for i, rid in enumerate(req_ids)}, sampled)


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> dict[str, list[int]]:
    """Step until every request finished; return each request's output tokens."""
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        out = scheduler.schedule()
        for o in scheduler.update_from_output(out, fake_execute(scheduler, out)):
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        scheduler.check_invariants()
    raise AssertionError(f"requests still unfinished after {max_steps} steps")
