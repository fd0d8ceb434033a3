"""Replay workloads through tinyvllm's ``Scheduler`` and vLLM's, step by step, and compare every decision.

What is compared, each step: the requests scheduled and their token counts, in scheduling order;
each admitted request's prefix-cache hit and block table, each running request's new blocks
(vLLM's ids less one: its block 0 is the null block, ``core/block_pool.py`` NOTE 1), who was
preempted and who resumed, and who finished. Both schedulers are driven alike: the same
arrivals, and a fake model whose next token is a fixed function of a request's tokens
(``trace/workloads.py``'s ``fake_next_token``), so the two runs see the same tokens while they
agree. The first step where they differ is reported with both decisions.

The workloads: the hand-written cases below (chunked prefill under a small budget, a prefix hit,
preemption when the pool runs dry, the long-prefill threshold, priorities) and ``--random N``
seeded ones that draw the budget, the pool, the block size, prefix caching and the arrivals.

vLLM is not a dependency of tinyvllm (its wheel pulls a CUDA torch), so this script takes vLLM's
Python source from ``--vllm-src``: ``pip download vllm==X --no-deps``, unzip its ``vllm/``
package, and put its import-time dependencies (cbor2, psutil, pyzmq, msgspec, ... as the
import errors name them) on ``PYTHONPATH`` too. Only the scheduler's Python runs: no kernel,
no model. ``bench/results/vllm_scheduler_replay_<version>.json`` records a run: every workload's
step count, whether the two differed, where, and which known difference (``KNOWN``) explains it.

    PYTHONPATH=src:/tmp/vllm_src:/tmp/vllm_deps python bench/vllm_scheduler_replay.py --random 200
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from tinyvllm.config import CacheConfig as TinyCacheConfig  # noqa: E402
from tinyvllm.config import SchedulerConfig as TinySchedulerConfig  # noqa: E402
from tinyvllm.core.scheduler import Scheduler as TinyScheduler  # noqa: E402
from tinyvllm.outputs import ModelRunnerOutput as TinyModelRunnerOutput  # noqa: E402
from tinyvllm.request import Request as TinyRequest  # noqa: E402
from tinyvllm.sampling_params import SamplingParams as TinySamplingParams  # noqa: E402
from tinyvllm.trace.workloads import fake_next_token, fake_samples  # noqa: E402


@dataclass(frozen=True)
class Arrival:
    step: int
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    priority: int = 0


@dataclass(frozen=True)
class Workload:
    name: str
    arrivals: tuple[Arrival, ...]
    max_num_batched_tokens: int
    num_blocks: int
    block_size: int = 4
    max_num_seqs: int = 8
    max_model_len: int = 64
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    num_speculative_tokens: int = 0  # k > 0: each decoding request gets up to k drafts a step (fake_drafts)


@dataclass
class Step:
    """One step's decisions, as plain values both schedulers are reduced to."""

    scheduled: list[tuple[str, int]] = field(default_factory=list)  # (request, tokens) in scheduling order
    # (request, computed tokens at admission: its prefix hit, its block table, resumed after a preemption),
    # sorted: vLLM 0.33 sends a resumed request as a new one, tinyvllm and vLLM 0.11 as a cached one
    admitted: list[tuple[str, int, tuple[int, ...], bool]] = field(default_factory=list)
    new_blocks: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # a running request's, in order
    drafts: list[tuple[str, int]] = field(default_factory=list)  # (request, drafts it verifies), in order
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("scheduled", "admitted", "new_blocks", "drafts", "preempted", "finished")}


def fake_drafts(token_ids: list[int], k: int, room: int) -> list[int]:
    """A proposer's drafts for a request with ``token_ids``: the fake model's next ``k`` tokens,
    the one at a position the tokens choose (0..k) replaced, so that the target keeps that many;
    at most ``room`` (the request's tokens may not pass ``max_model_len``)."""
    seq, drafts = list(token_ids), []
    wrong_at = fake_next_token(seq + [7]) % (k + 1)
    for j in range(min(k, room)):
        t = fake_next_token(seq)
        drafts.append(t if j < wrong_at else (t + 1) % 1000)
        seq.append(drafts[-1])
    return drafts


def verified(token_ids: list[int], drafts: list[int]) -> list[int]:
    """What the fake target samples for a step that verifies ``drafts`` after ``token_ids``: the
    drafts it agrees with, then its own next token."""
    seq, kept = list(token_ids), []
    for t in drafts:
        if t != fake_next_token(seq):
            break
        kept.append(t)
        seq.append(t)
    return [*kept, fake_next_token(seq)]


def step_samples(requests, request_ids: list[str], spec: dict) -> list[list[int]]:
    """Each request's sampled tokens in a step that ran ``request_ids`` (its drafts in ``spec``):
    none for a partial prefill, else the verified drafts and one token (``fake_samples``)."""
    if not spec:
        return fake_samples(requests, request_ids)
    out = []
    for rid in request_ids:
        r, drafts = requests[rid], list(spec.get(rid, ()))
        done = r.num_computed_tokens == r.num_tokens + len(drafts)
        out.append(verified(list(r.all_token_ids), drafts) if done else [])
    return out


def _arrivals(workload: Workload) -> dict[int, list[tuple[Arrival, float]]]:
    """Each step's arrivals, each with its arrival time: distinct, in the workload's order (the
    priority queues order equal priorities by it; vLLM 0.11's heap cannot compare two requests)."""
    by_step: dict[int, list[tuple[Arrival, float]]] = {}
    for i, a in enumerate(workload.arrivals):
        by_step.setdefault(a.step, []).append((a, a.step + i / 1000))
    return by_step


def run_tinyvllm(w: Workload, max_steps: int = 2000) -> list[Step]:
    scheduler = TinyScheduler(
        TinySchedulerConfig(max_num_batched_tokens=w.max_num_batched_tokens, max_num_seqs=w.max_num_seqs,
                            max_model_len=w.max_model_len, long_prefill_token_threshold=w.long_prefill_token_threshold,
                            policy=w.policy, enable_chunked_prefill=w.enable_chunked_prefill),
        TinyCacheConfig(block_size=w.block_size, num_gpu_blocks=w.num_blocks, enable_prefix_caching=w.enable_prefix_caching),
    )  # fmt: skip
    arrivals, steps, step = _arrivals(w), [], 0
    while (step <= max(arrivals) or scheduler.has_unfinished_requests()) and step < max_steps:
        for a, arrival_time in arrivals.get(step, []):
            params = TinySamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
            scheduler.add_request(TinyRequest(a.request_id, list(a.prompt), params, priority=a.priority, arrival_time=arrival_time))
        out = scheduler.schedule()
        record = Step(scheduled=list(out.num_scheduled_tokens.items()))
        admitted = [(d.req_id, d.num_computed_tokens, tuple(d.block_ids), False) for d in out.scheduled_new_reqs]
        admitted += [(d.req_id, d.num_computed_tokens, tuple(d.new_block_ids), True)
                     for d in out.scheduled_cached_reqs if d.resumed_from_preemption]  # fmt: skip
        record.admitted = sorted(admitted)
        record.new_blocks = [(d.req_id, tuple(d.new_block_ids)) for d in out.scheduled_cached_reqs if not d.resumed_from_preemption]
        record.preempted = sorted(out.preempted_req_ids)
        spec = dict(out.scheduled_spec_decode_tokens)
        record.drafts = [(rid, len(d)) for rid, d in spec.items()]
        ids = list(out.num_scheduled_tokens)
        sampled = step_samples(scheduler.requests, ids, spec)
        outputs = scheduler.update_from_output(out, TinyModelRunnerOutput(ids, {rid: i for i, rid in enumerate(ids)}, sampled))
        record.finished = sorted(o.request_id for o in outputs if o.finish_reason is not None)
        if w.num_speculative_tokens:  # as the engine: the drafts of the step's requests cleared, then proposed
            sampled_now = {o.request_id for o in outputs if o.new_token_ids and o.finish_reason is None}
            for r in (scheduler.requests[rid] for rid in ids if rid in scheduler.requests):
                r.spec_token_ids = (fake_drafts(r.all_token_ids, w.num_speculative_tokens, w.max_model_len - r.num_tokens - 1)
                                    if r.request_id in sampled_now else [])  # fmt: skip
        steps.append(record)
        step += 1
    return steps


class VllmSide:
    """vLLM's scheduler, built from its own configs with no device and no model weights."""

    def __init__(self, model_folder: str) -> None:
        import torch
        from vllm.config import (
            CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig,
        )  # fmt: skip
        from vllm.sampling_params import SamplingParams
        try:
            from vllm.utils.hashing import sha256
        except ImportError:  # vLLM 0.11
            from vllm.utils import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager

        self.torch, self.folder = torch, model_folder
        self.CacheConfig, self.DeviceConfig, self.ModelConfig = CacheConfig, DeviceConfig, ModelConfig
        self.SchedulerConfig, self.VllmConfig, self.SamplingParams = SchedulerConfig, VllmConfig, SamplingParams
        self.Scheduler, self.KVCacheConfig, self.KVCacheGroupSpec = Scheduler, KVCacheConfig, KVCacheGroupSpec
        self.FullAttentionSpec, self.ModelRunnerOutput, self.Request = FullAttentionSpec, ModelRunnerOutput, Request
        self.StructuredOutputManager = StructuredOutputManager
        self.SpeculativeConfig, self.ParallelConfig = SpeculativeConfig, ParallelConfig
        self.DraftTokenIds = DraftTokenIds
        self.hash_fn, self.get_request_block_hasher = sha256, get_request_block_hasher
        init_none_hash(sha256)
        self.model_configs: dict[int, object] = {}
        self.aligned = []
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

        if hasattr(FreeKVCacheBlockQueue, "prepend_n"):  # ALIGNED: this vLLM reuses uncached blocks first
            BlockPool.free_blocks = documents_free_blocks
            self.aligned.append("free_blocks")
        if "scheduler_reserve_full_isl" in {f.name for f in dataclasses.fields(SchedulerConfig)}:
            self.aligned.append("scheduler_reserve_full_isl")
        self.request_args = set(inspect.signature(Request).parameters)

    def _runner_output(self, ids: list[str], sampled: list[list[int]]):
        """A ``ModelRunnerOutput`` with the sampled ids; its other fields empty (0.11 has no defaults)."""
        given = {"req_ids": ids, "req_id_to_index": {rid: i for i, rid in enumerate(ids)}, "sampled_token_ids": sampled}
        empty = {"prompt_logprobs_dict": {}, "pooler_output": []}
        fields = {f.name: f for f in dataclasses.fields(self.ModelRunnerOutput)}
        for name, f in fields.items():
            if name not in given and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                given[name] = empty.get(name)
        return self.ModelRunnerOutput(**given)

    def _model_config(self, max_model_len: int):
        if max_model_len not in self.model_configs:
            self.model_configs[max_model_len] = self.ModelConfig(model=self.folder, skip_tokenizer_init=True, dtype="float32",
                                                                 seed=0, max_model_len=max_model_len)  # fmt: skip
        return self.model_configs[max_model_len]

    def run(self, w: Workload, max_steps: int = 2000) -> list[Step]:
        sched = self.SchedulerConfig(max_num_seqs=w.max_num_seqs, max_num_batched_tokens=w.max_num_batched_tokens,
                                     max_model_len=w.max_model_len, enable_chunked_prefill=w.enable_chunked_prefill,
                                     is_encoder_decoder=False,
                                     long_prefill_token_threshold=w.long_prefill_token_threshold, policy=w.policy,
                                     **({"scheduler_reserve_full_isl": False} if "scheduler_reserve_full_isl" in self.aligned else {}))  # fmt: skip
        cache = self.CacheConfig(block_size=w.block_size, gpu_memory_utilization=0.9, cache_dtype="auto",
                                 enable_prefix_caching=w.enable_prefix_caching)  # fmt: skip
        model_config = self._model_config(w.max_model_len)
        spec = None if not w.num_speculative_tokens else self.SpeculativeConfig(  # n-gram drafts: no draft model
            method="ngram", num_speculative_tokens=w.num_speculative_tokens, prompt_lookup_max=3, prompt_lookup_min=1,
            target_model_config=model_config, target_parallel_config=self.ParallelConfig())  # fmt: skip
        config = self.VllmConfig(scheduler_config=sched, model_config=model_config, cache_config=cache,
                                 device_config=self.DeviceConfig(device="cpu"), speculative_config=spec)  # fmt: skip
        num_blocks = w.num_blocks + 1  # its block 0 is the null block
        cache.num_gpu_blocks = num_blocks
        spec = self.FullAttentionSpec(block_size=w.block_size, num_kv_heads=1, head_size=1, dtype=self.torch.float32)
        kv = self.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[self.KVCacheGroupSpec(["layer"], spec)])
        extra = {"block_size": w.block_size} if "block_size" in inspect.signature(self.Scheduler).parameters else {}
        scheduler = self.Scheduler(vllm_config=config, kv_cache_config=kv,
                                   structured_output_manager=self.StructuredOutputManager(config), **extra)  # fmt: skip
        hasher = self.get_request_block_hasher(w.block_size, self.hash_fn) if w.enable_prefix_caching else None
        arrivals, steps, step, seen = _arrivals(w), [], 0, set()
        while (step <= max(arrivals) or scheduler.has_unfinished_requests()) and step < max_steps:
            for a, arrival_time in arrivals.get(step, []):
                params = self.SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
                extra = {"eos_token_id": None} if "eos_token_id" in self.request_args else {}
                scheduler.add_request(self.Request(a.request_id, list(a.prompt), params, None, arrival_time=arrival_time,
                                                   priority=a.priority, block_hasher=hasher, **extra))  # fmt: skip
            running = [r.request_id for r in scheduler.running]
            out = scheduler.schedule()
            record = Step(scheduled=list(out.num_scheduled_tokens.items()))
            preempted = getattr(out, "preempted_req_ids", None)  # vLLM 0.11 has none: the status says
            record.preempted = sorted(preempted if preempted is not None else (
                rid for rid in running if scheduler.requests[rid].status.name == "PREEMPTED"))  # fmt: skip
            admitted = [(d.req_id, d.num_computed_tokens, tuple(b - 1 for b in d.block_ids[0]), d.req_id in seen)
                        for d in out.scheduled_new_reqs]  # fmt: skip
            seen.update(d.req_id for d in out.scheduled_new_reqs)
            cached = out.scheduled_cached_reqs
            flags = getattr(cached, "resumed_from_preemption", None)  # vLLM 0.11; 0.33: resumed_req_ids
            resumed = set(getattr(cached, "resumed_req_ids", ())) if flags is None else {
                rid for rid, flag in zip(cached.req_ids, flags) if flag}  # fmt: skip
            for i, (rid, blocks) in enumerate(zip(cached.req_ids, cached.new_block_ids)):
                ids = tuple(b - 1 for b in (blocks[0] if blocks else ()))
                if rid in resumed:
                    admitted.append((rid, cached.num_computed_tokens[i], ids, True))
                else:
                    record.new_blocks.append((rid, ids))
            record.admitted = sorted(admitted)
            spec = {rid: list(d) for rid, d in out.scheduled_spec_decode_tokens.items()}
            record.drafts = [(rid, len(d)) for rid, d in spec.items()]
            ids = list(out.num_scheduled_tokens)
            runner_output = self._runner_output(ids, step_samples(scheduler.requests, ids, spec))
            engine_outputs = scheduler.update_from_output(out, runner_output)
            outputs = [o for outs in engine_outputs.values() for o in outs.outputs]
            record.finished = sorted(o.request_id for o in outputs if o.finish_reason is not None)
            if w.num_speculative_tokens:  # as its runner: drafts for every request of the step, [] where none
                sampled_now = {o.request_id for o in outputs if o.new_token_ids and o.finish_reason is None}
                live = [rid for rid in ids if rid in scheduler.requests]
                proposals = [fake_drafts(list(scheduler.requests[rid].all_token_ids), w.num_speculative_tokens,
                                         w.max_model_len - scheduler.requests[rid].num_tokens - 1)
                             if rid in sampled_now else [] for rid in live]  # fmt: skip
                scheduler.update_draft_token_ids(self.DraftTokenIds(live, proposals))
            steps.append(record)
            step += 1
        return steps


# -- the workloads ---------------------------------------------------------------------------


def hand_written() -> list[Workload]:
    system = tuple(range(1, 9))
    return [
        Workload("chunked prefill, budget 10", (
            Arrival(0, "A", system + (11, 12, 13, 14), 6), Arrival(0, "B", tuple(range(21, 31)), 6),
            Arrival(2, "C", system + (41, 42, 43), 6)), max_num_batched_tokens=10, num_blocks=10),
        Workload("prefix hit at admission", (
            Arrival(0, "A", tuple(range(100, 162)), 3), Arrival(1, "B", tuple(range(100, 162)), 5),
            Arrival(4, "C", tuple(range(100, 162)) + (7, 8), 2)), max_num_batched_tokens=128, num_blocks=10, block_size=16,
            max_model_len=128),
        Workload("preemption when the pool runs dry", tuple(
            Arrival(0, f"r{i}", tuple(range(10 * i, 10 * i + 7)), 12) for i in range(4)),
            max_num_batched_tokens=32, num_blocks=9),
        Workload("long-prefill threshold", (
            Arrival(0, "long", tuple(range(200, 240)), 3), Arrival(1, "short", (5, 6, 7), 4)),
            max_num_batched_tokens=16, num_blocks=24, long_prefill_token_threshold=8),
        Workload("priorities: a victim already in its step", (
            Arrival(0, "low", tuple(range(100, 120)), 4, priority=5), Arrival(1, "urgent", tuple(range(1, 9)), 6, priority=0)),
            max_num_batched_tokens=16, num_blocks=7, long_prefill_token_threshold=8, policy="priority"),
        Workload("drafts in the budget", (
            Arrival(0, "loop", (5, 6, 7, 8) * 4, 12), Arrival(1, "other", tuple(range(40, 52)), 10),
            Arrival(3, "late", (5, 6, 7, 8) * 2 + (9,), 8)), max_num_batched_tokens=12, num_blocks=20,
            num_speculative_tokens=3),
    ]  # fmt: skip


def random_workload(seed: int) -> Workload:
    """Seed ``seed``'s workload: up to 12 requests over 10 steps, prompts sharing prefixes, a
    pool from one request's worth to four, budgets from 8 tokens, both policies, the threshold,
    prefix caching on or off, now and then chunked prefill off (a prompt whole or not at all),
    and in 4 of 7 up to k = 1-4 drafts a decode step (``fake_drafts``)."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8, 16])
    max_model_len = rng.choice([32, 48, 64])
    chunked = rng.random() < 0.85
    budget = rng.choice([8, 16, 32, 64]) if chunked else rng.choice([64, 96, 128])
    stems = [tuple(rng.randrange(3, 500) for _ in range(max_model_len)) for _ in range(3)]
    arrivals = []
    for i in range(rng.randint(1, 12)):
        prompt = stems[rng.randrange(3)][: rng.randint(0, max_model_len // 2)] + tuple(
            rng.randrange(3, 500) for _ in range(rng.randint(1, 10)))  # fmt: skip
        max_tokens = rng.randint(1, min(24, max_model_len - len(prompt)))
        arrivals.append(Arrival(rng.randint(0, 10), f"q{i}", prompt, max_tokens, priority=rng.randint(0, 3)))
    need = -(-max_model_len // block_size)  # one request of max_model_len fits
    return Workload(
        f"random {seed}", tuple(arrivals), max_num_batched_tokens=budget,
        num_blocks=need + rng.randint(0, 3 * need), block_size=block_size, max_num_seqs=rng.choice([1, 2, 4, 8]),
        max_model_len=max_model_len, enable_prefix_caching=rng.random() < 0.7,
        long_prefill_token_threshold=rng.choice([0, 0, 4, 8]) if chunked else 0,
        policy=rng.choice(["fcfs", "fcfs", "priority"]), enable_chunked_prefill=chunked,
        num_speculative_tokens=rng.choice([0, 0, 0, 1, 2, 3, 4]),
    )  # fmt: skip


# The differences tinyvllm keeps on purpose (docs/scheduler.md, "Checked against vLLM's scheduler"):
# a name, and how to recognise it at the first differing step.
KNOWN = {
    "victim_keeps_its_tokens": "vLLM 0.11: a priority victim scheduled earlier in its step keeps its tokens in the "
    "step (later vLLM gives them back, as tinyvllm does)",
    "lone_prefill_uncapped": "vLLM after the documents: the long-prefill threshold does not cap a request that is "
    "the only one running or waiting (tinyvllm caps every prefill, as the documents)",
    "stops_at_its_own_preemption": "vLLM 0.11: when the request being scheduled is itself the priority victim, the "
    "step stops there (later vLLM, and tinyvllm, still schedule the running requests after it)",
    "pads_an_admitted_decode": "vLLM after the documents: a request admitted with one token left to compute (after "
    "a prefix hit, or resumed) is scheduled with k placeholder drafts, so that a decode step stays uniform for full "
    "CUDA graphs, or waits when their slots do not fit (tinyvllm schedules its one token; drafts come after it samples)",
    "caches_accepted_drafts": "vLLM 0.11 caches a block that accepted drafts filled only when a later allocation "
    "covers it, so a request preempted right after finds it uncached on re-admission (later vLLM, and tinyvllm, "
    "cache it when the step is read back)",
    "skips_an_unfitting_prompt": "vLLM 0.11, chunked prefill off: a waiting request whose prompt exceeds the budget "
    "is passed over and those behind it admitted, which also reorders the queue (later vLLM stops there, as tinyvllm)",
}
# What today's vLLM does otherwise than the documents, and tinyvllm with them, set back to the
# documents' rule in vLLM before the replay (so that the rest is compared), where vLLM has it.
ALIGNED = {
    "scheduler_reserve_full_isl": "vLLM after the documents admits a request only if its whole prompt fits the KV "
    "cache (scheduler_reserve_full_isl, on by default); set False, the documents' rule: the first chunk must fit",
    "free_blocks": "vLLM after the documents puts a freed block without a hash at the head of the free queue; "
    "BlockPool.free_blocks replaced by the documents' rule: every freed block to the tail, in the order given",
}


def documents_free_blocks(self, ordered_blocks) -> None:
    """``ALIGNED["free_blocks"]``: vLLM's ``BlockPool.free_blocks`` with every freed block appended
    to the tail of the free queue, in the order given (the documents' rule, and tinyvllm's)."""
    freed, other_pools = [], {}
    for block in ordered_blocks:
        if getattr(block, "is_null", False):
            continue
        pool = getattr(block, "pool", None)
        if pool is not None and pool is not self:
            other_pools.setdefault(pool, []).append(block)
            continue
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            freed.append(block)
    self.free_block_queue.append_n(freed)
    for pool, blocks in other_pools.items():
        pool.free_blocks(blocks)


def known_difference(a: Step, b: Step, w: Workload) -> str | None:
    """Which of ``KNOWN`` explains the first differing step ``a`` (tinyvllm) and ``b`` (vLLM); None: none does."""
    if set(dict(b.scheduled)) & set(b.preempted) and not set(dict(a.scheduled)) & set(a.preempted):
        return "victim_keeps_its_tokens"
    k, ours, theirs, drafts = w.num_speculative_tokens, dict(a.scheduled), dict(b.scheduled), dict(b.drafts)
    if k and any(ours.get(r) == 1 and theirs.get(r) == 1 + k and drafts.get(r) == k for r, *_ in b.admitted):
        return "pads_an_admitted_decode"
    waits = [r for r, *_ in a.admitted if ours.get(r) == 1 and r not in theirs]  # its padded drafts' slots did not fit
    if k and waits and [x for x in a.scheduled if x[0] not in waits] == b.scheduled:
        return "pads_an_admitted_decode"
    if a.preempted and a.preempted == b.preempted and len(a.scheduled) > len(b.scheduled) and a.scheduled[: len(b.scheduled)] == b.scheduled:
        return "stops_at_its_own_preemption"  # tinyvllm's step is vLLM's, then more running requests
    ours_in, theirs_in = {r for r, *_ in a.admitted}, {r for r, *_ in b.admitted}
    hits = {r: c for r, c, _, resumed in a.admitted if resumed}
    if k and ours_in == theirs_in and any(r in hits and 0 < abs(c - hits[r]) <= k for r, c, _, resumed in b.admitted if resumed):
        return "caches_accepted_drafts"  # a resumed request finds up to k tokens more, or fewer, cached
    running = [x for x in a.scheduled if x[0] not in ours_in]
    if not w.enable_chunked_prefill and ours_in != theirs_in and running == [x for x in b.scheduled if x[0] not in theirs_in]:
        return "skips_an_unfitting_prompt"  # the running requests' part agrees; who is admitted does not
    t = w.long_prefill_token_threshold
    if t and len(a.scheduled) == len(b.scheduled) == 1 and a.scheduled[0][0] == b.scheduled[0][0] and a.scheduled[0][1] == t < b.scheduled[0][1]:
        return "lone_prefill_uncapped"
    return None


def compare(tiny: list[Step], theirs: list[Step]) -> dict | None:
    """The first step whose decisions differ, with both; None when every step agrees."""
    for index, (a, b) in enumerate(zip(tiny, theirs)):
        if a.as_dict() != b.as_dict():
            return {"step": index, "tinyvllm": a.as_dict(), "vllm": b.as_dict()}
    if len(tiny) != len(theirs):
        return {"step": min(len(tiny), len(theirs)), "tinyvllm_steps": len(tiny), "vllm_steps": len(theirs)}
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random", type=int, default=100, help="how many seeded random workloads after the hand-written ones")
    parser.add_argument("--model", default=None, help="a model folder for vLLM's ModelConfig (default: a tiny random Qwen3)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/vllm_scheduler_replay_<vLLM version>.json)")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import vllm
    except ImportError as error:
        print(f"vllm_scheduler_replay: vLLM's Python source is not importable ({error}); put it and its "
              "import-time dependencies on PYTHONPATH, as this script's header says", file=sys.stderr)  # fmt: skip
        return 2

    out = args.out or ROOT / f"bench/results/vllm_scheduler_replay_{vllm.__version__}.json"
    folder = args.model
    if folder is None:
        from tinyvllm.trace.workloads import tiny_model_folder

        folder = tiny_model_folder()
    side = VllmSide(folder)
    workloads = [*hand_written(), *(random_workload(seed) for seed in range(args.random))]
    results, start = [], time.perf_counter()
    for w in workloads:
        tiny = run_tinyvllm(w)
        try:
            theirs = side.run(w)
        except Exception as error:  # vLLM's own assertion, say: reported, and the replay goes on
            results.append({"workload": w.name, "steps": len(tiny), "same": False, "vllm_raised": f"{type(error).__name__}: {error}"})
            print(f"{w.name}: vLLM raised {type(error).__name__}", flush=True)
            continue
        diff = compare(tiny, theirs)
        known = None
        if diff is not None and "tinyvllm" in diff:
            known = known_difference(tiny[diff["step"]], theirs[diff["step"]], w)
        record = {"workload": w.name, "steps": len(tiny), "same": diff is None}
        if diff is not None:
            record.update(first_difference=diff, known=known)
        results.append(record)
        what = "same" if diff is None else f"differs at step {diff['step']}: {known or 'UNEXPLAINED'}"
        print(f"{w.name}: {len(tiny)} steps, {what}", flush=True)
    counts = {name: sum(r.get("known") == name for r in results) for name in KNOWN}
    unexplained = [r["workload"] for r in results if not r["same"] and r.get("known") is None and "vllm_raised" not in r]
    raised = [r["workload"] for r in results if "vllm_raised" in r]
    summary = {"vllm_version": vllm.__version__, "workloads": len(results), "same": sum(r["same"] for r in results),
               "aligned_to_the_documents": {name: ALIGNED[name] for name in side.aligned},
               "known_differences": counts, "known": KNOWN, "unexplained": unexplained, "vllm_raised": raised,
               "steps_compared": sum(r["steps"] if r["same"] else r.get("first_difference", {}).get("step", 0) for r in results),
               "seconds": round(time.perf_counter() - start, 1), "results": results}  # fmt: skip
    head = json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=1)
    lines = ",\n".join("  " + json.dumps(r) for r in results)  # one workload a line
    out.write_text(f'{head[:-2]},\n "results": [\n{lines}\n ]\n}}\n', encoding="utf-8")
    print(f"vLLM {vllm.__version__}: {summary['same']} of {summary['workloads']} workloads decided alike, step for step; "
          f"known differences {counts}; unexplained {len(unexplained)}; vLLM raised in {len(raised)}")  # fmt: skip
    return 0 if not unexplained else 1


if __name__ == "__main__":
    sys.exit(main())
