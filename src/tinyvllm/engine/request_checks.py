"""What one request asks of the model, checked before the request is queued.

Concept: ``SamplingParams`` checks every field on its own, with no model. Some values only
mean something against the model the engine serves: token ids must lie in its vocabulary
(``logit_bias``, ``stop_token_ids``, ``allowed_token_ids``), a ``thinking_token_budget``
needs a reasoning config, and logprobs are capped. The input processor
(``engine/input_processor.py``) runs this check once for every request before it is queued;
``check_defaults_with_speculation`` makes the same refusal once, at start-up, for the
model's own sampling defaults.

Mirrors: ``vllm/v1/engine/processor.py`` (``Processor._validate_params``,
``_validate_logprobs``, the token-id checks of ``_validate_model_inputs``).
Left out: LoRA and multimodal inputs; structured outputs are checked by the input processor
(``input_processor.py`` NOTE 6).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tinyvllm.sampling_params import MAX_LOGPROBS, SamplingParams
from tinyvllm.validation import check_token_ids


# Fields a speculative engine refuses, with the value that means "off": seed 001 ch. 11.4
# builds only MinTokens under a speculative config ("min_p and logit_bias parameters won't
# work with speculative decoding"); vLLM warns and ignores them, we refuse. (Bad words,
# allowed ids and logprobs work on draft rows, as in vLLM: ``SamplingMetadata.expand``.)
NOT_WITH_SPECULATION = {"min_p": 0.0, "logit_bias": None}


# --8<-- [start:request_against_model]
def check_request_against_model(
    label: str, params: SamplingParams, vocab_size: int | None, has_reasoning: bool, speculative: bool = False,
    max_logprobs: int = MAX_LOGPROBS,
) -> None:  # fmt: skip
    """What one request's params ask of the model: token ids in the vocabulary, a reasoning config.

    ``label`` names the params in messages (``"sampling_params[2]"``). ``vocab_size`` None
    skips the vocabulary checks (a caller that does not know the model). ``speculative``: the
    engine verifies drafts, which the fields of ``NOT_WITH_SPECULATION`` do not work with.
    ``max_logprobs``: the most logprobs a request may ask for (``LLM(max_logprobs=...)``, -1: no cap).
    """
    if speculative:
        asked = [name for name, off in NOT_WITH_SPECULATION.items() if getattr(params, name) != off]
        if asked:
            them = "it" if len(asked) == 1 else "them"
            raise ValueError(
                f"{label}: {', '.join(asked)} cannot be used with speculative decoding (this engine verifies "
                f"drafts, and of the logits processors only min_tokens applies to them); leave {them} unset"
            )
    if vocab_size is not None:
        if params.logit_bias:
            check_token_ids(f"{label}.logit_bias", params.logit_bias, vocab_size)
        check_token_ids(f"{label}.stop_token_ids", params.stop_token_ids, vocab_size)
        if params.allowed_token_ids is not None:
            check_token_ids(f"{label}.allowed_token_ids", params.allowed_token_ids, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, name)
        if asked is None or max_logprobs == -1:
            continue
        if asked == -1:  # the whole vocabulary, as vLLM
            size = "" if vocab_size is None else f", {vocab_size} tokens"
            if vocab_size is None or vocab_size > max_logprobs:
                raise ValueError(
                    f"{label}.{name}=-1 (the whole vocabulary{size}), more than this engine's max_logprobs {max_logprobs}"
                )
        elif asked > max_logprobs:
            raise ValueError(f"{label}.{name}={asked}, more than this engine's max_logprobs {max_logprobs}")
    if params.thinking_token_budget is not None and not has_reasoning:
        raise ValueError(
            f"{label}.thinking_token_budget={params.thinking_token_budget!r}, but the engine has no "
            "reasoning_config (no <think>/</think> tokens in the vocabulary, and none was passed to LLM)"
        )
# --8<-- [end:request_against_model]


# --8<-- [start:defaults_with_speculation]
def check_defaults_with_speculation(defaults: Mapping[str, Any], source: Path) -> None:
    """At start-up: a sampling default from ``source`` (a ``generation_config.json``) that a
    speculative engine cannot honour would refuse every request that leaves the field
    unset, so the engine refuses to start instead, naming the file, the field and the ways
    out (vLLM runs such requests without drafts; here every request of one engine may
    carry drafts, so the default and speculation cannot both hold)."""
    asked = [f"{name}={defaults[name]!r}" for name, off in NOT_WITH_SPECULATION.items() if defaults.get(name, off) != off]
    if asked:
        raise ValueError(
            f"{source} sets {', '.join(asked)} as a default of every request, which speculative decoding "
            "cannot honour (speculative_config, --speculative-config): pass generation_config='vllm' "
            "(--generation-config vllm) to ignore the model's defaults, or leave speculation off"
        )
# --8<-- [end:defaults_with_speculation]
