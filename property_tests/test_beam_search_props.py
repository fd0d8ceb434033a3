"""Hypothesis over the rules of beam search (``beam_search.py``), driven by fake models: a
model is a function from a token sequence to logprobs over a small vocabulary, drawn by
Hypothesis. No engine runs; ``advance_all`` and ``search_outputs`` are driven as
``LLM.beam_search`` drives them.

- a search wide enough to keep every sequence (``beam_width >= V ** max_tokens``) returns
  the best ``beam_width`` of *all* sequences by score, found by enumerating them: the one
  oracle that shares no code or rule with the search;
- at any width, every step keeps the instances' invariants (``check_invariants``), and the
  answer is distinct sequences, best first by score, each sum the model's own.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tinyvllm.beam_search import (
    BeamSearchInstance,
    BeamSearchParams,
    advance_all,
    live_beams,
    search_outputs,
)
from tinyvllm.outputs import Logprob


class FakeModel:
    """Logprobs over ``vocab`` tokens, a fixed random function of the whole sequence."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.seed = vocab, seed

    def logprobs(self, tokens: tuple[int, ...]) -> list[float]:
        rng = random.Random(hash((self.seed, tokens)))
        logits = [rng.uniform(-3.0, 3.0) for _ in range(self.vocab)]
        top = max(logits)
        norm = top + math.log(sum(math.exp(x - top) for x in logits))
        return [x - norm for x in logits]

    def candidates(self, tokens: tuple[int, ...], k: int) -> dict[int, Logprob]:
        """The engine's entry for one position: the top ``k`` (greedy: the chosen token is the first)."""
        values = self.logprobs(tokens)
        order = sorted(range(self.vocab), key=lambda t: -values[t])[:k]
        return {t: Logprob(values[t]) for t in order}


def run_search(model: FakeModel, prompts: list[tuple[int, ...]], params: BeamSearchParams, eos: frozenset[int], max_model_len: int):
    instances = [BeamSearchInstance(p) for p in prompts]
    for _ in range(params.max_tokens):
        if not (beams := live_beams(instances)):
            break
        advance_all(instances, [model.candidates(b.tokens, params.num_candidates) for b in beams], params, eos, max_model_len)
        for instance in instances:
            instance.check_invariants(params)
    return search_outputs(instances, params, eos, lambda ids, skip: " ".join(map(str, ids)))


def score(seq: tuple[tuple[int, ...], float], eos: frozenset[int], length_penalty: float) -> float:
    """The score written from its definition: the sum over the length (the prompt counted,
    a final EOS not) to the power ``length_penalty``."""
    tokens, total = seq
    return total / (len(tokens) - (tokens[-1] in eos)) ** length_penalty


def all_sequences(model: FakeModel, prompt: tuple[int, ...], max_tokens: int, eos: frozenset[int], max_model_len: int):
    """Every sequence the search could end with: (tokens, sum), extended until an EOS,
    ``max_tokens`` or ``max_model_len``."""
    done, frontier = [], [(prompt, 0.0)]
    for _ in range(max_tokens):
        grown = []
        for tokens, total in frontier:
            values = model.logprobs(tokens)
            for t in range(model.vocab):
                child = (tokens + (t,), total + values[t])
                (done if t in eos or len(child[0]) >= max_model_len else grown).append(child)
        frontier = grown
    return done + frontier


settings_kwargs = dict(vocab=st.integers(2, 4), seed=st.integers(0, 10**6), eos_mask=st.integers(0, 15))


@given(
    **settings_kwargs,
    max_tokens=st.integers(1, 3),
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=3),
    length_penalty=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    room=st.integers(1, 4),
)
def test_a_search_wide_enough_to_keep_everything_finds_the_best_of_all_sequences(
    vocab, seed, eos_mask, max_tokens, prompt, length_penalty, room
):
    model = FakeModel(vocab, seed)
    prompt = tuple(t % vocab for t in prompt)
    eos = frozenset(t for t in range(vocab) if eos_mask >> t & 1 and t != 0)  # token 0 never ends a beam
    width = vocab**max_tokens
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty)
    max_model_len = len(prompt) + room
    (out,) = run_search(model, [prompt], params, eos, max_model_len)
    everything = all_sequences(model, prompt, max_tokens, eos, max_model_len)
    expected = sorted(everything, key=lambda seq: score(seq, eos, length_penalty), reverse=True)[:width]
    assert sorted(s.tokens for s in out.sequences) == sorted(tokens for tokens, _ in expected)
    scores = [score((s.tokens, s.cum_logprob), eos, length_penalty) for s in out.sequences]
    assert scores == sorted(scores, reverse=True)
    assert scores == pytest.approx([score(seq, eos, length_penalty) for seq in expected], abs=1e-9)


@given(
    **settings_kwargs,
    width=st.integers(1, 4),
    max_tokens=st.integers(1, 5),
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=1, max_size=3),
    ignore_eos=st.booleans(),
    length_penalty=st.sampled_from([0.0, 1.0, 1.5]),
)
def test_every_step_keeps_the_invariants_and_the_answer_is_ranked(
    vocab, seed, eos_mask, width, max_tokens, prompts, ignore_eos, length_penalty
):
    model = FakeModel(vocab, seed)
    prompts = [tuple(t % vocab for t in p) for p in prompts]
    eos = frozenset() if ignore_eos else frozenset(t for t in range(vocab) if eos_mask >> t & 1)
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=ignore_eos, length_penalty=length_penalty)
    outputs = run_search(model, prompts, params, eos, max_model_len=64)
    for prompt, out in zip(prompts, outputs):
        assert 1 <= len(out.sequences) <= width
        assert len({s.tokens for s in out.sequences}) == len(out.sequences)
        scores = [score((s.tokens, s.cum_logprob), eos, length_penalty) for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        for s in out.sequences:
            assert s.tokens[: len(prompt)] == prompt and 1 <= len(s.output_token_ids) <= max_tokens
            own = sum(model.logprobs(s.tokens[:i])[s.tokens[i]] for i in range(len(prompt), len(s.tokens)))
            assert math.isclose(own, s.cum_logprob, abs_tol=1e-9)
            ended_on_eos = s.tokens[-1] in eos
            assert s.finish_reason == ("stop" if ended_on_eos else "length")
            assert (s.stop_reason == s.tokens[-1]) if ended_on_eos else s.stop_reason is None
            assert ended_on_eos or len(s.output_token_ids) == max_tokens
            assert not any(t in eos for t in s.output_token_ids[:-1])
