"""ModelRunner: turns one ``SchedulerOutput`` into sampled tokens.

Concept: the runner orchestrates one forward and owns nothing that has its own module.
Each step: (a) bring the runner's copy of every request and the persistent batch up to
date (removals first, then additions, condense, refresh: one ``BatchUpdate`` reaches the
logits processors and the thinking budget); (b) choose how to run the model (eager: the
CUDA-graph dispatcher comes with its own issue); (c) build the attention metadata with
the pure builders; (d) run the model over the paged KV cache; (e) take the logits of each
request's last scheduled token, sample, and report one token per request whose step
reached the end of its tokens.

Follows: DESIGN.md "One engine step" (2a-2e); seed 003 "KV cache物理内存分配" (the runner
owns the KV tensors and hands attention its metadata); seed 001 appendix U2 (the
persistent batch is updated, condensed and refreshed once per step).
Mirrors: ``vllm/v1/worker/gpu_model_runner.py`` (``_update_states``, ``_prepare_inputs``,
``execute_model``) and ``CachedRequestState`` in ``gpu_input_batch.py``.

Invariants: after ``_update_states`` the batch holds exactly this step's scheduled
requests, rows ``0 .. R-1``; each ``RunnerRequestState`` has the prompt, the outputs so far
and the block ids the scheduler gave it.

NOTE 1 (a request not scheduled this step leaves the batch): a running request can be
skipped when the budget runs out, or preempted. It leaves the persistent batch (its
state stays here) and comes back when scheduled again; on resumption after preemption
its block table is replaced, not extended.
NOTE 2 (partial prefills draw no randomness): a row whose step ends inside its prompt
gets no token, and a seeded row's generator is restored after sampling, so the tokens of
a seeded request do not depend on how its prompt was chunked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyvllm.core.sched_output import SchedulerOutput
from tinyvllm.outputs import ModelRunnerOutput
from tinyvllm.sample.sampler import Sampler
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.attention_metadata import build_attention_metadata
from tinyvllm.worker.input_batch import InputBatch


@dataclass
class RunnerRequestState:
    """The runner's copy of one request (it may live in another process in vLLM)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int]  # the live list the logits processors read

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids ``[start, end)`` of prompt + outputs, without copying the whole sequence."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]


class ModelRunner:
    """Runs the model for one scheduler step and samples (see the module header)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        input_batch: InputBatch,
        device: torch.device,
        eos_token_id: int | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches  # L x [2, B, S, Hkv, D]
        self.block_size = block_size
        self.input_batch = input_batch
        self.device = device
        self.eos_token_id = eos_token_id
        self.sampler = Sampler()
        self.requests: dict[str, RunnerRequestState] = {}

    # -- (a) states and the persistent batch ---------------------------------------------

    # --8<-- [start:update_states]
    def _update_states(self, out: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in list(batch.req_id_to_index):  # removals first (NOTE 1)
            if req_id not in out.num_scheduled_tokens:
                batch.remove_request(req_id)
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = RunnerRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=[],
            )
        for cached in out.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        for req_id in out.num_scheduled_tokens:
            if req_id not in batch.req_id_to_index:
                state = self.requests[req_id]
                batch.add_request(
                    req_id, state.sampling_params, state.prompt_token_ids, state.output_token_ids, self.eos_token_id
                )
        batch.condense()
        batch.refresh()
    # --8<-- [end:update_states]

    # -- one step ------------------------------------------------------------------------

    # --8<-- [start:execute_model]
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        req_ids: list[str] = list(self.input_batch.req_ids)  # row order
        if not req_ids:
            return ModelRunnerOutput([], {}, [])
        states = [self.requests[r] for r in req_ids]
        num_sched = [scheduler_output.num_scheduled_tokens[r] for r in req_ids]
        computed = [s.num_computed_tokens for s in states]

        # (b) eager execution; (c) metadata from the pure builders.
        metadata = build_attention_metadata(
            computed, num_sched, [s.block_ids for s in states], self.block_size, device=self.device
        )
        input_ids = torch.tensor(  # [N]
            [t for s, c, n in zip(states, computed, num_sched) for t in s.token_slice(c, c + n)],
            dtype=torch.int64,
            device=self.device,
        )
        # (d) the model over the paged cache.
        hidden = self.model(input_ids, metadata.positions, self.kv_caches, metadata)  # [N, hidden]
        logits = self.model.compute_logits(hidden[metadata.logits_indices])  # [R, V]

        # (e) sample; only rows that reached the end of their tokens keep theirs (NOTE 2).
        complete = [c + n >= s.num_tokens for s, c, n in zip(states, computed, num_sched)]
        saved = {row: g.get_state() for row, g in self.input_batch.generators.items() if not complete[row]}
        sampled = self.sampler(logits, self.input_batch.make_sampling_metadata()).sampled_token_ids.tolist()  # [R]
        for row, rng_state in saved.items():
            self.input_batch.generators[row].set_state(rng_state)
        tokens: list[list[int]] = []
        for state, n, done, token in zip(states, num_sched, complete, sampled):
            state.num_computed_tokens += n
            if done:
                state.output_token_ids.append(token)
            tokens.append([token] if done else [])
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, tokens)
    # --8<-- [end:execute_model]
