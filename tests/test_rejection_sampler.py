"""The rejection sampler (``sample/rejection_sampler.py``): greedy drafts kept while they are
the argmax; random drafts kept with the target's probability, and (counted over many fixed
seeds) the tokens it returns are distributed as the target's."""

from __future__ import annotations

import torch

from tinyvllm.sample.rejection_sampler import rejection_sample


def one_hot_rows(ids: list[int], vocab: int = 5) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()  # [N, V]


def test_greedy_keeps_drafts_while_they_are_the_argmax():
    # request 0: drafts [2, 3, 4], the target's argmax rows [2, 3, 1, 0]: two kept, then 1
    # request 1: drafts [1], argmax rows [1, 4]: kept, then the bonus 4
    # request 2: no drafts, one row: its argmax
    argmax = torch.tensor([2, 3, 1, 0, 1, 4, 3])
    out = rejection_sample(None, argmax, [[2, 3, 4], [1], []], [True, True, True], {})
    assert out == [[2, 3, 1], [1, 4], [3]]


def test_random_rows_keep_a_certain_draft_and_never_draw_a_rejected_one():
    probs = one_hot_rows([2, 0, 4])  # request 0's target is certain: 2, then 0; the bonus row 4
    out = rejection_sample(probs, probs.argmax(-1), [[2, 0]], [False], {0: torch.Generator().manual_seed(1)})
    assert out == [[2, 0, 4]]
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    for seed in range(20):  # draft 3 has probability 0: always rejected, replaced by 1 or 2
        [tokens] = rejection_sample(probs, probs.argmax(-1), [[3]], [False], {0: torch.Generator().manual_seed(seed)})
        assert len(tokens) == 1 and tokens[0] in (1, 2)


def test_rejection_sampling_draws_from_the_target():
    """NOTE 1: whatever the draft, the first token is distributed as the target's row."""
    target = torch.tensor([0.1, 0.4, 0.3, 0.2])
    probs = torch.stack([target, torch.full((4,), 0.25)])  # the draft's row, then the bonus row
    trials = 4000
    for draft in (1, 3):
        counts = torch.zeros(4)
        for seed in range(trials):
            [tokens] = rejection_sample(probs, probs.argmax(-1), [[draft]], [False], {0: torch.Generator().manual_seed(seed)})
            counts[tokens[0]] += 1
        freq = counts / trials
        # 4000 draws: a frequency's standard error is at most 0.008; 4 of them is 0.032
        assert torch.allclose(freq, target, atol=0.032), (draft, freq.tolist())


def test_the_bonus_token_is_drawn_from_the_bonus_row():
    """NOTE 3: the bonus rows of a step are drawn in one batch; each still follows its own
    row's distribution, seeded or not, whatever the other requests hold."""
    target = torch.tensor([0.1, 0.4, 0.3, 0.2])
    certain = torch.tensor([0.0, 0.0, 1.0, 0.0])  # the draft 2 is certain: always kept
    probs = torch.stack([certain, target, torch.tensor([0.7, 0.1, 0.1, 0.1])])  # request 1: no drafts
    trials = 4000
    counts = torch.zeros(4)
    for seed in range(trials):
        gens = {0: torch.Generator().manual_seed(seed)} if seed % 2 else {}  # half seeded, half not
        first, second = rejection_sample(probs, probs.argmax(-1), [[2], []], [False, False], gens)
        assert first[0] == 2 and len(first) == 2 and len(second) == 1
        counts[first[1]] += 1
    assert torch.allclose(counts / trials, target, atol=0.032), (counts / trials).tolist()


def test_a_seeded_request_draws_the_same_tokens_every_time():
    probs = torch.softmax(torch.randn(6, 7, generator=torch.Generator().manual_seed(0)), dim=-1)
    runs = [
        rejection_sample(probs, probs.argmax(-1), [[1, 2], [3, 4]], [False, False],
                         {0: torch.Generator().manual_seed(7), 1: torch.Generator().manual_seed(8)})
        for _ in range(3)
    ]  # fmt: skip
    assert runs[0] == runs[1] == runs[2]


def test_two_drafts_give_the_targets_joint_distribution():
    """NOTE 4: every draft's uniform is drawn up front and compared at once; the first two
    tokens are still distributed as the target's rows chained (row 1 applies after draft 1 is
    kept), whichever drafts were proposed: P(a, b) = p0(a) * p1(b) when a is the first draft,
    and the second token is drawn from the bonus-free row 1 only through the kept draft."""
    p0 = torch.tensor([0.5, 0.3, 0.2])  # the token after the confirmed ones
    p1 = torch.tensor([0.2, 0.2, 0.6])  # the token after draft 0 (used only when draft 0 = token 0 is kept)
    bonus = torch.tensor([1.0, 0.0, 0.0])
    probs = torch.stack([p0, p1, bonus])
    trials = 6000
    counts = torch.zeros(3, 3)
    for seed in range(trials):
        [tokens] = rejection_sample(probs, probs.argmax(-1), [[0, 2]], [False], {0: torch.Generator().manual_seed(seed)})
        if tokens[0] == 0:
            counts[0, tokens[1]] += 1
        else:
            assert len(tokens) == 1  # a rejected first draft ends the step
            counts[tokens[0], 0] += 1
    freq = counts / trials
    want = torch.zeros(3, 3)
    want[0] = p0[0] * p1  # draft 0 kept, then row 1: draft 2 kept with 0.6, else 0 or 1 drawn from the rest
    want[1, 0], want[2, 0] = p0[1], p0[2]
    assert torch.allclose(freq, want, atol=0.03), freq.tolist()


def test_a_seeded_requests_tokens_do_not_depend_on_the_others_in_the_step():
    """NOTE 2: a seeded request draws from its own generator only, so the requests beside it
    (unseeded, seeded, greedy, with drafts or without) change nothing of its tokens."""
    probs = torch.softmax(torch.randn(9, 6, generator=torch.Generator().manual_seed(3)), dim=-1)

    def alone(seed: int) -> list[int]:
        return rejection_sample(probs[:3], probs[:3].argmax(-1), [[1, 4]], [False], {0: torch.Generator().manual_seed(seed)})[0]

    for seed in range(30):
        together = rejection_sample(
            torch.cat([probs[3:5], probs[:3], probs[5:]]), torch.cat([probs[3:5], probs[:3], probs[5:]]).argmax(-1),
            [[2], [1, 4], [0, 3], []], [False, False, True, False],
            {1: torch.Generator().manual_seed(seed), 3: torch.Generator().manual_seed(99)},
        )  # fmt: skip
        assert together[1] == alone(seed)
