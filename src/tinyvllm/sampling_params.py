"""SamplingParams: how one request is to be continued, validated at construction.

Concept: the user-facing knobs of one request. This file owns their defaults and their
validation; nothing downstream re-checks them.

Mirrors: ``vllm/sampling_params.py`` (a much smaller subset).
Seed: 001 ch. 7.3 (``AddedRequest`` carries these params to every logits processor),
ch. 10 (``min_p``, ``logit_bias``, ``min_tokens``), ch. 13 (``thinking_token_budget``).

Fields: ``temperature`` (0 = greedy), ``top_p``, ``top_k`` (0 or -1 = off), ``min_p`` (0 =
off), ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty`` (NOTE 5),
``bad_words``, ``allowed_token_ids``, ``logit_bias``, ``min_tokens``, ``max_tokens`` (None =
up to the context), ``stop_token_ids``, ``stop`` (stop strings),
``include_stop_str_in_output``, ``ignore_eos``, ``seed``, ``logprobs`` and
``prompt_logprobs`` (NOTE 6), ``n`` (NOTE 7), ``skip_special_tokens``,
``thinking_token_budget`` (None = no limit), ``output_kind`` (NOTE 3), ``extra_args``
(free-form, for custom logits processors), ``detokenize`` (NOTE 8), ``structured_outputs`` (NOTE 9).

Invariants: an instance is frozen; ``stop_token_ids`` is a tuple of non-negative ints;
``stop`` and ``bad_words`` are tuples of non-empty strings (a single str becomes a 1-tuple);
``allowed_token_ids`` is None or a non-empty tuple of token ids; ``top_k`` -1 is stored as
0; ``logit_bias`` and ``extra_args`` are private copies; numpy/torch integers become ints.

Validates (``tinyvllm.validation``'s rule): a wrong type raises ``TypeError`` (``top_k=2.5``,
``seed="7"``, ``ignore_eos=1``), a value out of range ``ValueError`` (``seed=2**70``); both
name the field and the value. Token ids against the vocabulary, and whether the engine can
honour ``thinking_token_budget``, need the model: ``LLM.generate`` and ``add_request`` check.

NOTE 1 (temperature): 0 is greedy; a positive one is at least 1e-2 (below it vLLM clamps,
with a warning) and at most float32's largest value. Logits are divided by it in float32:
``logits / 1e-40`` overflows to inf, the softmax gives NaN and every draw returns token 0;
an inf temperature turns a masked ``-inf`` into NaN. We refuse rather than clamp silently.
NOTE 2 (logit_bias): each bias is finite, in [-100, 100] (OpenAI's limits): 1e39 is inf in
float32, as ``100 / temperature`` is for a tiny temperature, and an inf logit makes the
softmax NaN and the draw token 0.
NOTE 3 (output_kind): what ``LLMEngine.step()`` reports, as vLLM's ``RequestOutputKind``.
FINAL_ONLY (the default here): one output, when the request finishes. DELTA: an output every
step that adds text or tokens, holding only what is new. CUMULATIVE: everything so far.
vLLM's ``SamplingParams`` defaults to CUMULATIVE and its ``LLM.generate`` to FINAL_ONLY;
FINAL_ONLY here keeps ``step()`` returning finished requests only.
NOTE 4 (stop strings): searched in the detokenised text after each step, from ``min_tokens``
outputs on; the text is cut before the string (after it with ``include_stop_str_in_output``)
and the request finishes with ``finish_reason="stop"``, ``stop_reason`` the string.
NOTE 5 (penalties, vLLM's semantics and ranges): ``presence_penalty`` in [-2, 2] is
subtracted once from every token the output holds; ``frequency_penalty`` in [-2, 2] once
per occurrence; ``repetition_penalty`` > 0 (1 = off; at least 2**-126, float32's smallest
normal: a denormal one makes positive logits inf) divides a positive logit and multiplies
a negative one, for every prompt or output token (``sample/penalties.py``).
NOTE 6 (logprobs): ``logprobs=k`` returns, per output token, the sampled token's logprob and
rank plus the k most likely (0: the sampled one alone); ``prompt_logprobs=k`` the same for
every prompt token after the first. Both come from the raw logits (vLLM's default
``logprobs_mode``); k = -1 is the whole vocabulary. The engine caps k at ``max_logprobs``
(20 by default, as vLLM; -1 for no cap).
NOTE 7 (n): ``n`` completions, one child request each, sharing the prompt's blocks through the
prefix cache; a seeded parent gives child ``i`` the seed ``seed + i`` (wrapped into int64).
``n`` is at most 16384, vLLM's ``VLLM_MAX_N_SEQUENCES``: no more children than a process holds.
NOTE 8 (detokenize): False returns token ids, no text: ``decode`` is never called (vLLM's
throughput benchmark turns it off). Stop strings are found in the text, so they need it.
NOTE 9 (structured outputs): one constraint each; whether xgrammar takes it is checked at add_request.
"""

from __future__ import annotations

import enum
import json as json_module
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tinyvllm.validation import (
    INT64_MAX,
    INT64_MIN,
    check_bool,
    check_int,
    check_optional_int,
    check_real,
    check_token_ids,
)

MIN_TEMPERATURE = 1e-2  # NOTE 1
MAX_N = 16384  # NOTE 7: vLLM's VLLM_MAX_N_SEQUENCES default
MAX_LOGPROBS = 20  # NOTE 6: the most logprobs a request may ask for by default, vLLM's max_logprobs (LLM(max_logprobs=...))
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 2.0**-126  # the smallest normal float32
MAX_LOGIT_BIAS = 100.0  # NOTE 2


class RequestOutputKind(enum.IntEnum):
    """What ``LLMEngine.step()`` reports for a request (NOTE 3; names as vLLM's)."""

    CUMULATIVE = 0  # everything so far, every step that adds tokens
    DELTA = 1  # only what is new, every step that adds tokens
    FINAL_ONLY = 2  # one output, when the request finishes


# --8<-- [start:structured_outputs_params]
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (NOTE 9), vLLM's names; exactly one is set.

    Attributes:
        json: a JSON schema (a dict or its JSON text): the output is a JSON value it validates.
        regex: the output matches this regular expression in full.
        choice: the output is one of these strings.
        grammar: an EBNF grammar (xgrammar's dialect, GBNF-like, rule ``root``).
        json_object: True: the output is any JSON object.
        disable_any_whitespace: with ``json``: no whitespace between tokens of the JSON.
        whitespace_pattern: vLLM's field, for backends that take one (xgrammar does not: refused).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, Mapping):  # a private copy that JSON can write (the key, below)
            try:
                object.__setattr__(self, "json", json_module.loads(json_module.dumps(self.json)))
            except (TypeError, ValueError) as error:
                raise ValueError(f"structured_outputs json must be JSON-serialisable, got {self.json!r}: {error}") from None
        elif isinstance(self.json, str):
            try:
                json_module.loads(self.json)
            except ValueError as error:
                raise ValueError(f"structured_outputs json is not valid JSON: {self.json!r} ({error})") from None
        elif self.json is not None:
            raise TypeError(f"structured_outputs json must be a dict, a JSON str or None, got {self.json!r}")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs {name} must be a non-empty str or None, got {value!r}")
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, (str, bytes, Mapping)) or not isinstance(choice, (list, tuple)) or not choice:
                raise ValueError(f"structured_outputs choice must be a non-empty list of str, got {choice!r}")
            if not all(isinstance(c, str) and c for c in choice):
                raise ValueError(f"structured_outputs choice must hold non-empty strs, got {choice!r}")
            object.__setattr__(self, "choice", tuple(choice))
        if self.json_object not in (None, True):
            raise ValueError(f"structured_outputs json_object must be True or None, got {self.json_object!r}")
        check_bool("disable_any_whitespace", self.disable_any_whitespace)
        given = [name for name in _CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(_CONSTRAINTS)}; got "
                + (", ".join(f"{n}={getattr(self, n)!r}" for n in given) if given else "none")
            )

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) is not None)

    @property
    def key(self) -> tuple[str, str, bool]:
        """What a compiled grammar is cached under: the kind, the spec as text, the whitespace flag."""
        kind, spec = self.kind, getattr(self, self.kind)
        if kind == "json":
            spec = json_module.loads(spec) if isinstance(spec, str) else spec
        text = json_module.dumps(spec, sort_keys=True) if kind in ("json", "choice") else str(spec)
        return kind, text, self.disable_any_whitespace
# --8<-- [end:structured_outputs_params]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling knobs and generation limits.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: keep the smallest set of tokens whose probability sums to >= top_p, in (0, 1].
        top_k: keep the k most likely tokens; 0 (or -1, as in vLLM) turns it off.
        min_p: drop tokens whose probability is below ``min_p * max_prob``, in [0, 1].
        presence_penalty: in [-2, 2], per token already in the output (NOTE 5).
        frequency_penalty: in [-2, 2], per occurrence in the output (NOTE 5).
        repetition_penalty: > 0, 1 is off; over the prompt and the output (NOTE 5).
        bad_words: words never to generate: each word's tokens are banned as a sequence.
        allowed_token_ids: if set, only these tokens may be sampled.
        logit_bias: ``{token_id: bias}`` added to the logits before sampling.
        min_tokens: stop tokens are masked until this many tokens have been generated.
        max_tokens: the most output tokens to generate (>= 1); None: up to ``max_model_len``.
        stop_token_ids: generation stops after any of these tokens is produced.
        stop: generation stops when the text contains any of these strings (NOTE 4).
        include_stop_str_in_output: keep the stop string at the end of the text.
        ignore_eos: keep generating past the end-of-sequence token.
        seed: seeds this request's own random generator (same seed, same tokens).
        logprobs: per output token, the logprobs of the sampled token and the top k (NOTE 6).
        prompt_logprobs: the same for the prompt's tokens (NOTE 6).
        n: how many completions to return for the prompt (NOTE 7).
        skip_special_tokens: leave special tokens out of the text.
        thinking_token_budget: the most tokens a think section may last (>= 0), None = no limit.
        output_kind: what ``LLMEngine.step()`` reports for the request (NOTE 3).
        extra_args: free-form arguments for custom logits processors.
        detokenize: False returns no text, only token ids (NOTE 8).
        structured_outputs: a grammar the output must follow (NOTE 9); None: no constraint.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    allowed_token_ids: tuple[int, ...] | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    max_tokens: int | None = 16
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    thinking_token_budget: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    extra_args: dict[str, Any] | None = None
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        checked: dict[str, Any] = {}  # field -> the value to store (numpy scalars become Python numbers)
        temperature = checked["temperature"] = check_real("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if 0 < temperature < MIN_TEMPERATURE or temperature > FLOAT32_MAX:  # NOTE 1
            raise ValueError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {FLOAT32_MAX:.4g}], got {self.temperature!r}"
            )
        top_p = checked["top_p"] = check_real("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        top_k = check_int("top_k", self.top_k, -1, INT64_MAX)
        checked["top_k"] = 0 if top_k == -1 else top_k  # 0 and -1 turn it off, as in vLLM
        min_p = checked["min_p"] = check_real("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):  # NOTE 5
            value = checked[name] = check_real(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        repetition = checked["repetition_penalty"] = check_real("repetition_penalty", self.repetition_penalty)
        if not FLOAT32_TINY <= repetition <= FLOAT32_MAX:  # below: a denormal, dividing logits into inf
            raise ValueError(
                f"repetition_penalty must be greater than 0 (1 is off) and at least float32's smallest normal, "
                f"2**-126 ~ 1.2e-38 (below it every positive logit divides into inf), got {self.repetition_penalty!r}"
            )
        checked["bad_words"] = _checked_strings("bad_words", self.bad_words)
        checked["allowed_token_ids"] = _checked_allowed_token_ids(self.allowed_token_ids)
        checked["logit_bias"] = _checked_logit_bias(self.logit_bias)
        max_tokens = checked["max_tokens"] = check_optional_int("max_tokens", self.max_tokens, 1)
        min_tokens = checked["min_tokens"] = check_int("min_tokens", self.min_tokens)
        if min_tokens < 0 or (max_tokens is not None and min_tokens > max_tokens):
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={max_tokens}], got {self.min_tokens!r}")
        stop = self.stop_token_ids
        checked["stop_token_ids"] = () if stop is None else tuple(check_token_ids("stop_token_ids", stop))
        checked["stop"] = _checked_strings("stop", self.stop)
        checked["include_stop_str_in_output"] = check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        checked["ignore_eos"] = check_bool("ignore_eos", self.ignore_eos)
        checked["seed"] = check_optional_int("seed", self.seed, INT64_MIN, INT64_MAX)  # a torch.Generator's range
        checked["logprobs"] = check_optional_int("logprobs", self.logprobs, -1)  # NOTE 6
        checked["prompt_logprobs"] = check_optional_int("prompt_logprobs", self.prompt_logprobs, -1)
        checked["n"] = check_int("n", self.n, 1, MAX_N)  # NOTE 7
        checked["skip_special_tokens"] = check_bool("skip_special_tokens", self.skip_special_tokens)
        checked["thinking_token_budget"] = check_optional_int("thinking_token_budget", self.thinking_token_budget, 0)
        checked["output_kind"] = _checked_output_kind(self.output_kind)
        checked["extra_args"] = _checked_extra_args(self.extra_args)
        checked["detokenize"] = check_bool("detokenize", self.detokenize)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(f"structured_outputs must be a StructuredOutputsParams or None, got {self.structured_outputs!r}")
        if checked["stop"] and not checked["detokenize"]:  # NOTE 8
            raise ValueError(f"stop={checked['stop']!r} needs detokenize=True: stop strings are found in the text")
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax (temperature 0)."""
        return self.temperature == 0


def _checked_logit_bias(logit_bias: object) -> dict[int, float] | None:
    """Validate ``logit_bias`` and return a private copy (None when empty or absent)."""
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, Mapping):
        raise TypeError(f"logit_bias must be a dict {{token_id: bias}} or None, got {logit_bias!r}")
    checked: dict[int, float] = {}
    for tok, bias in logit_bias.items():
        [token] = check_token_ids("logit_bias keys", [tok])
        value = check_real(f"logit_bias[{token}]", bias)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # NOTE 2
            raise ValueError(f"logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {bias!r}")
        checked[token] = value
    return checked or None


def _checked_strings(name: str, value: object) -> tuple[str, ...]:
    """``stop`` and ``bad_words``: None, a str or a sequence of non-empty strs, as a tuple (NOTE 4)."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if isinstance(value, (bytes, bytearray, Mapping)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a str, a list of str or None, got {value!r} ({type(value).__name__})")
    for item in value:
        if not isinstance(item, str):
            raise TypeError(f"{name} must hold strs, got {item!r} ({type(item).__name__})")
        if not item:
            raise ValueError(f"{name} strings must be non-empty, got {value!r}")
    return tuple(value)


def _checked_allowed_token_ids(value: object) -> tuple[int, ...] | None:
    """None, or a non-empty sequence of token ids (an empty one would allow nothing at all)."""
    if value is None:
        return None
    ids = check_token_ids("allowed_token_ids", value)
    if not ids:
        raise ValueError(f"allowed_token_ids must be None or hold at least one token id, got {value!r}")
    return tuple(ids)


def _checked_output_kind(kind: object) -> RequestOutputKind:
    """A ``RequestOutputKind`` (NOTE 3); a plain int is refused, like a bool for an int."""
    if not isinstance(kind, RequestOutputKind):
        raise TypeError(f"output_kind must be a RequestOutputKind, got {kind!r} ({type(kind).__name__})")
    return kind


def _checked_extra_args(extra_args: object) -> dict[str, Any] | None:
    """A private copy of ``extra_args``, a dict with str keys (vLLM's ``dict[str, Any]``)."""
    if extra_args is None:
        return None
    if not isinstance(extra_args, Mapping):
        raise TypeError(f"extra_args must be a dict or None, got {extra_args!r}")
    for key in extra_args:
        if not isinstance(key, str):
            raise TypeError(f"extra_args keys must be str, got {key!r} ({type(key).__name__})")
    return dict(extra_args)
