"""InputProcessor: a prompt and its params into a checked ``EngineCoreRequest``, once.

Concept: everything a request needs from the model before it may be queued: the prompt
(a str, or vLLM's prompt dict) into token ids, the model's extra EOS ids as stop tokens
(NOTE 1), bad words into token sequences (``sample/bad_words.py`` NOTE 1), and every check
that needs the model: the vocabulary, ``max_model_len``, the reasoning config, the logprobs
cap, what drafts cannot honour (``request_checks.py``), the custom processors'
``validate_params``, and whether any token is left to sample (NOTE 3). What comes out is a
frozen ``EngineCoreRequest``; ``LLMEngine``, ``Request`` and the scheduler take it as it is.
It holds the tokenizer, the EOS ids and the model's sampling defaults, loaded once from the
model folder by ``from_config`` (which also completes the reasoning config: NOTE 2).

Mirrors: ``vllm/v1/engine/input_processor.py`` (``InputProcessor.process_inputs``,
``_validate_params``, ``_validate_model_inputs``) and ``vllm/inputs/preprocess.py`` (a prompt
to token ids); ``EngineCoreRequest`` is ``vllm/v1/engine/__init__.py``'s.

Invariants: an ``EngineCoreRequest`` has a non-empty prompt of at most ``max_model_len`` ids,
each in the vocabulary, params that passed every model check, and its bad words as ids.

NOTE 1 (EOS): the request's EOS is the tokenizer's; further EOS ids in
``generation_config.json`` (Qwen3 lists two) become stop tokens unless ``ignore_eos``.
NOTE 2 (reasoning): with no ``reasoning_config``, one is built when the tokenizer has
``<think>`` and ``</think>`` as single tokens in the model's vocabulary (Qwen3's has); else
there is none, and a request with a ``thinking_token_budget`` is refused rather than run
without a budget. A given config's ids must lie in the vocabulary.
NOTE 3 (no token left): a request whose ``allowed_token_ids`` are all banned by its own
parameters is refused here (``check_some_token_is_allowed``); one that runs out later ends with
``finish_reason="error"`` (``sample/sampler.py`` NOTE 7), never with a token it banned.
NOTE 4 (two ways in): ``process_inputs`` takes what ``LLM.generate`` and ``AsyncLLM`` get (a
prompt, its index in the call, a label for the params: "prompt 3", "sampling_params[3]");
``process_token_ids`` what ``LLMEngine.add_request`` gets (ids, a request id that names the
request in messages). A request with ``n`` > 1 is checked once, named by its first child's
id, the first of its children to be refused before.
NOTE 5 (prompts): a prompt is a str or a dict with the keys of vLLM's
``TextPrompt``/``TokensPrompt``: ``"prompt"``, ``"prompt_token_ids"``, ``"cache_salt"``
(different salts never share a cached block); any other key is a ValueError.
NOTE 6 (structured outputs): the constraint is parsed here (``structured_output/backend_xgrammar.py``
``validate``), so a bad schema, regex or grammar is a ValueError naming it before anything is queued.
NOTE 7 (priority): an int, lower served sooner (``core/request_queue.py``); any value but 0 needs
``scheduling_policy="priority"``, as vLLM refuses it under FCFS rather than ignore it.
NOTE 8 (pooling, ``docs/pooling.md``): an engine either generates or pools (``runner``). A
pooling engine takes ``PoolingParams`` only, resolved against the model (``pooling_params.py``),
and its request carries ``POOLING_SAMPLING_PARAMS``: one step, nothing to sample or decode. A
generating engine refuses ``PoolingParams``, a pooling one ``SamplingParams``, each by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinyvllm.config import EngineConfig, ReasoningConfig
from tinyvllm.engine.parallel_sampling import ParentRequest
from tinyvllm.engine.request_checks import check_defaults_with_speculation, check_request_against_model
from tinyvllm.models.tokenizer import check_eos_token_ids, load_eos_token_ids, load_tokenizer
from tinyvllm.sample.bad_words import tokenize_bad_words
from tinyvllm.sample.logits_processors.loader import validate_logits_processors_parameters
from tinyvllm.pooling_params import PoolingModel, PoolingParams, resolve_pooling_params, truncated
from tinyvllm.sampling_defaults import generation_defaults
from tinyvllm.sampling_params import MAX_LOGPROBS, SamplingParams
from tinyvllm.structured_output import backend_xgrammar
from tinyvllm.validation import check_token_ids

PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")  # NOTE 5
THINK_START, THINK_END = "<think>", "</think>"  # NOTE 2
# NOTE 8: a pooling request's: it reaches the end of its prompt in one step (or chunks), and stops
POOLING_SAMPLING_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
PromptType = str | dict


@dataclass(frozen=True)
class EngineCoreRequest:
    """One request, checked against the model; what the engine queues (vLLM's name)."""

    request_id: str
    prompt: str | None  # the text, when there is one (outputs echo it)
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams  # with the model's extra EOS ids as stop tokens (NOTE 1)
    cache_salt: str | None
    bad_words_token_ids: tuple[tuple[int, ...], ...]
    priority: int = 0  # NOTE 7
    pooling_params: PoolingParams | None = None  # NOTE 8: resolved; None for a generation request


def reasoning_config_from_tokenizer(tokenizer, vocab_size: int) -> ReasoningConfig | None:
    """``<think>`` and ``</think>`` as single tokens of the model's vocabulary, else None (NOTE 2)."""
    vocab = tokenizer.get_vocab()
    start, end = vocab.get(THINK_START), vocab.get(THINK_END)
    if start is None or end is None or not (0 <= start < vocab_size and 0 <= end < vocab_size):
        return None
    return ReasoningConfig((start,), (end,))


# --8<-- [start:priority]
def check_priority(name: str, priority: object, policy: str) -> int:
    """NOTE 7: a TypeError for a priority that is not an int, a ValueError for one the
    engine's scheduling policy would ignore."""
    if type(priority) is not int:
        raise TypeError(f"{name}: priority must be an int, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(f"{name}: priority={priority} needs scheduling_policy='priority' (the engine's is {policy!r})")
    return priority
# --8<-- [end:priority]


# --8<-- [start:some_token_allowed]
def check_some_token_is_allowed(
    label: str, params: SamplingParams, bad_words_token_ids: Sequence[Sequence[int]], eos_token_id: int | None
) -> None:
    """NOTE 3: a ValueError when ``allowed_token_ids`` leaves nothing that the request's
    own parameters do not ban at its first step: one-token bad words, and, below
    ``min_tokens``, its stop tokens and EOS (which MinTokens masks)."""
    if params.allowed_token_ids is None:
        return
    allowed = set(params.allowed_token_ids)
    one_token_bans = {seq[0] for seq in bad_words_token_ids if len(seq) == 1}
    if allowed <= one_token_bans:
        raise ValueError(
            f"{label}: every id of allowed_token_ids={sorted(allowed)} is a one-token bad word of "
            f"bad_words={list(params.bad_words)}: no token could ever be sampled"
        )
    if params.min_tokens > 0:
        stops = set(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            stops.add(eos_token_id)
        if allowed <= stops | one_token_bans:
            raise ValueError(
                f"{label}: allowed_token_ids={sorted(allowed)} holds only stop tokens (stop_token_ids="
                f"{list(params.stop_token_ids)}, EOS {eos_token_id}) or bad words, which min_tokens="
                f"{params.min_tokens} masks: no first token could be sampled"
            )
# --8<-- [end:some_token_allowed]


class InputProcessor:
    """Prompts and params in, checked ``EngineCoreRequest``s out (module header)."""

    def __init__(
        self,
        tokenizer=None,
        eos_token_id: int | None = None,
        *,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
        reasoning_config: ReasoningConfig | None = None,
        speculative: bool = False,
        max_logprobs: int = MAX_LOGPROBS,
        extra_stop_token_ids: tuple[int, ...] = (),
        logits_processors: tuple = (),
        generation_defaults: Mapping[str, Any] | None = None,
        scheduling_policy: str = "fcfs",
        pooling_model: PoolingModel | None = None,
    ) -> None:
        self.tokenizer = tokenizer  # None: text prompts, stop strings and bad words are refused
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size  # None: token ids are not checked against a vocabulary
        self.max_model_len = max_model_len  # None: left to the scheduler (an engine built by hand)
        self.reasoning_config = reasoning_config  # None: thinking_token_budget is refused
        self.speculative = speculative
        self.max_logprobs = max_logprobs  # the most logprobs a request may ask for; -1: no cap
        self.extra_stop_token_ids = extra_stop_token_ids  # NOTE 1
        self.logits_processors = logits_processors  # custom ones, asked about every request
        self.generation_defaults = dict(generation_defaults or {})  # the model's sampling defaults
        self.scheduling_policy = scheduling_policy  # which priorities a request may ask for (NOTE 7)
        self.pooling_model = pooling_model  # NOTE 8: None for a generating engine

    @classmethod
    def from_config(cls, config: EngineConfig) -> InputProcessor:
        """Load the tokenizer, the EOS ids and the sampling defaults from the model folder, and
        complete the reasoning config (NOTE 2); the processor's ``reasoning_config`` is the one
        the engine runs with."""
        model_config = config.model_config
        model, vocab_size = model_config.model, model_config.spec.vocab_size
        generation_config = model_config.generation_config
        tokenizer = load_tokenizer(model)
        eos_ids = load_eos_token_ids(model, tokenizer)
        tok_eos = tokenizer.eos_token_id
        eos_token_id = tok_eos if tok_eos is not None else (eos_ids[0] if eos_ids else None)
        extra_stop_token_ids = tuple(e for e in eos_ids if e != eos_token_id)  # NOTE 1
        check_eos_token_ids(model, eos_ids, eos_token_id, vocab_size)
        defaults = generation_defaults(generation_config, model)  # engine_args.py NOTE 5
        if config.speculative_config is not None:  # a default drafts cannot honour refuses here
            source = Path(model if generation_config == "auto" else generation_config) / "generation_config.json"
            check_defaults_with_speculation(defaults, source)
        reasoning_config = config.reasoning_config
        if reasoning_config is None:
            reasoning_config = reasoning_config_from_tokenizer(tokenizer, vocab_size)  # NOTE 2
        else:
            for name in ("reasoning_start_token_ids", "reasoning_end_token_ids"):
                check_token_ids(f"reasoning_config.{name}", getattr(reasoning_config, name), vocab_size)
        return cls(
            tokenizer, eos_token_id, vocab_size=vocab_size, max_model_len=config.scheduler_config.max_model_len,
            reasoning_config=reasoning_config, speculative=config.speculative_config is not None,
            max_logprobs=model_config.max_logprobs, extra_stop_token_ids=extra_stop_token_ids,
            logits_processors=model_config.logits_processors, generation_defaults=defaults,
            scheduling_policy=config.scheduler_config.policy, pooling_model=model_config.pooling_model,
        )  # fmt: skip

    # --8<-- [start:prompt_inputs]
    def prompt_inputs(self, index: int, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        """``(text, token ids, cache_salt)`` of one prompt: a str, or a dict as vLLM takes it (NOTE 5)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids, None  # with BOS where the tokenizer adds one
        if not isinstance(prompt, dict):
            hint = " (token ids go in a dict: {'prompt_token_ids': [...]})" if isinstance(prompt, (list, tuple)) else ""
            raise TypeError(
                f"prompt {index} must be a str or a dict with 'prompt' or 'prompt_token_ids', got {prompt!r}{hint}"
            )
        unknown = [key for key in prompt if key not in PROMPT_KEYS]
        if unknown:
            raise ValueError(f"prompt {index} has an unknown key {unknown[0]!r}; a prompt dict takes {PROMPT_KEYS}")
        text, salt = prompt.get("prompt"), prompt.get("cache_salt")
        for key, value in (("prompt", text), ("cache_salt", salt)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"prompt {index}: {key!r} must be a str, got {value!r} ({type(value).__name__})")
        if salt == "":
            raise ValueError(f"prompt {index}: 'cache_salt' must be a non-empty string (or left out), got ''")
        if "prompt_token_ids" in prompt:
            return text, check_token_ids(f"prompt {index}", prompt["prompt_token_ids"], self.vocab_size), salt
        if text is None:
            raise ValueError(f"prompt {index} needs 'prompt' (text) or 'prompt_token_ids', got {prompt!r}")
        return text, self.tokenizer(text).input_ids, salt
    # --8<-- [end:prompt_inputs]

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id the engine ends a request on for this model, unless ``ignore_eos`` (NOTE 1)."""
        return frozenset(t for t in (self.eos_token_id, *self.extra_stop_token_ids) if t is not None)

    # --8<-- [start:eos_stops]
    def with_eos_stops(self, params: SamplingParams) -> SamplingParams:
        extra = [t for t in self.extra_stop_token_ids if t not in params.stop_token_ids]
        if params.ignore_eos or not extra:
            return params
        return dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, *extra))
    # --8<-- [end:eos_stops]

    # --8<-- [start:process_inputs]
    def process_inputs(
        self, request_id: str, prompt: PromptType, params: SamplingParams, index: int = 0,
        label: str = "sampling_params", priority: int = 0,
    ) -> EngineCoreRequest:  # fmt: skip
        """Check one prompt, its params and its priority against the model (NOTE 4). Raises
        TypeError or ValueError naming prompt ``index`` or ``label``; changes nothing."""
        check_priority(f"prompt {index}", priority, self.scheduling_policy)  # NOTE 7
        pooling = self._pooling_params(label, params)  # NOTE 8
        text, ids, salt = self.prompt_inputs(index, prompt)
        max_len = self.max_model_len
        if pooling is not None:  # pooling_params.py NOTE 5
            ids = truncated(label, ids, pooling.truncate_prompt_tokens, max_len)
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        if len(ids) > max_len:
            raise ValueError(f"prompt {index} has {len(ids)} tokens, more than max_model_len {max_len}")
        if pooling is not None:
            return EngineCoreRequest(request_id, text, tuple(ids), POOLING_SAMPLING_PARAMS, salt, (), priority, pooling)
        check_request_against_model(  # ids, thinking, logprobs
            label, params, self.vocab_size, self.reasoning_config is not None, self.speculative, self.max_logprobs,
        )
        validate_logits_processors_parameters(self.logits_processors, params)  # custom processors' own checks
        params = self.with_eos_stops(params)
        name_id = _first_sequence(request_id, params)
        _check_request_id(name_id)
        name = f"request {name_id!r}"
        if isinstance(prompt, str) or "prompt_token_ids" not in prompt:  # the tokenizer's ids
            check_token_ids(f"{name}: prompt_token_ids", ids, self.vocab_size)
        return self._finish(request_id, text, ids, params, salt, name, priority)
    # --8<-- [end:process_inputs]

    def process_token_ids(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, prompt: str | None = None,
        cache_salt: str | None = None, priority: int = 0,
    ) -> EngineCoreRequest:  # fmt: skip
        """``LLMEngine.add_request``'s form (NOTE 4): ids as given, messages naming the request."""
        if isinstance(params, PoolingParams) or self.pooling_model is not None:  # NOTE 8
            _check_request_id(request_id)
            prompt_dict = {"prompt_token_ids": prompt_token_ids, "prompt": prompt, "cache_salt": cache_salt}
            label = f"request {request_id!r}: params"
            return self.process_inputs(request_id, {k: v for k, v in prompt_dict.items() if v is not None}, params, 0, label, priority)
        name_id = _first_sequence(request_id, params) if isinstance(params, SamplingParams) else request_id
        _check_request_id(name_id)
        name = f"request {name_id!r}"
        check_priority(name, priority, self.scheduling_policy)  # NOTE 7
        ids = check_token_ids(f"{name}: prompt_token_ids", prompt_token_ids)
        if not ids:
            raise ValueError(f"{name}: the prompt is empty (prompt_token_ids={ids!r})")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"{name}: sampling_params must be SamplingParams, got {params!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"{name}: cache_salt must be a str or None, got {cache_salt!r}")
        if cache_salt == "":  # vLLM's API refuses it too: an empty salt is no salt, not a tenant of its own
            raise ValueError(f"{name}: cache_salt must be a non-empty string or None, got ''")
        if prompt is not None and not isinstance(prompt, str):
            raise TypeError(f"{name}: prompt must be a str or None, got {prompt!r}")
        if self.max_model_len is not None and len(ids) > self.max_model_len:  # the scheduler asserts it
            raise ValueError(f"{name}: prompt of {len(ids)} tokens is longer than max_model_len {self.max_model_len}")
        check_token_ids(f"{name}: prompt_token_ids", ids, self.vocab_size)
        check_request_against_model(
            f"{name}: sampling_params", params, self.vocab_size, self.reasoning_config is not None,
            speculative=self.speculative, max_logprobs=self.max_logprobs,
        )  # fmt: skip
        return self._finish(request_id, prompt, ids, params, cache_salt, name, priority)

    def _finish(
        self, request_id: str, text: str | None, ids: list[int], params: SamplingParams, salt: str | None, name: str,
        priority: int = 0,
    ) -> EngineCoreRequest:
        """The checks both ways share: stop strings and bad words need the tokenizer (NOTE 3)."""
        if params.stop and self.tokenizer is None:
            raise ValueError(f"{name}: stop={params.stop!r} needs text, but the engine has no tokenizer")
        if params.structured_outputs is not None:
            self._check_structured_outputs(name, params)
        bad_words = self._bad_words_token_ids(name, params)  # sample/bad_words.py NOTE 1
        check_some_token_is_allowed(name, params, bad_words, self.eos_token_id)  # NOTE 3
        return EngineCoreRequest(request_id, text, tuple(ids), params, salt, bad_words, priority)

    def _pooling_params(self, label: str, params: object) -> PoolingParams | None:
        """NOTE 8: a pooling request's params resolved against the model; None for generation.
        The engine's runner and the params' kind must agree."""
        if self.pooling_model is None:
            if isinstance(params, PoolingParams):
                raise ValueError(f"{label}: PoolingParams need a pooling engine: LLM(model, runner='pooling')")
            return None
        if not isinstance(params, PoolingParams):
            raise ValueError(
                f"{label}: this engine pools (runner='pooling'): use LLM.embed, LLM.classify or LLM.encode with "
                f"PoolingParams; generating text needs runner='generate', got {type(params).__name__}"
            )
        return resolve_pooling_params(label, params, self.pooling_model)

    def _check_structured_outputs(self, name: str, params: SamplingParams) -> None:
        """NOTE 6: the constraint parses (xgrammar, without the tokenizer) and the engine can apply it."""
        kind = params.structured_outputs.kind
        if self.tokenizer is None or self.vocab_size is None:
            raise ValueError(f"{name}: structured_outputs ({kind}) needs the engine's tokenizer and vocab_size")
        try:
            backend_xgrammar.validate(params.structured_outputs)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None

    def _bad_words_token_ids(self, label: str, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """``params.bad_words`` as token sequences, each id in the vocabulary."""
        if not params.bad_words:
            return ()
        if self.tokenizer is None:
            raise ValueError(f"{label}: bad_words={params.bad_words!r} needs a tokenizer, but the engine has none")
        sequences = tokenize_bad_words(self.tokenizer, params.bad_words)
        for seq in sequences:
            check_token_ids(f"{label}: bad_words {self.tokenizer.decode(list(seq))!r}", seq, self.vocab_size)
        return sequences


def _check_request_id(request_id: object) -> None:
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a non-empty str, got {request_id!r} ({type(request_id).__name__})")
    if not request_id:
        raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")


def _first_sequence(request_id: str, params: SamplingParams) -> str:
    """The id that names a request in messages: its first child's when ``n`` > 1 (NOTE 4)."""
    return ParentRequest(request_id, params).child_id(0) if params.n > 1 else request_id
