"""The rejection sampler (``sample/rejection_sampler.py``) and the verification path (the
``Sampler`` on the rows of ``SamplingMetadata.expand``, as the model runner calls them): a
request keeps its drafts while each row's own token (its argmax, or its draw) equals them;
counted over many keys, the tokens are distributed as the target's; and a seeded request's
tokens are the draws a step without drafts makes."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.sample.draw_keys import draw_key
from tinyvllm.sample.logits_processors import LogitsProcessors
from tinyvllm.sample.metadata import SamplingMetadata
from tinyvllm.sample.rejection_sampler import rejection_sample
from tinyvllm.sample.sampler import Sampler, sampled_to_host


def test_a_request_keeps_drafts_while_its_rows_agree_then_the_first_disagreeing_token():
    # request 0: drafts [2, 3, 4], the rows' tokens [2, 3, 1, 0]: two kept, then 1
    # request 1: drafts [1], rows [1, 4]: kept, then the bonus 4
    # request 2: no drafts, one row: its token
    out = rejection_sample([2, 3, 1, 0, 1, 4, 3], None, [[2, 3, 4], [1], []])
    assert out == [[2, 3, 1], [1, 4], [3]]


def test_a_request_that_reaches_a_row_with_no_token_gets_none():
    # request 0 keeps draft 2, then its second row has nothing to pick; request 1's bad row
    # lies after a rejected draft, so it is never reached
    no_token = [False, True, False, False, False, True]
    out = rejection_sample([2, 3, 1, 7, 1, 4], no_token, [[2, 3], [9, 5]])
    assert out == [None, [7]]


def test_the_row_count_must_match_the_drafts():
    with pytest.raises(ValueError, match="6 target tokens for 7 rows"):
        rejection_sample([0] * 6, None, [[2, 3, 4], [1], []])


def metadata(temperature: list[float], seeds: dict[int, int], outputs) -> SamplingMetadata:
    t = torch.tensor(temperature)
    return SamplingMetadata(
        temperature=t, all_greedy=bool((t == 0).all()), all_random=not bool((t == 0).any()), top_p=None,
        top_k=None, seeds=seeds, logitsprocs=LogitsProcessors(), thinking_budget=None, output_token_ids=outputs,
    )  # fmt: skip


def logits_of(probs: torch.Tensor) -> torch.Tensor:
    return probs.clamp_min(1e-30).log()  # [N, V]: softmax gives back probs (0 stays ~0)


def spec(probs: torch.Tensor, drafts, temperature, seeds=None, outputs=None) -> list[list[int]]:
    """A verification step as the model runner runs it: the sampler on the drafts' rows, the
    tokens to the host in one read, then the rejection sampler."""
    outputs = outputs if outputs is not None else tuple([] for _ in drafts)
    rows = metadata(temperature, seeds or {}, outputs).expand(drafts)
    out = Sampler()(logits_of(probs), rows)
    return rejection_sample(*sampled_to_host(out.sampled_token_ids, out.no_token), drafts)


def test_greedy_verification_keeps_drafts_while_they_are_the_argmax():
    probs = torch.nn.functional.one_hot(torch.tensor([2, 3, 1, 0, 1, 4, 3]), 5).float()
    assert spec(probs, [[2, 3, 4], [1], []], [0.0, 0.0, 0.0]) == [[2, 3, 1], [1, 4], [3]]


def test_a_certain_draft_is_kept_and_an_impossible_one_never_drawn():
    probs = torch.nn.functional.one_hot(torch.tensor([2, 0, 4]), 5).float()  # certain: 2, then 0, bonus 4
    assert spec(probs, [[2, 0]], [1.0], {0: 1}) == [[2, 0, 4]]
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    for seed in range(20):  # draft 3 has probability 0: always rejected, replaced by 1 or 2
        [tokens] = spec(probs, [[3]], [1.0], {0: seed})
        assert len(tokens) == 1 and tokens[0] in (1, 2)


def test_rejection_sampling_draws_from_the_target():
    """NOTE 1: whatever the draft, the first token is distributed as the target's row."""
    target = torch.tensor([0.1, 0.4, 0.3, 0.2])
    probs = torch.stack([target, torch.full((4,), 0.25)])  # the draft's row, then the bonus row
    trials = 4000
    for draft in (1, 3):
        counts = torch.zeros(4)
        for seed in range(trials):
            [tokens] = spec(probs, [[draft]], [1.0], {0: seed})
            counts[tokens[0]] += 1
        freq = counts / trials
        # 4000 draws: a frequency's standard error is at most 0.008; 4 of them is 0.032
        assert torch.allclose(freq, target, atol=0.032), (draft, freq.tolist())


def test_two_drafts_give_the_targets_joint_distribution():
    """The first two tokens are distributed as the target's rows chained (row 1 applies only
    after draft 0 is kept): P(a, b) = p0(a) * p1(b) when a is the first draft."""
    p0 = torch.tensor([0.5, 0.3, 0.2])  # the token after the confirmed ones
    p1 = torch.tensor([0.2, 0.2, 0.6])  # the token after draft 0 (used only when draft 0 = token 0 is kept)
    probs = torch.stack([p0, p1, torch.tensor([1.0, 0.0, 0.0])])
    trials = 6000
    counts = torch.zeros(3, 3)
    for seed in range(trials):
        [tokens] = spec(probs, [[0, 2]], [1.0], {0: seed})
        if tokens[0] == 0:
            counts[0, tokens[1]] += 1
        else:
            assert len(tokens) == 1  # a rejected first draft ends the step
            counts[tokens[0], 0] += 1
    want = torch.zeros(3, 3)
    want[0] = p0[0] * p1  # draft 0 kept, then row 1: draft 2 kept with 0.6, else 0 or 1 drawn from the rest
    want[1, 0], want[2, 0] = p0[1], p0[2]
    assert torch.allclose(counts / trials, want, atol=0.03), (counts / trials).tolist()


def test_each_row_draws_what_a_step_without_drafts_draws_at_its_position():
    """NOTE 2: the row of draft j of a seeded request with o outputs is keyed by position
    o + j, so a verification step's tokens are exactly the plain sampler's draws there."""
    probs = torch.softmax(torch.randn(4, 9, generator=torch.Generator().manual_seed(3)), dim=-1)
    outputs = ([7, 7],)  # two outputs so far: the rows sample positions 2, 3, 4, 5
    plain = [
        Sampler()(logits_of(probs[j : j + 1]), metadata([1.0], {0: 42}, ([7, 7] + [0] * j,))).sampled_token_ids.item()
        for j in range(4)
    ]
    drafts = [plain[:3]]  # drafts equal to those draws are all kept, then the bonus draw
    assert spec(probs, drafts, [1.0], {0: 42}, outputs) == [plain]
    wrong = [plain[0], (plain[1] + 1) % 9, plain[2]]  # the second draft disagrees: its row's own token replaces it
    assert spec(probs, [wrong], [1.0], {0: 42}, outputs) == [plain[:2]]


def test_a_seeded_requests_tokens_do_not_depend_on_the_others_in_the_step():
    """A seeded request's rows draw from its own keys only, so the requests beside it
    (unseeded, seeded, greedy, with drafts or without) change nothing of its tokens."""
    probs = torch.softmax(torch.randn(9, 6, generator=torch.Generator().manual_seed(3)), dim=-1)
    for seed in range(30):
        alone = spec(probs[:3], [[1, 4]], [1.0], {0: seed})[0]
        mixed = torch.cat([probs[3:5], probs[:3], probs[5:]])
        together = spec(
            mixed, [[2], [1, 4], [0, 3], []], [1.0, 1.0, 0.0, 0.7], {1: seed, 3: 99},
            outputs=([], [], [], []),
        )  # fmt: skip
        assert together[1] == alone
    assert draw_key(0, 0) != draw_key(0, 1)  # rows of one request draw different noise
