# --8<-- [start:header]
"""Beam search: keep the ``beam_width`` most likely sequences, one token at a time.

Concept: a *beam* is a sequence (prompt + tokens so far) with the sum of its tokens'
logprobs. Each step asks the engine for one token of every live beam, with the top
``2 * beam_width`` logprobs; every (beam, candidate token) pair is a new beam whose sum adds
that token's logprob. A candidate that is an EOS token finishes: it joins ``completed``. The
rest are ranked by score and the best ``beam_width`` live on. After ``max_tokens`` steps (or
when no beam lives) the live beams join ``completed`` and the best ``beam_width`` by score
are the answer. The engine knows nothing of beams: each step's beams are ordinary
requests of one token, and the prefix cache finds what their prompts share
(``LLM.beam_search``, ``AsyncLLM.beam_search``).

Mirrors: ``vllm/beam_search.py`` (``BeamSearchSequence``, ``BeamSearchOutput``,
``BeamSearchInstance``, ``get_beam_search_score``, ``create_sort_beams_key_function``) and
``BeamSearchParams`` of ``vllm/sampling_params.py``; the step is the loop body of vLLM's
``LLM.beam_search`` (``vllm/entrypoints/llm.py``).

Invariants (``BeamSearchInstance.check_invariants``): at most ``beam_width`` live beams, each
unfinished and at most ``max_tokens`` tokens past the prompt; every completed beam has a
finish reason; every beam starts with the prompt and holds one logprobs entry per token
after it, whose chosen token's logprob its sum includes.

NOTE 1 (the score): ``cum_logprob / len ** length_penalty``, where ``len`` counts the
prompt's tokens too and not a final EOS, as vLLM (after an older transformers). Within a
step every live candidate has the same length, so the score ranks them as the sum does;
``length_penalty`` matters only when finished beams of different lengths are ranked at the
end: above 1 it favours longer ones, below 1 shorter ones.
NOTE 2 (why ``2 * beam_width`` candidates): up to ``beam_width`` of them may be EOS tokens
that finish, and ``beam_width`` must still live on (transformers' rule, kept by vLLM).
NOTE 3 (temperature): the logprobs are the model's raw ones (``sample/logprobs.py``), so
``temperature`` changes no score; with ``temperature > 0`` the token each request samples is
one more candidate when it is outside the top ``2 * beam_width``, as in vLLM.
NOTE 4 (EOS): every id the engine stops on for the model (the tokenizer's EOS and the extra
ones of ``generation_config.json``) finishes a beam; vLLM's uses the tokenizer's one id.
A beam that reaches ``max_model_len`` finishes with ``"length"``, as one that reaches
``max_tokens`` does.
"""
# --8<-- [end:header]

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from tinyvllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.validation import check_bool, check_int, check_real


@dataclass(frozen=True)
class BeamSearchParams:
    """What ``LLM.beam_search`` takes (vLLM's names and defaults)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # keep the final EOS token's text in ``text``

    def __post_init__(self) -> None:
        check_int("beam_width", self.beam_width, minimum=1)
        check_int("max_tokens", self.max_tokens, minimum=1)
        check_bool("ignore_eos", self.ignore_eos)
        check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        if not math.isfinite(temperature := check_real("temperature", self.temperature)) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not math.isfinite(check_real("length_penalty", self.length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")

    @property
    def num_candidates(self) -> int:
        """Logprobs asked of each step's request (NOTE 2)."""
        return 2 * self.beam_width


# --8<-- [start:sequence]
@dataclass(frozen=True)
class BeamSearchSequence:
    """One beam: ``tokens`` holds the prompt's and the generated ones (as vLLM's);
    ``logprobs`` one entry per generated token, the top candidates of its step."""

    tokens: tuple[int, ...]
    logprobs: tuple[PositionLogprobs, ...] = ()
    cum_logprob: float = 0.0
    text: str | None = None  # the generated text, filled when the search ends
    finish_reason: str | None = None  # "stop" (an EOS) or "length"; None while it lives
    stop_reason: int | None = None  # the EOS id that ended it

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.tokens) - len(self.logprobs)

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return self.tokens[self.num_prompt_tokens :]

    def extend(self, token_id: int, logprobs: PositionLogprobs) -> BeamSearchSequence:
        """This beam with one more token, whose logprob its sum gains."""
        return BeamSearchSequence(self.tokens + (token_id,), self.logprobs + (logprobs,), self.cum_logprob + logprobs[token_id].logprob)
# --8<-- [end:sequence]


@dataclass(frozen=True)
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


# --8<-- [start:score]
def get_beam_search_score(
    tokens: Sequence[int], cumulative_logprob: float, eos_token_ids: Collection[int], length_penalty: float = 1.0
) -> float:
    """A beam's score (NOTE 1): its sum over its length, prompt counted, a final EOS not."""
    seq_len = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cumulative_logprob / (max(seq_len, 1) ** length_penalty)


def create_sort_beams_key_function(eos_token_ids: Collection[int], length_penalty: float) -> Callable[[BeamSearchSequence], float]:
    def sort_beams_key(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_ids, length_penalty)

    return sort_beams_key
# --8<-- [end:score]


@dataclass
class BeamSearchInstance:
    """One prompt's search: its live beams and its finished ones."""

    prompt_token_ids: tuple[int, ...]
    cache_salt: str | None = None  # the prompt's, given to every request of its beams
    beams: list[BeamSearchSequence] = field(default_factory=list)
    completed: list[BeamSearchSequence] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.beams and not self.completed:
            self.beams = [BeamSearchSequence(tuple(self.prompt_token_ids))]

    # --8<-- [start:advance]
    def advance(
        self, results: Sequence[PositionLogprobs | None], params: BeamSearchParams, eos_token_ids: Collection[int],
        max_model_len: int,
    ) -> None:  # fmt: skip
        """One step: ``results[i]`` is the candidates the engine gave live beam ``i`` (None:
        it gave none). Each candidate extends its beam; an EOS finishes it (NOTE 4); the best
        ``beam_width`` of the rest live on, and those at ``max_model_len`` finish."""
        if len(results) != len(self.beams):
            raise ValueError(f"{len(results)} results for {len(self.beams)} live beams")
        key = create_sort_beams_key_function(eos_token_ids, params.length_penalty)
        candidates = []
        for beam, logprobs in zip(self.beams, results):
            for token_id in logprobs or ():
                new_beam = beam.extend(token_id, logprobs)
                if token_id in eos_token_ids and not params.ignore_eos:
                    self.completed.append(finished(new_beam, "stop", token_id))
                else:
                    candidates.append(new_beam)
        candidates.sort(key=key, reverse=True)  # stable: ties keep the engine's order
        self.beams = []
        for beam in candidates[: params.beam_width]:
            if len(beam.tokens) >= max_model_len:
                self.completed.append(finished(beam, "length"))
            else:
                self.beams.append(beam)
    # --8<-- [end:advance]

    def best(self, params: BeamSearchParams, eos_token_ids: Collection[int]) -> list[BeamSearchSequence]:
        """The search's answer: the live beams finish with ``"length"``, then the best
        ``beam_width`` of everything finished, by score."""
        everything = self.completed + [finished(beam, "length") for beam in self.beams]
        everything.sort(key=create_sort_beams_key_function(eos_token_ids, params.length_penalty), reverse=True)
        return everything[: params.beam_width]

    def check_invariants(self, params: BeamSearchParams) -> None:
        prompt = tuple(self.prompt_token_ids)
        assert len(self.beams) <= params.beam_width, f"{len(self.beams)} live beams for width {params.beam_width}"
        for beam in self.beams + self.completed:
            assert beam.tokens[: len(prompt)] == prompt and beam.num_prompt_tokens == len(prompt), beam
            assert len(beam.logprobs) <= params.max_tokens, beam
            total = sum(entry[token].logprob for entry, token in zip(beam.logprobs, beam.output_token_ids))
            assert math.isclose(total, beam.cum_logprob, rel_tol=1e-9, abs_tol=1e-9), (total, beam.cum_logprob)
        assert all(beam.finish_reason is None for beam in self.beams)
        assert all(beam.finish_reason in ("stop", "length") for beam in self.completed)


# --8<-- [start:drive]
def live_beams(instances: Sequence[BeamSearchInstance]) -> list[BeamSearchSequence]:
    """Every live beam of every prompt, in order: one request each in the next step."""
    return [beam for instance in instances for beam in instance.beams]


def advance_all(
    instances: Sequence[BeamSearchInstance], results: Sequence[PositionLogprobs | None], params: BeamSearchParams,
    eos_token_ids: Collection[int], max_model_len: int,
) -> None:  # fmt: skip
    """Hand each prompt its share of one step's ``results`` (in ``live_beams`` order)."""
    if len(results) != (num_live := sum(len(instance.beams) for instance in instances)):
        raise ValueError(f"{len(results)} results for {num_live} live beams")
    start = 0
    for instance in instances:
        end = start + len(instance.beams)
        instance.advance(results[start:end], params, eos_token_ids, max_model_len)
        start = end


def search_outputs(
    instances: Sequence[BeamSearchInstance], params: BeamSearchParams, eos_token_ids: Collection[int],
    decode: Callable[[Sequence[int], bool], str],
) -> list[BeamSearchOutput]:  # fmt: skip
    """The answer of every prompt, best first, each sequence with its text:
    ``decode(ids, skip_special_tokens)`` of its generated tokens less a final EOS, whose
    own text is added when ``include_stop_str_in_output``."""
    outputs = []
    for instance in instances:
        sequences = []
        for beam in instance.best(params, eos_token_ids):
            body = beam.output_token_ids[:-1] if beam.stop_reason is not None else beam.output_token_ids
            text = decode(body, True)
            if params.include_stop_str_in_output and beam.stop_reason is not None:
                text += decode([beam.stop_reason], False)
            sequences.append(dataclasses.replace(beam, text=text))
        outputs.append(BeamSearchOutput(sequences))
    return outputs
# --8<-- [end:drive]


# --8<-- [start:requests]
def beam_step_params(params: BeamSearchParams, max_logprobs: int) -> SamplingParams:
    """What each beam's request of a step asks: one token, with the top ``2 * beam_width``
    logprobs (NOTE 2), no text. A width the engine's ``max_logprobs`` cannot serve is refused."""
    if max_logprobs != -1 and params.num_candidates > max_logprobs:
        raise ValueError(
            f"beam_width={params.beam_width} needs {params.num_candidates} logprobs a step, more than the "
            f"engine's max_logprobs {max_logprobs}"
        )
    return SamplingParams(
        temperature=params.temperature, max_tokens=1, logprobs=params.num_candidates, ignore_eos=True, detokenize=False
    )


def check_room(index: int, prompt_token_ids: Sequence[int], cache_salt: str | None, max_model_len: int | None) -> BeamSearchInstance:
    """A prompt's search, refused when the prompt leaves no room for a token."""
    if max_model_len is not None and len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"prompt {index} has {len(prompt_token_ids)} tokens: beam search needs room for one more within "
            f"max_model_len {max_model_len}"
        )
    return BeamSearchInstance(tuple(prompt_token_ids), cache_salt)


def token_prompt(beam: BeamSearchSequence, cache_salt: str | None) -> dict:
    """A beam as a prompt of token ids: its request shares the prompt's cache salt, so the
    prefix cache finds the blocks of its earlier steps."""
    prompt: dict = {"prompt_token_ids": list(beam.tokens)}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


def candidates(output: RequestOutput) -> PositionLogprobs | None:
    """A step's candidates for one beam: its one token's logprobs entry (None when the
    request produced no token, an ``"error"`` row: the beam then ends without heirs)."""
    completion = output.outputs[0]
    return completion.logprobs[0] if completion.logprobs else None
# --8<-- [end:requests]


def completion_outputs(output: BeamSearchOutput) -> list[CompletionOutput]:
    """A prompt's answer as the completions of one ``RequestOutput`` (vLLM's shape), best
    first: each beam's generated tokens (a final EOS kept), text, sum, logprobs and finish."""
    return [
        CompletionOutput(i, beam.text or "", list(beam.output_token_ids), beam.finish_reason, beam.stop_reason,
                         list(beam.logprobs), beam.cum_logprob)
        for i, beam in enumerate(output.sequences)
    ]  # fmt: skip


def finished(beam: BeamSearchSequence, reason: str, stop_reason: int | None = None) -> BeamSearchSequence:
    return BeamSearchSequence(beam.tokens, beam.logprobs, beam.cum_logprob, beam.text, reason, stop_reason)

