"""LLM: the offline entry point, ``LLM(model=...).generate(prompts, sampling_params)``.

Concept: the facade a script uses. ``LLM(...)`` hands its arguments to
``LLMEngine.from_engine_args`` (``engine_args.py`` checks them, the input processor loads the
tokenizer, the device start-up loads the weights and sizes the KV cache); ``generate`` and
``chat`` check every prompt and params object (the input processor) before queuing any, then
drive ``LLMEngine.step()`` until every prompt is finished, with a progress bar. Names and
defaults follow vLLM's ``LLM``, so scripts port.

Mirrors: ``vllm/entrypoints/llm.py`` (``LLM.generate``, ``LLM.chat``,
``get_default_sampling_params``).

Invariants: a call of ``generate`` or ``chat`` queues all of its requests or none, and leaves
none of them in the engine when it returns or raises.

NOTE 1 (arguments): every argument is ``EngineArgs``' (``engine_args.py``, its NOTEs say the
defaults, the CUDA-graph modes, model ids, attention backends and speculation); ``LLM`` checks
none itself. ``generate`` checks its own (``use_tqdm``, the shapes of ``prompts`` and
``sampling_params``), then each prompt and params through the input processor
(``input_processor.py``: a str or vLLM's prompt dict; the model-dependent checks) before the
first request is queued.
NOTE 2 (sampling defaults): ``get_default_sampling_params()`` builds the model's sampling
defaults (``engine_args.py`` NOTE 5) for a ``generate`` given no params.
NOTE 3 (chat): ``chat(messages)`` takes one conversation or a list of them, renders each
through the chat template (``chat_template.py``), tokenizes without special tokens (the
template writes them) and generates as ``generate`` does, every conversation rendered and
checked (as prompt i) before the first request is queued.
NOTE 4 (what start-up made): ``llm.engine``, ``llm.config`` and the model, device, dtype,
tokenizer and start-up report are read from the engine, which holds them; ``LLM`` keeps only
its request-id counter.
NOTE 5 (beam search): ``beam_search(prompts, BeamSearchParams(...))`` runs each step as one
``generate`` of one-token requests, one per live beam, and ranks their candidates
(``beam_search.py``); the prefix cache makes each step compute little more than the
token the last step added.
NOTE 6 (pooling, ``docs/pooling.md``): with ``runner="pooling"``, ``encode``, ``embed``,
``classify`` and ``score`` (``llm_pooling.py``) queue each prompt as ``generate`` does
(``_queue``) and return one result per prompt; ``generate`` is refused there, and the pooling
methods by a generating engine (``input_processor.py`` NOTE 8).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from tinyvllm.beam_search import (
    BeamSearchOutput, BeamSearchParams, advance_all, beam_step_params, candidates, check_room, live_beams,
    search_outputs, token_prompt,
)  # fmt: skip
from tinyvllm.config import (
    CompilationConfig, EngineConfig, PoolerConfig, ReasoningConfig, SpeculativeConfig, StructuredOutputsConfig,
)  # fmt: skip
from tinyvllm.engine.chat_template import check_template_kwargs, flatten_messages, load_chat_template, render_chat
from tinyvllm.engine.engine_args import EngineArgs
from tinyvllm.engine.input_processor import PromptType
from tinyvllm.engine.llm_arguments import conversations, params_list, prompt_list
from tinyvllm.engine.llm_pooling import PoolingEntryPoints
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.worker.startup_report import StartupReport
from tinyvllm.models.loader import ModelSpec
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from tinyvllm.stdlib_tiny import STDLIB_TINY
from tinyvllm.validation import check_bool, check_optional_int

if TYPE_CHECKING:
    from tinyvllm.engine.engine_args import LogitsProcessorSpec


class LLM(PoolingEntryPoints):
    """Generate text from a Hugging Face model (Qwen3, Qwen2, Llama families): a local
    folder or a hub model id (``engine_args.py`` NOTE 4); with no ``model``, the small model
    shipped with the package (``STDLIB_TINY``)."""

    def __init__(
        self,
        model: str = STDLIB_TINY,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        num_gpu_blocks_override: int | None = None,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        attention_backend: str = "auto",
        seed: int = 0,
        reasoning_config: ReasoningConfig | None = None,
        compilation_config: dict | CompilationConfig | None = None,
        enforce_eager: bool = False,
        logits_processors: Sequence[LogitsProcessorSpec] | None = None,
        *,
        revision: str | None = None,
        generation_config: str = "auto",
        speculative_config: dict | SpeculativeConfig | None = None,
        max_logprobs: int = MAX_LOGPROBS,
        torch_threads: int | None = None,
        tensor_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        async_scheduling: bool = False,
        structured_outputs_config: dict | StructuredOutputsConfig | None = None,
        scheduling_policy: str = "fcfs",
        runner: str = "auto",
        pooler_config: dict | PoolerConfig | None = None,
        hf_overrides: dict | str | None = None,
    ) -> None:
        engine_args = EngineArgs(
            model=model, dtype=dtype, device=device, max_model_len=max_model_len, block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization, num_gpu_blocks_override=num_gpu_blocks_override,
            enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, attention_backend=attention_backend, seed=seed,
            reasoning_config=reasoning_config, compilation_config=compilation_config, enforce_eager=enforce_eager,
            logits_processors=logits_processors, revision=revision, generation_config=generation_config,
            speculative_config=speculative_config, max_logprobs=max_logprobs, torch_threads=torch_threads,
            tensor_parallel_size=tensor_parallel_size, distributed_executor_backend=distributed_executor_backend,
            async_scheduling=async_scheduling, structured_outputs_config=structured_outputs_config,
            scheduling_policy=scheduling_policy, runner=runner, pooler_config=pooler_config, hf_overrides=hf_overrides,
        )  # fmt: skip
        self.engine = LLMEngine.from_engine_args(engine_args)  # NOTE 1
        self._ids = itertools.count()

    # -- what start-up made, held by the engine (NOTE 4) --------------------------------------

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model_runner.model

    @property
    def spec(self) -> ModelSpec:
        return self.config.model_config.spec

    @property
    def device(self) -> torch.device:
        return torch.device(self.config.device_config.device)  # no runner here under "mp"

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.config.model_config.dtype)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def startup_report(self) -> StartupReport:
        return self.engine.startup_report

    @property
    def cudagraph_memory_bytes(self) -> int:
        return self.engine.cudagraph_memory_bytes

    @property
    def generation_defaults(self) -> dict[str, Any]:
        return self.engine.input_processor.generation_defaults

    @property
    def max_logprobs(self) -> int:
        return self.config.model_config.max_logprobs

    @property
    def logits_processors(self) -> tuple[LogitsProcessorSpec, ...]:
        return self.config.model_config.logits_processors

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        return self.config.speculative_config

    # --8<-- [start:default_sampling_params]
    def shutdown(self) -> None:
        """Stop the engine's worker(s) now (``LLMEngine.shutdown``); the ``LLM`` serves no more."""
        self.engine.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's sampling defaults (NOTE 2); ``SamplingParams()`` when it has none."""
        return SamplingParams(**self.generation_defaults)
    # --8<-- [end:default_sampling_params]

    def get_tokenizer(self):
        return self.tokenizer

    # -- generation -------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate a completion for every prompt; outputs come back in prompt order.

        ``prompts``: a str, a dict (``{"prompt": text}`` or ``{"prompt_token_ids": ids}``, each
        optionally with ``"cache_salt"``), or a list of them. Every prompt and every params
        object is checked before the first request is queued (NOTE 1). ``priority``: one int
        per prompt, lower scheduled sooner, under ``scheduling_policy="priority"`` (as vLLM's).
        """
        # --8<-- [start:validation]
        check_bool("use_tqdm", use_tqdm)
        prompts = prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()  # NOTE 2
        params, label = params_list(sampling_params, SamplingParams, "sampling_params", len(prompts))
        if priority is None:
            priority = [0] * len(prompts)
        elif not isinstance(priority, Sequence) or isinstance(priority, (str, bytes)):
            raise TypeError(f"priority must be a list of ints, one per prompt, or None, got {priority!r}")
        elif len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
        final = RequestOutputKind.FINAL_ONLY  # generate returns finished outputs only, as vLLM's
        params = [p if p.output_kind == final else dataclasses.replace(p, output_kind=final) for p in params]
        return self._run(self._queue(prompts, params, label, priority), use_tqdm)
        # --8<-- [end:validation]

    # --8<-- [start:queue]
    def _queue(self, prompts: list[Any], params: list[Any], label: str, priority: Sequence[int]) -> list[str]:
        """Check every prompt with its params (the input processor), then queue them all, or
        none (NOTE 1); their request ids, in order."""
        requests, in_use = [], self.engine.unfinished_request_ids()
        for i, (prompt, p, rank) in enumerate(zip(prompts, params, priority)):  # every check before anything runs
            request_id = self._next_request_id(in_use)
            requests.append(self.engine.input_processor.process_inputs(request_id, prompt, p, i, label.format(i=i), rank))
        added = []
        try:
            for request in requests:
                self.engine.add_core_request(request)
                added.append(request.request_id)
        except Exception:
            self.engine.abort_request(added)  # nothing half-started is left behind
            raise
        return added
    # --8<-- [end:queue]

    # --8<-- [start:chat]
    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """The assistant's reply to each conversation, in order (NOTE 3); each output's
        ``prompt`` is the rendered text. ``chat_template``: a Jinja template or a file
        holding one, instead of the tokenizer's; ``chat_template_kwargs``: extra variables
        for it; ``continue_final_message=True`` (with ``add_generation_prompt=False``)
        continues the last message instead of opening a new assistant turn."""
        check_bool("use_tqdm", use_tqdm)
        check_bool("add_generation_prompt", add_generation_prompt)
        check_bool("continue_final_message", continue_final_message)
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "continue_final_message=True continues the last message, so it needs add_generation_prompt=False "
                "(which would open a new assistant turn)"
            )
        if chat_template is not None:
            template = load_chat_template(chat_template, "chat_template")
        else:
            template = getattr(self.tokenizer, "chat_template", None)
            if not template:
                raise ValueError(
                    "the model has no chat template: pass chat_template= (a Jinja template or a file holding one)"
                )
        kwargs = check_template_kwargs(chat_template_kwargs)
        prompts = []
        for i, conversation in enumerate(conversations(messages)):
            if isinstance(conversation, Sequence) and not conversation:
                raise ValueError(f"conversation {i} holds no message")
            try:
                text = render_chat(
                    self.tokenizer, template, flatten_messages(conversation),
                    add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                    template_kwargs=kwargs,
                )  # fmt: skip
            except (TypeError, ValueError) as error:
                raise type(error)(f"conversation {i}: {error}") from None
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer(text, add_special_tokens=False).input_ids})
        return self.generate(prompts, sampling_params, use_tqdm)
    # --8<-- [end:chat]

    # --8<-- [start:beam_search]
    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """The ``params.beam_width`` most likely completions of each prompt, best first (NOTE 5;
        ``beam_search.py``). Every prompt is checked before the first step runs.
        ``concurrency_limit``: search at most this many prompts at once (vLLM's), a group
        after another; None: all at once."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {params!r}")
        check_bool("use_tqdm", use_tqdm)
        check_optional_int("concurrency_limit", concurrency_limit, minimum=1)
        processor = self.engine.input_processor
        step_params = beam_step_params(params, processor.max_logprobs)
        prompts = prompt_list(prompts)
        instances = []
        for i, prompt in enumerate(prompts):  # every check before anything runs
            request = processor.process_inputs("beam-check", prompt, step_params, i, "params")
            instances.append(check_room(i, request.prompt_token_ids, request.cache_salt, processor.max_model_len))
        eos = frozenset() if params.ignore_eos else processor.eos_token_ids
        from tqdm.auto import tqdm

        group = concurrency_limit or max(len(instances), 1)
        for start in range(0, len(instances), group):
            searching = instances[start : start + group]
            for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm, dynamic_ncols=True):
                if not (beams := live_beams(searching)):
                    break
                salts = [instance.cache_salt for instance in searching for _ in instance.beams]
                outputs = self.generate([token_prompt(b, salt) for b, salt in zip(beams, salts)], step_params, False)
                advance_all(searching, [candidates(out) for out in outputs], params, eos, processor.max_model_len)
        decode = lambda ids, skip: self.tokenizer.decode(list(ids), skip_special_tokens=skip)  # noqa: E731
        return search_outputs(instances, params, eos, decode)
    # --8<-- [end:beam_search]

    def _next_request_id(self, in_use: set[str]) -> str:
        """``generate``'s next id, counting "0", "1", ...: a number not in ``in_use``, the ids of
        the engine's unfinished requests (a caller may have queued one through
        ``engine.add_request``)."""
        while (req_id := str(next(self._ids))) in in_use:
            pass
        return req_id

    # --8<-- [start:run_loop]
    def _run(self, req_ids: list[str], use_tqdm: bool, desc: str = "Generating") -> list[RequestOutput]:
        from tqdm.auto import tqdm

        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(req_ids), desc=desc, disable=not use_tqdm, dynamic_ncols=True) as bar:
            try:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():  # FINAL_ONLY: finished requests only
                        finished[out.request_id] = out
                        bar.update(1)
            except BaseException:  # the failed step is undone by the engine; drop the rest of this call
                self.engine.abort_request([r for r in req_ids if r not in finished])
                raise
        return [finished[r] for r in req_ids]
    # --8<-- [end:run_loop]
