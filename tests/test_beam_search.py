"""Beam search (``beam_search.py``, ``LLM.beam_search``): the step's rules on hand-made
logprobs, then the engine's search against a search written here over transformers'
logprobs, against transformers' own ``generate(num_beams=...)``, and what the prefix cache
saves each step; bad input refused before any step."""

import math
from collections import Counter

import pytest
import torch

from tinyvllm import LLM
from tinyvllm.beam_search import (
    BeamSearchInstance,
    BeamSearchParams,
    BeamSearchSequence,
    get_beam_search_score,
    search_outputs,
)
from tinyvllm.outputs import Logprob

EOS = 2


def entry(**logprobs: float) -> dict[int, Logprob]:
    """One position's candidates, ``t7=-0.5`` for token 7."""
    return {int(name[1:]): Logprob(value) for name, value in logprobs.items()}


# -- the rules, on hand-made logprobs ------------------------------------------------------


def test_score_counts_the_prompt_and_not_a_final_eos():
    assert get_beam_search_score([5, 6, 7, 8], -2.0, {EOS}) == -0.5
    assert get_beam_search_score([5, 6, 7, EOS], -3.0, {EOS}) == -1.0  # length 3: the EOS is not counted
    assert get_beam_search_score([5, 6, 7, 8], -2.0, {EOS}, length_penalty=2.0) == -2.0 / 16
    assert get_beam_search_score([5, 6, 7, 8], -2.0, {EOS}, length_penalty=0.0) == -2.0


def test_a_step_keeps_the_best_width_and_finishes_eos_candidates():
    """Width 2 from two beams: the four candidates are ranked by their sums; the EOS
    candidate, best of all, finishes instead of taking a place."""
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    instance = BeamSearchInstance((5, 6))
    instance.advance([entry(t7=-0.1, t8=-2.0)], params, {EOS}, max_model_len=64)
    assert [(b.tokens, b.cum_logprob) for b in instance.beams] == [((5, 6, 7), -0.1), ((5, 6, 8), -2.0)]
    instance.advance([entry(t9=-3.0, t10=-4.0), {EOS: Logprob(-0.05), 11: Logprob(-0.2)}], params, {EOS}, 64)
    assert [b.tokens for b in instance.beams] == [(5, 6, 8, 11), (5, 6, 7, 9)]  # -2.2, then -3.1
    assert [b.cum_logprob for b in instance.beams] == pytest.approx([-2.2, -3.1])
    (done,) = instance.completed
    assert (done.tokens, done.finish_reason, done.stop_reason) == ((5, 6, 8, EOS), "stop", EOS)
    assert done.cum_logprob == pytest.approx(-2.05)
    instance.check_invariants(params)


def test_ignore_eos_makes_eos_an_ordinary_candidate():
    params = BeamSearchParams(beam_width=1, max_tokens=4, ignore_eos=True)
    instance = BeamSearchInstance((5,))
    instance.advance([{EOS: Logprob(-0.1), 7: Logprob(-0.3)}], params, frozenset(), 64)
    assert [b.tokens for b in instance.beams] == [(5, EOS)] and instance.completed == []


def test_length_penalty_decides_between_finished_beams_of_different_lengths():
    """A short finished beam (sum -2, 3 tokens) against a long live one (sum -3, 5): by the
    mean the long one wins; with length_penalty 0 (the plain sum) the short one does."""
    short = BeamSearchSequence((5, 6, 7, EOS), (entry(t6=-1.0), entry(t7=-0.5), {EOS: Logprob(-0.5)}), -2.0, None, "stop", EOS)
    steps = tuple(entry(t9=-0.75) for _ in range(4))
    long = BeamSearchSequence((5, 9, 9, 9, 9), steps, -3.0)
    for penalty, best in ((1.0, long.tokens), (0.0, short.tokens)):
        params = BeamSearchParams(beam_width=1, max_tokens=4, length_penalty=penalty)
        instance = BeamSearchInstance((5,), beams=[long], completed=[short])
        instance.check_invariants(params)
        (winner,) = instance.best(params, {EOS})
        assert winner.tokens == best
    assert long.cum_logprob / 5 > short.cum_logprob / 3  # the arithmetic the first case relies on


def test_a_beam_that_reaches_max_model_len_finishes_with_length():
    params = BeamSearchParams(beam_width=2, max_tokens=8)
    instance = BeamSearchInstance((5, 6, 7))
    instance.advance([entry(t8=-0.1, t9=-0.2)], params, {EOS}, max_model_len=4)
    assert instance.beams == []
    assert [(b.tokens, b.finish_reason) for b in instance.completed] == [((5, 6, 7, 8), "length"), ((5, 6, 7, 9), "length")]


def test_text_leaves_out_the_eos_unless_include_stop_str_in_output():
    beam = BeamSearchSequence((5, 6, EOS), (entry(t6=-1.0), {EOS: Logprob(-1.0)}), -2.0, None, "stop", EOS)
    decode = lambda ids, skip: "".join(f"<{t}>" if t == EOS else f"w{t}" for t in ids if not (skip and t == EOS))  # noqa: E731
    for include, text in ((False, "w6"), (True, "w6<2>")):
        params = BeamSearchParams(beam_width=1, max_tokens=2, include_stop_str_in_output=include)
        (out,) = search_outputs([BeamSearchInstance((5,), beams=[], completed=[beam])], params, {EOS}, decode)
        assert out.sequences[0].text == text and out.sequences[0].output_token_ids == (6, EOS)


def test_a_step_given_the_wrong_number_of_results_changes_nothing():
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    instance = BeamSearchInstance((5,))
    with pytest.raises(ValueError, match="2 results for 1 live beams"):
        instance.advance([entry(t6=-1.0), entry(t7=-1.0)], params, {EOS}, 64)
    assert instance.beams == [BeamSearchSequence((5,))] and instance.completed == []


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(beam_width=0, max_tokens=4), ValueError, "beam_width must be an int >= 1, got 0"),
        (dict(beam_width=2, max_tokens=0), ValueError, "max_tokens must be an int >= 1, got 0"),
        (dict(beam_width=2.0, max_tokens=4), TypeError, "beam_width must be an int"),
        (dict(beam_width=2, max_tokens=4, temperature=-1.0), ValueError, "temperature must be .* got -1.0"),
        (dict(beam_width=2, max_tokens=4, length_penalty=math.inf), ValueError, "length_penalty must be .* got inf"),
        (dict(beam_width=2, max_tokens=4, ignore_eos=1), TypeError, "ignore_eos"),
    ],
)
def test_bad_beam_search_params_are_refused_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        BeamSearchParams(**kwargs)


# -- the engine's search ---------------------------------------------------------------------

PROMPTS = [[(37 * i + 11) % 500 + 5 for i in range(9)], [401, 402, 403], [(13 * i) % 300 + 40 for i in range(14)]]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dirs["qwen3"]), dtype=torch.float32).eval()


def reference_search(model, prompt, width, max_tokens, eos, length_penalty=1.0):
    """The search written from its definition, over transformers' logprobs of each beam's
    whole sequence: (tokens, sum) of the best ``width``, best first."""

    def score(tokens, total):
        return total / (len(tokens) - (tokens[-1] in eos)) ** length_penalty

    beams, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        grown = []
        for tokens, total in beams:
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].double(), -1)
            top = torch.topk(logprobs, 2 * width)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                (done if token in eos else grown).append((tokens + [token], total + value))
        beams = sorted(grown, key=lambda b: score(*b), reverse=True)[:width]
    return sorted(done + beams, key=lambda b: score(*b), reverse=True)[:width]


def make_llm(tiny_model_dirs, **kw) -> LLM:
    return LLM(str(tiny_model_dirs["qwen3"]), **{"device": "cpu", "max_model_len": 64, "block_size": 4, **kw})


def test_the_engines_search_equals_a_search_over_transformers_logprobs(tiny_model_dirs, hf_model):
    """Width 3, 6 steps, three prompts searched together, under two length penalties (the
    plain sum and the mean). The likeliest candidate token is made an EOS, so beams finish
    early and finished beams of different lengths are ranked against each other."""
    llm = make_llm(tiny_model_dirs)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    found = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    seen = Counter(t for out in found for s in out.sequences for position in s.logprobs for t in position)
    llm.engine.input_processor.extra_stop_token_ids = (seen.most_common(1)[0][0],)  # the likeliest candidate
    eos = llm.engine.input_processor.eos_token_ids
    finished_by_eos = {}
    for penalty in (0.0, 1.0):
        params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=penalty)
        outputs = llm.beam_search(prompts, params)
        finished_by_eos[penalty] = 0
        for prompt, out in zip(PROMPTS, outputs):
            expected = reference_search(hf_model, prompt, 3, 6, eos, length_penalty=penalty)
            assert [list(s.tokens) for s in out.sequences] == [tokens for tokens, _ in expected]
            assert [s.cum_logprob for s in out.sequences] == pytest.approx([total for _, total in expected], abs=1e-4)
            for s in out.sequences:
                assert s.finish_reason == ("stop" if s.tokens[-1] in eos else "length")
                assert len(s.logprobs) == len(s.tokens) - len(prompt) and len(s.logprobs[0]) >= 6
                finished_by_eos[penalty] += s.finish_reason == "stop"
    assert finished_by_eos[0.0] > 0 and finished_by_eos[1.0] > 0  # beams that ended on the EOS are among the best
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_invariants()


def test_the_best_beams_are_transformers_beam_search_without_eos(tiny_model_dirs, hf_model):
    """With EOS ignored every beam has the same length, so the two searches rank alike:
    transformers' ``generate(num_beams=4, num_return_sequences=4)`` returns the same
    sequences, best first."""
    llm = make_llm(tiny_model_dirs)
    params = BeamSearchParams(beam_width=4, max_tokens=5, ignore_eos=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outputs):
        with torch.no_grad():
            sequences = hf_model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), num_beams=4,
                num_return_sequences=4, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0,
                early_stopping=False, length_penalty=1.0,
            )  # fmt: skip
        assert [list(s.output_token_ids) for s in out.sequences] == [row[len(prompt) :].tolist() for row in sequences]


def test_each_step_computes_little_more_than_the_token_the_last_step_added(tiny_model_dirs, monkeypatch):
    """After the first step, a beam's request finds in the prefix cache every full block of
    its parent's prompt, so it computes at most a block's worth (here 4) of its tokens;
    without the cache it computes all of them."""
    computed = {}
    for caching in (True, False):
        llm = make_llm(tiny_model_dirs, enable_prefix_caching=caching)
        steps = []
        generate = llm.generate
        monkeypatch.setattr(llm, "generate", lambda *a, **k: steps.append(out := generate(*a, **k)) or out)
        llm.beam_search([{"prompt_token_ids": PROMPTS[2]}], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
        computed[caching] = [[len(o.prompt_token_ids) - o.num_cached_tokens for o in step] for step in steps]
    assert computed[False] == [[14], [15] * 3, [16] * 3, [17] * 3, [18] * 3]
    # a beam of n tokens finds its parent's (n - 1 tokens) full blocks: (n - 1) // 4 * 4 tokens
    expected = [[14]] + [[n - (n - 1) // 4 * 4] * 3 for n in (15, 16, 17, 18)]
    assert computed[True] == expected == [[14], [3] * 3, [4] * 3, [1] * 3, [2] * 3]


def test_bad_input_is_refused_before_any_step(tiny_model_dirs, monkeypatch):
    llm = make_llm(tiny_model_dirs, max_model_len=16)
    calls = []
    monkeypatch.setattr(llm, "generate", lambda *a, **k: calls.append(a))
    prompts = [{"prompt_token_ids": PROMPTS[0]}]
    with pytest.raises(ValueError, match="beam_width=11 needs 22 logprobs a step, more than the engine's max_logprobs 20"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="prompt 1 has 16 tokens: beam search needs room for one more within max_model_len 16"):
        llm.beam_search(prompts + [{"prompt_token_ids": list(range(5, 21))}], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.beam_search(prompts + [{"prompt_token_ids": []}], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(TypeError, match="params must be BeamSearchParams"):
        llm.beam_search(prompts, {"beam_width": 2})
    assert calls == [] and not llm.engine.has_unfinished_requests()


def test_text_prompts_and_the_texts_of_the_beams(tiny_model_dirs):
    llm = make_llm(tiny_model_dirs)
    (out,) = llm.beam_search("the quick brown fox", BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    prompt_ids = llm.tokenizer("the quick brown fox").input_ids
    for s in out.sequences:
        assert s.tokens[: len(prompt_ids)] == tuple(prompt_ids)
        assert s.text == llm.tokenizer.decode(list(s.output_token_ids), skip_special_tokens=True)
    assert out.sequences[0].cum_logprob >= out.sequences[1].cum_logprob


def test_prompts_of_the_wrong_type_are_refused_as_generate_refuses_them(tiny_model_dirs):
    llm = make_llm(tiny_model_dirs)
    for prompts in (7, b"bytes"):
        with pytest.raises(TypeError, match="prompts must be a str, a prompt dict or a list of them"):
            llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(TypeError, match=r"prompt 0 must be a str or a dict .*token ids go in a dict"):
        llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=2))
    assert llm.beam_search([], BeamSearchParams(beam_width=2, max_tokens=2)) == []


def test_a_concurrency_limit_searches_the_prompts_a_group_at_a_time_with_the_same_beams(tiny_model_dirs, monkeypatch):
    """``concurrency_limit=2`` over three prompts: two searches, then the third; no step holds
    more than 2 prompts' beams, and the beams are those of one search over all three."""
    llm = make_llm(tiny_model_dirs)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True)
    together = llm.beam_search(prompts, params)
    sizes = []
    generate = llm.generate
    monkeypatch.setattr(llm, "generate", lambda p, *a, **k: sizes.append(len(p)) or generate(p, *a, **k))
    grouped = llm.beam_search(prompts, params, concurrency_limit=2)
    assert [[s.tokens for s in o.sequences] for o in grouped] == [[s.tokens for s in o.sequences] for o in together]
    assert sizes == [2, 6, 6, 6, 1, 3, 3, 3]  # two prompts' beams (1, then 3 each), then the third's
    with pytest.raises(ValueError, match="concurrency_limit must be an int >= 1, got 0"):
        llm.beam_search(prompts, params, concurrency_limit=0)
