"""LLMEngine: requests in, one step at a time, outputs out.

Concept: the loop that ties the pieces together. ``add_request`` takes a request the input
processor has checked (``engine/input_processor.py``) and queues it in the scheduler;
``step()`` schedules, runs the model, feeds the sampled tokens back to the scheduler,
proposes drafts, and hands the step's tokens to the output processor
(``engine/output_processor.py``), which makes the ``RequestOutput``s: one per request when
it finishes, or every step for ``output_kind`` DELTA or CUMULATIVE.

Follows: the docs page "The model runner" (one engine step: schedule, execute, update).
Mirrors: ``vllm/v1/engine/llm_engine.py`` (``LLMEngine.from_engine_args``, ``add_request``,
``step``) and ``vllm/v1/engine/core.py`` (``EngineCore.step``); nano-vllm's ``LLMEngine.step``.

Invariants: every request added is either unfinished in the scheduler or returned exactly
once as a finished ``RequestOutput`` (or aborted). ``check_invariants()`` checks between
steps that the output processor tracks exactly the scheduler's unfinished requests, the
runner holds state only for those and for the finished ones the next step reports, and the
runner's copy of each request that ran and still runs (block ids, output tokens) equals the
scheduler's, as vLLM's worker and scheduler agree with only ``SchedulerOutput``/``ModelRunnerOutput`` between.

NOTE 1 (a step that raises): if anything after ``schedule()`` raises (forward, sampler, a
logits processor, the scheduler's update, proposer, detokenizer, stop strings, outputs;
``KeyboardInterrupt`` too), the step's requests are aborted and their blocks freed (finished
ones too: their outputs never left), blocks it cached leave the prefix cache unless the
forward wrote them, the runner empties its batch, and the exception reaches the caller;
other requests carry on. vLLM's engine reports itself dead; one shared by nobody need not.
NOTE 2 (a stop string): the output processor finds it (``output_processor.py`` NOTE 2) and
returns the request's id; the step finishes it in the scheduler at once
(``finish_requests`` frees its blocks), inside the same undo as the rest of the step.
NOTE 3 (checked once): ``add_request`` takes ids, params and a request id and has the input
processor check them (``process_token_ids``); ``LLM`` and ``AsyncLLM`` hand over an
``EngineCoreRequest`` the processor has already checked (``add_core_request``). Either way
the engine only adds what depends on its state: a request id must not be in use.
NOTE 4 (an undo that fails too): every part of the undo runs (``try``/``finally``); a second
exception is logged and noted on the first, which the caller gets: it explains the failure.
NOTE 5 (building one): ``from_engine_args``, shared by ``LLM`` and ``AsyncLLM``: the arguments into
an ``EngineConfig`` (``engine_args.py``), the input processor (tokenizer, EOS ids, reasoning
config), the device start-up (weights, KV cache, runner, graphs), scheduler, proposer, engine.
NOTE 6 (n completions): ``SamplingParams.n`` > 1 adds n child requests
(``engine/parallel_sampling.py``) that scheduler and runner see as any other; the output
processor hands each child's output to its ``ParentRequest``, which gathers them;
``unfinished_request_ids`` names the parent.
NOTE 7 (speculative decoding): with a proposer, every running request that sampled a token gets
drafts (``spec_decode/ngram_proposer.py``; cut to what its grammar allows), a partial prefill none.
Under async scheduling the engine has none: the runner proposes them (``async_scheduler.py`` NOTE 6).
NOTE 8 (observers): each step, a failed one too, is told to the engine's step observers
(``engine/step_observers.py``: a trace beside a server's metrics); never raised in its place.
NOTE 9 (the executor): ``executor_class`` picks it by ``distributed_executor_backend``: one
worker here ("uni"), a process per rank ("mp"), one rank of a ``torchrun`` job
("external_launcher"). Under "mp" no runner lives in this process (``model_runner`` says so);
the start-up report is rank 0's, ``startup_reports`` every rank's.
NOTE 10 (async scheduling, vLLM's ``step_with_batch_queue``): with an ``AsyncScheduler`` a
call schedules and launches the next step, then reads back the oldest step in flight
(at most two): so the scheduler's work, the runner's input preparation and the output
processing overlap the device's forward. The first call only launches; a step that fails
(launch, read-back or update) takes every step in flight down with it (NOTE 1).
``has_unfinished_requests`` stays True until every step launched was read back. A step whose
mask needs a token in flight: forward, read-back, mask, then sampling (``manager.py`` NOTE 7);
with placeholder drafts, the runner's drafts are taken before the mask (``manager.py`` NOTE 8).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tinyvllm.config import EngineConfig, ReasoningConfig, StructuredOutputsConfig
from tinyvllm.core.sched_output import GrammarOutput, SchedulerOutput
from tinyvllm.core.async_scheduler import MAX_STEPS_IN_FLIGHT, AsyncScheduler
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.engine.input_processor import EngineCoreRequest, InputProcessor
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.engine.parallel_sampling import ParentRequest
from tinyvllm.engine.step_observers import StepObservers
from tinyvllm.outputs import EngineCoreOutput, ModelRunnerOutput, RequestOutput
from tinyvllm.request import Request, RequestStatus
from tinyvllm.sampling_params import MAX_LOGPROBS, SamplingParams
from tinyvllm.spec_decode.ngram_proposer import NgramProposer
from tinyvllm.structured_output.manager import StructuredOutputManager
from tinyvllm.executor.abstract import Executor, StepFuture, initialize_kv_caches, runner_view, worker_attribute
from tinyvllm.executor.multiproc_executor import MultiprocExecutor
from tinyvllm.executor.uniproc_executor import ExecutorWithExternalLauncher, UniProcExecutor
from tinyvllm.worker.model_runner import ModelRunner
from tinyvllm.worker.startup_report import report_lines

if TYPE_CHECKING:
    from tinyvllm.engine.engine_args import EngineArgs
    from tinyvllm.worker.startup_report import StartupReport

logger = logging.getLogger(__name__)


def executor_class(config: EngineConfig) -> type[Executor]:
    """The executor ``config.parallel_config`` asks for (NOTE 9)."""
    backend = config.parallel_config.distributed_executor_backend
    classes = {"uni": UniProcExecutor, "mp": MultiprocExecutor, "external_launcher": ExecutorWithExternalLauncher}
    if backend not in classes:
        raise ValueError(f"distributed_executor_backend must be one of {tuple(classes)}, got {backend!r}")
    return classes[backend]


class LLMEngine(StepObservers):  # NOTE 8: add_observer, remove_observer
    """Schedule -> execute -> update, one step at a time."""

    def __init__(
        self,
        scheduler: Scheduler,
        model_executor: Executor,
        tokenizer=None,
        eos_token_id: int | None = None,
        *,
        vocab_size: int | None = None,
        reasoning_config: ReasoningConfig | None = None,
        proposer: NgramProposer | None = None,
        max_logprobs: int = MAX_LOGPROBS,
        input_processor: InputProcessor | None = None,
        structured_outputs_config: StructuredOutputsConfig | None = None,
    ):
        self.scheduler = scheduler
        self.model_executor = model_executor  # the engine's one door to the device
        if input_processor is None:  # an engine assembled by hand: the checks it can make (NOTE 3)
            input_processor = InputProcessor(
                tokenizer, eos_token_id, vocab_size=vocab_size, max_model_len=scheduler.max_model_len,
                reasoning_config=reasoning_config, speculative=proposer is not None, max_logprobs=max_logprobs,
            )  # fmt: skip
        self.input_processor = input_processor
        self.output_processor = OutputProcessor(input_processor.tokenizer)
        self.proposer = proposer  # None: no speculative decoding (NOTE 7)
        self.structured_output_manager = StructuredOutputManager(  # grammars: structured_output/manager.py
            structured_outputs_config or StructuredOutputsConfig(), input_processor.tokenizer, input_processor.vocab_size,
            [t for t in (input_processor.eos_token_id, *input_processor.extra_stop_token_ids) if t is not None],
            input_processor.reasoning_config,
        )  # fmt: skip
        self.config: EngineConfig | None = None  # from_engine_args sets these three (NOTE 5)
        self.startup_report: StartupReport | None = None
        self.startup_reports: list[StartupReport] = []  # every rank's, rank order (NOTE 9)
        self.cudagraph_memory_bytes = 0  # what the graphs take from the KV budget (GPU only)
        # NOTE 10: an AsyncScheduler makes the engine keep steps in flight, oldest on the right
        self.async_scheduling = isinstance(scheduler, AsyncScheduler)
        self._batch_queue: deque[tuple[StepFuture, SchedulerOutput]] = deque()

    # --8<-- [start:from_engine_args]
    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """Build every part from the arguments (NOTE 5); what ``LLM`` and ``AsyncLLM`` call."""
        config = engine_args.create_engine_config()  # every argument checked, the model folder read
        input_processor = InputProcessor.from_config(config)
        config = dataclasses.replace(config, reasoning_config=input_processor.reasoning_config)
        executor = executor_class(config)(config, input_processor.eos_token_id)  # the device(s), the weights
        try:
            config = initialize_kv_caches(executor, config)  # KV blocks sized and allocated, runner, graphs
            reports = executor.startup_reports()  # NOTE 9: rank 0's is the engine's
            graph_bytes = executor.collective_rpc(worker_attribute, args=("cudagraph_memory_bytes",))[0]
        except BaseException:
            executor.shutdown()  # no worker process outlives a failed start-up
            raise
        logger.info("tinyvllm start-up:\n  %s", "\n  ".join(report_lines(reports)))
        scheduler_class = AsyncScheduler if config.scheduler_config.async_scheduling else Scheduler  # NOTE 10
        spec_config = config.speculative_config
        num_spec_tokens = 0 if spec_config is None else spec_config.num_speculative_tokens
        scheduler = scheduler_class(config.scheduler_config, config.cache_config, log_stats=True, num_spec_tokens=num_spec_tokens)
        proposer = None if spec_config is None or scheduler_class is AsyncScheduler else NgramProposer(  # NOTE 7
            spec_config.num_speculative_tokens, spec_config.prompt_lookup_min, spec_config.prompt_lookup_max,
            config.scheduler_config.max_model_len,
        )  # fmt: skip
        engine = cls(
            scheduler, executor, proposer=proposer, input_processor=input_processor,
            structured_outputs_config=config.structured_outputs_config,
        )  # fmt: skip
        engine.config, engine.startup_report, engine.startup_reports = config, reports[0], reports
        engine.cudagraph_memory_bytes = graph_bytes
        return engine
    # --8<-- [end:from_engine_args]

    @property
    def tokenizer(self):
        return self.input_processor.tokenizer

    @property
    def eos_token_id(self) -> int | None:
        return self.input_processor.eos_token_id

    @property
    def max_logprobs(self) -> int:
        return self.input_processor.max_logprobs

    @property
    def vocab_size(self) -> int | None:
        return self.input_processor.vocab_size

    @property
    def reasoning_config(self) -> ReasoningConfig | None:
        return self.input_processor.reasoning_config

    @property
    def model_runner(self) -> ModelRunner:
        """The one-process executor's runner, for tests, benches and the step recorder to
        read; the engine calls only ``model_executor``. Under "mp" there is none here (NOTE 9)."""
        worker = getattr(self.model_executor, "driver_worker", None)
        if worker is None:
            raise RuntimeError(
                f"no model runner in this process: {type(self.model_executor).__name__} runs the model in its "
                "worker processes (tensor_parallel_size > 1); reach them with model_executor.collective_rpc"
            )
        return worker.model_runner

    # --8<-- [start:add_request]
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request; TypeError or ValueError (nothing queued) on a bad one.

        The input processor checks it against the model (NOTE 3): token ids (the prompt's,
        ``logit_bias``'s, ``stop_token_ids``, the tokens of ``bad_words``, which need the
        engine's tokenizer) must lie in ``[0, vocab_size)`` when the engine was given
        ``vocab_size``, and ``thinking_token_budget`` needs the engine's ``reasoning_config``.
        Requests with different ``cache_salt``s never share a cached block
        (``core/prefix_hash.py``). ``sampling_params.n`` > 1 adds n child requests, all or none (NOTE 6).
        A ``priority`` other than 0 needs ``scheduling_policy="priority"`` (lower runs sooner).
        """
        request = self.input_processor.process_token_ids(
            request_id, prompt_token_ids, sampling_params, prompt, cache_salt, priority
        )
        self.add_core_request(request)
    # --8<-- [end:add_request]

    # --8<-- [start:add_core_request]
    def add_core_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the input processor has checked (NOTE 3); ValueError, nothing
        queued, when its id (or, with ``n`` > 1, a child's) is in use."""
        params, request_id = request.sampling_params, request.request_id
        if params.n == 1:
            self._add_one(request_id, request, params)
            return
        parent = ParentRequest(request_id, params)
        children = [parent.child_id(i) for i in range(params.n)]
        taken = [rid for rid in (request_id, *children) if self.output_processor.id_in_use(rid)]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use (a request with n={params.n})")
        added: list[str] = []
        try:
            for index, child_id in enumerate(children):
                self._add_one(child_id, request, parent.child_params(index))
                added.append(child_id)
        except BaseException:
            self.abort_request(added)
            raise
        self.output_processor.add_parent(parent, children)
    # --8<-- [end:add_core_request]

    def _add_one(self, request_id: str, core: EngineCoreRequest, params: SamplingParams) -> None:
        """One sequence: queued in the scheduler and tracked by the output processor."""
        if request_id in self.output_processor.parent_requests:
            raise ValueError(f"duplicate request id {request_id!r} (a request with n > 1 has it)")
        request = Request(
            request_id, core.prompt_token_ids, params, eos_token_id=self.eos_token_id, cache_salt=core.cache_salt,
            priority=core.priority, pooling_params=core.pooling_params,
        )  # fmt: skip
        request.bad_words_token_ids = core.bad_words_token_ids
        if params.structured_outputs is not None:  # its grammar compiles while it waits
            self.structured_output_manager.grammar_init(request)
        self.scheduler.add_request(request)
        self.output_processor.add_request(
            request_id, core.prompt, request.prompt_token_ids, params, pooling=core.pooling_params is not None
        )

    # --8<-- [start:abort_request]
    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Stop requests now and free their blocks. Returns the final output of each one that
        was unfinished (``finished=True``, ``finish_reason="abort"``, the text of the tokens it
        got), so that whoever waits on it can end; unknown and finished ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids = [child for rid in ids for child in self.output_processor.sequences(rid)]  # a parent's unfinished children
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort_requests(ids)
    # --8<-- [end:abort_request]

    # --8<-- [start:step]
    def step(self) -> list[RequestOutput]:
        """One engine step; returns the finished requests, and the streaming ones that got tokens."""
        if self.async_scheduling:
            return self._step_with_batch_queue()  # NOTE 10
        scheduler_output = self.scheduler.schedule()
        self.output_processor.note_first_scheduling(scheduler_output)
        try:
            scheduler_output = self.structured_output_manager.grammar_bitmask(scheduler_output, self.scheduler.requests)
            model_output = self.model_executor.execute_model(scheduler_output)
        except BaseException as error:  # KeyboardInterrupt too: the engine must stay usable (NOTE 1)
            self._abort_failed_step([scheduler_output], error)
            self._observe(scheduler_output, [], error)
            raise
        return self._update(scheduler_output, model_output)

    def _update(self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput) -> list[RequestOutput]:
        """A step's output into the scheduler, the proposer and the outputs (NOTE 1 if it
        raises: with the steps still in flight, NOTE 10)."""
        try:
            core_outputs = self.scheduler.update_from_output(scheduler_output, model_output)
            if self.structured_output_manager.in_use:  # each matcher takes its request's new tokens
                for out in core_outputs:
                    if (request := self.scheduler.requests.get(out.request_id)) is not None and request.use_structured_output:
                        self.structured_output_manager.advance(request, out.new_token_ids)
            if self.proposer is not None:
                self._propose_drafts(core_outputs, scheduler_output)  # NOTE 7: the next step verifies them
            outputs, stopped = self.output_processor.process_outputs(core_outputs)
            if stopped:  # NOTE 2: a stop string finished them
                self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        except BaseException as error:
            self._abort_failed_step([scheduler_output, *(so for _, so in self._batch_queue)], error)
            self._observe(scheduler_output, [], error)
            raise
        self._observe(scheduler_output, core_outputs, None)
        return outputs
    # --8<-- [end:step]

    # --8<-- [start:step_with_batch_queue]
    def _step_with_batch_queue(self) -> list[RequestOutput]:
        """NOTE 10: schedule and launch the next step, then read back the oldest in flight."""
        queue = self._batch_queue  # newest on the left
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()  # the last step is still on the device
            self.output_processor.note_first_scheduling(scheduler_output)
            if self._mask_needs_tokens_in_flight(scheduler_output):
                return self._step_with_deferred_sampling(scheduler_output)
            try:
                scheduler_output = self.structured_output_manager.grammar_bitmask(scheduler_output, self.scheduler.requests)
                future = self.model_executor.execute_model(scheduler_output, non_block=True)
            except BaseException as error:
                self._abort_failed_step([scheduler_output, *(so for _, so in queue)], error)
                self._observe(scheduler_output, [], error)
                raise
            queue.appendleft((future, scheduler_output))
            if scheduler_output.total_num_scheduled_tokens and len(queue) < MAX_STEPS_IN_FLIGHT:
                self._observe_launch(scheduler_output)  # NOTE 8: no read-back follows in this call
                return []  # the first step in flight: its tokens come back with the next call
        return self._update_oldest() if queue else []

    def _update_oldest(self) -> list[RequestOutput]:
        """Read back the oldest step in flight and take in its tokens (NOTE 10)."""
        future, scheduler_output = self._batch_queue.pop()
        try:
            model_output = future.result()  # the step's one wait
        except BaseException as error:
            self._abort_failed_step([scheduler_output, *(so for _, so in self._batch_queue)], error)
            self._observe(scheduler_output, [], error)
            raise
        return self._update(scheduler_output, model_output)

    def _step_with_deferred_sampling(self, scheduler_output: SchedulerOutput) -> list[RequestOutput]:
        """NOTE 10, manager.py NOTE 7: the step's forward runs while the step before it is read
        back and its tokens reach the matchers; then the mask is made and the step sampled."""
        queue = self._batch_queue
        queue.appendleft((None, scheduler_output))  # in flight: a failure below takes it down too
        try:
            self.model_executor.execute_model(scheduler_output, non_block=True, defer_sampling=True)
        except BaseException as error:
            self._abort_failed_step([so for _, so in queue], error)
            self._observe(scheduler_output, [], error)
            raise
        outputs = self._update_oldest() if len(queue) > 1 else []
        try:
            if scheduler_output.scheduled_spec_decode_tokens:  # placeholders: the runner's drafts go in
                drafts = self.model_executor.take_draft_token_ids()  # (async_scheduler.py NOTE 7)
                scheduler_output = self.scheduler.update_draft_token_ids_in_output(drafts, scheduler_output)
            scheduler_output = self.structured_output_manager.grammar_bitmask(scheduler_output, self.scheduler.requests)
            queue[0] = (self.model_executor.sample_tokens(GrammarOutput.of(scheduler_output)), scheduler_output)
        except BaseException as error:
            self._abort_failed_step([so for _, so in queue], error)
            self._observe(scheduler_output, [], error)
            raise
        return outputs
    # --8<-- [end:step_with_batch_queue]

    def _mask_needs_tokens_in_flight(self, scheduler_output: SchedulerOutput) -> bool:
        """NOTE 10: a constrained request in this step, and a step in flight (its mask may need
        that step's token) or placeholder drafts (it needs the drafts the runner proposes)."""
        if not self.structured_output_manager.in_use or not (self._batch_queue or scheduler_output.scheduled_spec_decode_tokens):
            return False
        requests = self.scheduler.requests
        return any((r := requests.get(rid)) is not None and r.use_structured_output
                   for rid in scheduler_output.num_scheduled_tokens)  # fmt: skip

    # --8<-- [start:propose]
    def _propose_drafts(self, core_outputs: list[EngineCoreOutput], scheduler_output: SchedulerOutput) -> None:
        """NOTE 7: drafts for every request that sampled a token this step and runs on,
        searched for all of them at once (``ngram_proposer.py`` NOTE 2). A request that only
        computed a chunk of its prompt sampled nothing and gets none, as in vLLM; one the step
        did not run keeps its own, as its tokens did not move (vLLM: the batch's requests only)."""
        requests = self.scheduler.requests
        for rid in scheduler_output.num_scheduled_tokens:
            if (request := requests.get(rid)) is not None:
                request.spec_token_ids = []
        decoding = [requests[out.request_id] for out in core_outputs if out.new_token_ids and out.finish_reason is None]
        for request, drafts in zip(decoding, self.proposer.propose_batch(decoding)):
            request.spec_token_ids = self.structured_output_manager.trim_drafts(request, drafts)
    # --8<-- [end:propose]
    # --8<-- [start:abort_failed_step]
    def _abort_failed_step(self, scheduler_outputs: list[SchedulerOutput], error: BaseException) -> None:
        """NOTE 1: as if the failed step's requests (with async scheduling, those of every
        step in flight: NOTE 10) had never been added. Never raises: a second error on the
        way is attached to ``error`` as a note, and every part still runs."""
        self._batch_queue.clear()
        step_ids = list(dict.fromkeys(rid for out in scheduler_outputs for rid in out.num_scheduled_tokens))
        try:
            try:
                self.scheduler.abort_failed_step(*scheduler_outputs)
                # an id still unfinished now belongs to a request no failed step scheduled (one
                # added under the id after an abort: async_scheduler.py NOTE 5): it carries on
                step_ids = [rid for rid in step_ids if rid not in self.scheduler.requests]
            finally:
                self.model_executor.recover_from_failed_step(step_ids)
        except BaseException as second:  # the first error is the one the caller gets (NOTE 4)
            error.add_note(f"tinyvllm: undoing the failed step also raised {second!r}")
            logger.error("undoing a failed step raised %r (the step raised %r)", second, error)
        finally:
            self._drop_parents_of(step_ids)
    # --8<-- [end:abort_failed_step]

    def _drop_parents_of(self, failed_ids: list[str]) -> None:
        """The output processor forgets the failed requests; a failed child's siblings are
        aborted with it (``parallel_sampling.py`` NOTE 2)."""
        siblings = self.output_processor.drop_failed(failed_ids)
        if siblings:
            self.scheduler.finish_requests(siblings, RequestStatus.FINISHED_ABORTED)

    # --8<-- [start:check_invariants]
    def check_invariants(self) -> None:
        """The scheduler and the runner check themselves, then their two copies of each
        request are compared (module header). Call it between steps."""
        scheduler = self.scheduler
        scheduler.check_invariants()
        self.model_executor.check_invariants()  # the worker and its runner check themselves
        views = self.model_executor.collective_rpc(runner_view)  # every rank's, in whichever process (NOTE 9)
        assert all(view == views[0] for view in views), "the ranks' runners hold different requests"
        runner = views[0]
        self.output_processor.check_invariants()
        self.structured_output_manager.check_invariants(scheduler.requests.values())
        if self.proposer is not None:
            self.proposer.check_invariants()
        unfinished, tracked = set(scheduler.requests), set(self.output_processor.request_states)
        assert tracked == unfinished, (
            f"the engine tracks {sorted(tracked - unfinished)} that the scheduler has not, "
            f"and not {sorted(unfinished - tracked)} that it has"
        )
        stale = set(runner.requests) - unfinished - scheduler.finished_req_ids
        assert not stale, f"the runner holds states of {sorted(stale)}, neither unfinished nor about to be reported finished"
        kv = scheduler.kv_cache_manager
        for req_id in runner.batch_req_ids:
            request = scheduler.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished or aborted since it ran: the next step removes it from the batch
            block_ids, output_token_ids = runner.requests[req_id]
            blocks = kv.get_block_ids(req_id)
            assert block_ids == list(blocks), f"request {req_id!r}: the runner's block ids {block_ids} != the scheduler's {blocks}"
            assert output_token_ids == request.output_token_ids, (
                f"request {req_id!r}: the runner's output tokens {output_token_ids} != "
                f"the scheduler's {request.output_token_ids}"
            )
    # --8<-- [end:check_invariants]

    def shutdown(self) -> None:
        """Release the device: the executor stops its worker(s) (with N > 1, their processes
        end here rather than when the collector finds the engine). A second call does nothing;
        every later step raises."""
        self.structured_output_manager.shutdown()
        self.model_executor.shutdown()

    def steps_in_flight(self) -> tuple[SchedulerOutput, ...]:
        """The steps launched and not yet read back, oldest first (NOTE 10; always empty
        without async scheduling). For readers such as the step recorder."""
        return tuple(out for _, out in reversed(self._batch_queue))

    def has_unfinished_requests(self) -> bool:
        """Requests unfinished, or (async scheduling) a step still to read back (NOTE 10)."""
        return self.scheduler.has_unfinished_requests() or bool(self._batch_queue)

    def unfinished_request_ids(self) -> set[str]:
        """The requests added and not yet returned finished or aborted (a parent by its own id)."""
        return self.output_processor.unfinished_request_ids()
