"""Benchmarks of one scheduler step: ``schedule()`` + ``update_from_output()`` on CPU.

Concept: what the scheduler itself costs per engine step, with a trivial fake model
(one constant-time token per request), so the figure is pure Python bookkeeping:
queues, the token budget, ``allocate_slots``, block hashing of newly full blocks, stop
checks and the SchedulerOutput.

Cases:
- ``test_bench_scheduler_step_256_decodes``: 256 requests in steady decode (each step
  schedules one token per request and appends one), a pool far larger than needed and
  huge ``max_tokens``, so nothing finishes, preempts or is admitted while it is timed.
- ``test_bench_scheduler_step_mixed_workload``: budget 2048, chunked prefill; new prompts
  that share a few long "system prompt" prefixes arrive every step while others decode
  and finish, so each step mixes prefix-cache hits at admission, prompt chunks, decodes
  and frees.

Run: ``pytest bench/test_bench_scheduler.py --benchmark-only``. Each case records the
mean and median microseconds per step (``us_per_step_mean``, ``us_per_step_median``) and
what a step did on average in ``extra_info``.

NOTE 1 (pedantic, fixed rounds): a step changes the scheduler's state (every request
grows), so the rounds are fixed and the set-up leaves room for all of them, instead of
letting pytest-benchmark calibrate an open-ended number of iterations.
"""

from __future__ import annotations

import random

from tinyvllm.config import CacheConfig, SchedulerConfig
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.outputs import ModelRunnerOutput
from tinyvllm.request import Request
from tinyvllm.sampling_params import SamplingParams

BLOCK_SIZE = 16
TOKEN = 7  # what the trivial fake model always samples


def trivial_runner_output(scheduler: Scheduler, num_scheduled_tokens) -> ModelRunnerOutput:
    """One ``TOKEN`` for every request whose step reached its last token, else nothing."""
    req_ids = list(num_scheduled_tokens)
    requests = scheduler.requests
    rows = [[TOKEN] if requests[rid].num_computed_tokens == requests[rid].num_tokens else [] for rid in req_ids]
    return ModelRunnerOutput(req_ids, {rid: i for i, rid in enumerate(req_ids)}, rows)


# -- 256 running decodes ------------------------------------------------------------------

NUM_DECODES = 256
DECODE_PROMPT_LEN = 100
DECODE_ROUNDS = 500


def test_bench_scheduler_step_256_decodes(benchmark) -> None:
    max_model_len = DECODE_PROMPT_LEN + 4 * DECODE_ROUNDS
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=NUM_DECODES, max_model_len=max_model_len),
        CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=NUM_DECODES * (max_model_len // BLOCK_SIZE + 1)),
    )
    rng = random.Random(0)
    for i in range(NUM_DECODES):
        prompt = [rng.randrange(32_000) for _ in range(DECODE_PROMPT_LEN)]
        scheduler.add_request(Request(f"d{i}", prompt, SamplingParams(max_tokens=10**6, ignore_eos=True)))
    # Prefill everything (2048 tokens a step), then run until all are in steady decode.
    for _ in range(100):
        out = scheduler.schedule()
        scheduler.update_from_output(out, trivial_runner_output(scheduler, out.num_scheduled_tokens))
        if out.total_num_scheduled_tokens == NUM_DECODES and all(
            r.num_output_tokens > 1 for r in scheduler.running
        ):
            break
    assert len(scheduler.running) == NUM_DECODES and not scheduler.waiting, (
        f"{len(scheduler.running)} running, {len(scheduler.waiting)} waiting after warm-up"
    )
    # Every request decodes one token per step: the runner output is the same every step.
    req_ids = [r.request_id for r in scheduler.running]
    runner_output = ModelRunnerOutput(req_ids, {rid: i for i, rid in enumerate(req_ids)}, [[TOKEN]] * NUM_DECODES)
    totals: list[int] = []

    def step() -> None:
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner_output)
        totals.append(out.total_num_scheduled_tokens)

    benchmark.pedantic(step, rounds=DECODE_ROUNDS, iterations=1, warmup_rounds=5)

    assert totals and set(totals) == {NUM_DECODES}, f"steps scheduled {sorted(set(totals))} tokens, not 256 decodes"
    assert len(scheduler.running) == NUM_DECODES and scheduler.num_preemptions == 0, (
        f"{len(scheduler.running)} running, {scheduler.num_preemptions} preemptions during the benchmark"
    )
    stats = benchmark.stats.stats
    benchmark.extra_info.update(
        us_per_step_mean=round(stats.mean * 1e6, 1),
        us_per_step_median=round(stats.median * 1e6, 1),
        us_per_request_mean=round(stats.mean * 1e6 / NUM_DECODES, 2),
        num_running=NUM_DECODES,
        tokens_per_step=NUM_DECODES,
        kv_cache_usage=round(scheduler.get_stats().kv_cache_usage, 3),
    )


# -- a mixed workload -----------------------------------------------------------------------

NUM_SYSTEM_PROMPTS = 4
SYSTEM_PROMPT_LEN = 512
ARRIVALS_PER_STEP = 2
MIXED_WARMUP_STEPS = 100
MIXED_ROUNDS = 300


class MixedWorkload:
    """Prompts = one of a few system prompts + a unique question; arrivals every step.

    All arrivals are built up front, so a timed step pays for ``add_request`` but not for
    drawing random prompts or constructing ``Request`` objects."""

    def __init__(self, num_steps: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        system_prompts = [[rng.randrange(32_000) for _ in range(SYSTEM_PROMPT_LEN)] for _ in range(NUM_SYSTEM_PROMPTS)]
        self.arrivals: list[list[Request]] = []
        for step in range(num_steps):
            batch = []
            for j in range(ARRIVALS_PER_STEP):
                prompt = rng.choice(system_prompts) + [rng.randrange(32_000) for _ in range(rng.randint(16, 256))]
                params = SamplingParams(max_tokens=rng.randint(16, 128), ignore_eos=True)
                batch.append(Request(f"m{step}-{j}", prompt, params))
            self.arrivals.append(batch)
        self.arrivals.reverse()  # pop() from the end
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=2048,
                            enable_chunked_prefill=True),
            CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=16_384),
            log_stats=True,
        )
        self.scheduled_tokens: list[int] = []
        self.num_scheduled_reqs: list[int] = []
        self.num_finished = 0

    def reset_counters(self) -> None:
        self.scheduled_tokens.clear()
        self.num_scheduled_reqs.clear()
        self.num_finished = 0

    def step(self) -> None:
        for request in self.arrivals.pop():
            self.scheduler.add_request(request)
        out = self.scheduler.schedule()
        runner_output = trivial_runner_output(self.scheduler, out.num_scheduled_tokens)
        results = self.scheduler.update_from_output(out, runner_output)
        self.scheduled_tokens.append(out.total_num_scheduled_tokens)
        self.num_scheduled_reqs.append(out.num_scheduled_reqs)
        self.num_finished += sum(1 for o in results if o.finished)


def test_bench_scheduler_step_mixed_workload(benchmark) -> None:
    work = MixedWorkload(num_steps=MIXED_WARMUP_STEPS + MIXED_ROUNDS)
    for _ in range(MIXED_WARMUP_STEPS):  # reach a steady mix of prefills and decodes
        work.step()
    work.reset_counters()

    benchmark.pedantic(work.step, rounds=MIXED_ROUNDS, iterations=1, warmup_rounds=0)

    n = len(work.scheduled_tokens)
    assert n == MIXED_ROUNDS, f"{n} steps recorded"
    assert max(work.scheduled_tokens) <= 2048, f"a step scheduled {max(work.scheduled_tokens)} tokens"
    assert work.num_finished > 0, "no request finished during the benchmark: not a mixed workload"
    stats = benchmark.stats.stats
    sched_stats = work.scheduler.get_stats()
    benchmark.extra_info.update(
        us_per_step_mean=round(stats.mean * 1e6, 1),
        us_per_step_median=round(stats.median * 1e6, 1),
        mean_tokens_per_step=round(sum(work.scheduled_tokens) / n, 1),
        mean_requests_per_step=round(sum(work.num_scheduled_reqs) / n, 1),
        finished_per_step=round(work.num_finished / n, 2),
        running_at_end=sched_stats.num_running_reqs,
        waiting_at_end=sched_stats.num_waiting_reqs,
        prefix_cache_hit_rate=round(sched_stats.prefix_cache_hit_rate, 3),
        num_preemptions=sched_stats.num_preemptions,
    )
