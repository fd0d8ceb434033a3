"""Tutorial 02: the scheduler, step by step (seed 002 opening and §3.1).

Runs a small workload through ``Scheduler`` and prints one table row per engine step, so
the mechanisms of seed 002's opening can be watched at work:

- the token budget (10 tokens a step) cuts prompts into chunks: chunked prefill. A step
  that stops before the end of a request's tokens samples nothing for it (``*``);
- a request admitted from the waiting queue looks up the prefix cache: C shares A's
  8-token system prompt and hits it (seed 002 §3.1: hits only at admission);
- the pool is tiny (10 blocks of 4 tokens), so decodes run it dry and the scheduler
  preempts the *last* running request (recompute: it frees its blocks, drops to zero
  computed tokens and goes to the front of the waiting queue);
- the preempted request is admitted again later and re-hits its own prefix, because its
  freed blocks stay cached until something evicts them.

The workload: block_size 4, 10 blocks, ``max_num_batched_tokens`` 10.

    A  arrives at step 0: the 8-token system prompt + 4 tokens of its own, 6 outputs
    B  arrives at step 0: 10 tokens shared with nobody, 6 outputs
    C  arrives at step 2: the 8-token system prompt + 3 tokens of its own, 6 outputs

There is no model. The fake one below makes each next token a fixed function of the
request's whole token sequence (like ``tests/fake_runner.py``), so a request's outputs
do not depend on how its steps were chunked, batched or preempted. The script checks that
at the end against a run with a roomy pool and budget.

Columns (all read after the step's ``update_from_output``):

    tokens     tokens scheduled per request this step; * = partial prefill, no token
    running    the running queue, in order
    waiting    the waiting queue, front first
    free       blocks in the free queue (cached ones included: they can still be hit)
    hits       prefix-cache tokens of requests admitted this step (new or resumed)
    preempted  requests preempted in this step
    finished   requests that finished in this step, with their finish reason

The output is deterministic (no hash values, no addresses), so the docs embed it and a
test checks it:

    run:         PYTHONPATH=src python tutorials/02_scheduler.py
    regenerate:  python tutorials/regenerate_golden.py 02
    checked by:  tests/test_tutorial_pages.py, tests/test_tutorial_02_scheduler.py
"""

from __future__ import annotations

from tinyvllm.config import CacheConfig, SchedulerConfig
from tinyvllm.core.sched_output import SchedulerOutput
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.outputs import ModelRunnerOutput
from tinyvllm.request import Request
from tinyvllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 10
TOKEN_BUDGET = 10
MAX_MODEL_LEN = 64
MAX_TOKENS = 6

SYSTEM_PROMPT = list(range(1, 9))  # 8 tokens = 2 full blocks, shared by A and C

# step of arrival -> (request id, prompt token ids)
ARRIVALS: dict[int, list[tuple[str, list[int]]]] = {
    0: [("A", SYSTEM_PROMPT + [11, 12, 13, 14]), ("B", list(range(21, 31)))],
    2: [("C", SYSTEM_PROMPT + [41, 42, 43])],
}

COLUMNS = ("step", "tokens", "running", "waiting", "free", "hits", "preempted", "finished")
WIDTHS = (4, 16, 9, 9, 4, 15, 9, 11)


# -- the fake model ------------------------------------------------------------------


def next_token(token_ids: list[int]) -> int:
    """The fake model: the next token is a fixed function of all tokens so far."""
    h = 17
    for t in token_ids:
        h = (h * 31 + t) % 1_000_003
    return h % 1000


def is_complete(request: Request) -> bool:
    """Whether every token of ``request`` is computed (read right after ``schedule()``)."""
    return request.num_computed_tokens == request.num_tokens


def fake_execute(scheduler: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """Sample one token for each scheduled request whose step reached its last token.

    ``schedule()`` has already advanced ``num_computed_tokens`` to the step's end, so a
    request that is complete now is one whose step reached its last token.
    """
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        r = scheduler.requests[rid]
        sampled.append([next_token(r.all_token_ids)] if is_complete(r) else [])
    return ModelRunnerOutput(req_ids, {rid: i for i, rid in enumerate(req_ids)}, sampled)


# -- running the workload ---------------------------------------------------------------


def make_scheduler(num_blocks: int, budget: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_model_len=MAX_MODEL_LEN),
        CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=num_blocks),
        log_stats=True,
    )


def step_row(
    step: int, scheduler: Scheduler, out: SchedulerOutput, partial: set[str], finished: dict[str, str]
) -> tuple[str, ...]:
    """One table row, read after ``update_from_output``."""
    tokens = [f"{rid}:{n}{'*' if rid in partial else ''}" for rid, n in out.num_scheduled_tokens.items()]
    hits = [f"{d.req_id}:{d.num_computed_tokens}" for d in out.scheduled_new_reqs]
    hits += [
        f"{d.req_id}:{d.num_computed_tokens} resumed" for d in out.scheduled_cached_reqs if d.resumed_from_preemption
    ]
    return (
        str(step),
        " ".join(tokens) or "-",
        " ".join(r.request_id for r in scheduler.running) or "-",
        " ".join(r.request_id for r in scheduler.waiting) or "-",
        str(scheduler.kv_cache_manager.block_pool.get_num_free_blocks()),
        " ".join(hits) or "-",
        " ".join(sorted(out.preempted_req_ids)) or "-",
        " ".join(f"{rid} ({reason})" for rid, reason in finished.items()) or "-",
    )


def run(num_blocks: int, budget: int) -> tuple[Scheduler, list[tuple[str, ...]], dict[str, list[int]]]:
    """Run the workload to the end; return the scheduler, the table rows and the outputs."""
    scheduler = make_scheduler(num_blocks, budget)
    rows: list[tuple[str, ...]] = []
    outputs: dict[str, list[int]] = {}
    step = 0
    while step <= max(ARRIVALS) or scheduler.has_unfinished_requests():
        for rid, prompt in ARRIVALS.get(step, []):
            scheduler.add_request(Request(rid, prompt, SamplingParams(max_tokens=MAX_TOKENS)))
        out = scheduler.schedule()
        # schedule() has advanced num_computed_tokens to the step's end: still short of
        # num_tokens means the step stopped inside the request's tokens.
        partial = {rid for rid in out.num_scheduled_tokens if not is_complete(scheduler.requests[rid])}
        finished: dict[str, str] = {}
        for o in scheduler.update_from_output(out, fake_execute(scheduler, out)):
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finished[o.request_id] = o.finish_reason
        scheduler.check_invariants()
        rows.append(step_row(step, scheduler, out, partial, finished))
        step += 1
    return scheduler, rows, outputs


def format_row(cells: tuple[str, ...]) -> str:
    return " | ".join(cell.ljust(width) for cell, width in zip(cells, WIDTHS)).rstrip()


def main() -> None:
    print(f"block_size {BLOCK_SIZE}, {NUM_BLOCKS} blocks, max_num_batched_tokens {TOKEN_BUDGET}, "
          f"max_tokens {MAX_TOKENS} for every request")
    for step, arrivals in ARRIVALS.items():
        for rid, prompt in arrivals:
            if prompt[: len(SYSTEM_PROMPT)] == SYSTEM_PROMPT:
                parts = f"the system prompt ({len(SYSTEM_PROMPT)}) + {len(prompt) - len(SYSTEM_PROMPT)} of its own"
            else:
                parts = "shared with nobody"
            print(f"  {rid} arrives at step {step}: {len(prompt)} prompt tokens, {parts}")
    print()
    scheduler, rows, outputs = run(NUM_BLOCKS, TOKEN_BUDGET)
    print(format_row(COLUMNS))
    print("-+-".join("-" * width for width in WIDTHS))
    for row in rows:
        print(format_row(row))
    print()
    print("tokens     tokens scheduled per request; * = partial prefill: the step stops before")
    print("           the request's last token, so nothing is sampled for it")
    print("running    the running queue after the step, in order")
    print("waiting    the waiting queue after the step, front first")
    print("free       blocks in the free queue (cached ones included: they can still be hit)")
    print("hits       prefix-cache tokens of requests admitted in this step (new or resumed)")
    print()
    stats = scheduler.get_stats()
    print(f"preemptions: {stats.num_preemptions}")
    print(f"prefix-cache hit rate: {stats.prefix_cache_hit_rate:.1%} of the tokens looked up at admission")
    print(f"free blocks at the end: {scheduler.kv_cache_manager.block_pool.get_num_free_blocks()} of {NUM_BLOCKS}")
    print()
    print("outputs:")
    for rid in sorted(outputs):
        print(f"  {rid}: {outputs[rid]}")
    _, roomy_rows, roomy = run(num_blocks=100, budget=100)
    same = "yes" if roomy == outputs else "NO"
    print(f"same outputs with 100 blocks and a budget of 100 ({len(roomy_rows)} steps, "
          f"no chunking, no preemption): {same}")


if __name__ == "__main__":
    main()
