"""The sampler: order of operations, greedy / random rows, top-k / top-p, seeds, forcing;
and SamplingMetadata, the frozen view of the batch that the sampler reads."""

import dataclasses
from types import MappingProxyType

import pytest
import torch

from tinyvllm.config import EngineConfig, ReasoningConfig, SchedulerConfig
from tinyvllm.sample.logits_processors import LogitsProcessors, build_logitsprocs
from tinyvllm.sample.metadata import SamplingMetadata
from tinyvllm.sample.draw_keys import draw_key
from tinyvllm.sample.ops.random_sample import random_sample
from tinyvllm.sample.sampler import Sampler, SamplerOutput, apply_top_k_top_p
from tinyvllm.sample.thinking_budget import ThinkingBudgetStateHolder
from tinyvllm.sample.top_k_top_p import TopKTopPPlan
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.input_batch import InputBatch

CPU = torch.device("cpu")
V = 10


def make_batch(reasoning=None, max_num_reqs=8):
    config = EngineConfig(scheduler_config=SchedulerConfig(max_num_seqs=max_num_reqs))
    holder = ThinkingBudgetStateHolder(reasoning, max_num_reqs, 0, CPU, False) if reasoning else None
    return InputBatch(max_num_reqs, CPU, build_logitsprocs(config, CPU, False, False), holder, vocab_size=V)


@pytest.mark.seed("001:9")
def test_greedy_rows_take_argmax_after_non_argmax_invariant_processors():
    batch = make_batch()
    batch.add_request("bias", SamplingParams(temperature=0, logit_bias={7: 10.0}), None, [])
    batch.add_request("mint", SamplingParams(temperature=0, min_tokens=1, stop_token_ids=(2,)), None, [])
    batch.add_request("plain", SamplingParams(temperature=0), None, [])
    batch.refresh()
    logits = torch.zeros(3, V)
    logits[:, 2] = 5.0
    out = Sampler()(logits, batch.make_sampling_metadata())
    assert isinstance(out, SamplerOutput)
    assert out.sampled_token_ids.tolist()[0] == 7 and out.sampled_token_ids.tolist()[2] == 2
    assert out.sampled_token_ids.tolist()[1] != 2  # EOS-like stop token held back
    assert logits[0, 7].item() == 0.0  # the caller's logits were not edited


def test_logits_are_cast_to_float32():
    batch = make_batch()
    batch.add_request("a", SamplingParams(temperature=0), None, [])
    batch.refresh()
    logits = torch.zeros(1, V, dtype=torch.bfloat16)
    logits[0, 4] = 1.0
    assert Sampler()(logits, batch.make_sampling_metadata()).sampled_token_ids.tolist() == [4]


def test_row_count_mismatch_raises():
    batch = make_batch()
    batch.add_request("a", SamplingParams(), None, [])
    batch.refresh()
    with pytest.raises(ValueError, match="2 rows.* 1 requests"):
        Sampler()(torch.zeros(2, V), batch.make_sampling_metadata())


def test_top_k_top_p_masks():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0], [0.0, 0.0, 0.0, 0.0]]).log_softmax(-1)
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3).log()
    out = apply_top_k_top_p(probs, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.7, 1.0]))
    assert torch.isinf(out).tolist() == [[False, False, True, True], [False, False, True, True], [False] * 4]
    assert logits.shape == out.shape


def test_top_p_always_keeps_the_most_likely_token():
    out = apply_top_k_top_p(torch.tensor([[5.0, 0.0, 0.0]]), torch.tensor([0]), torch.tensor([0.01]))
    assert torch.isinf(out).tolist() == [[False, True, True]]


def test_random_sample_follows_probabilities():
    torch.manual_seed(0)
    probs = torch.tensor([[0.0, 0.8, 0.2, 0.0]]).repeat(4000, 1)
    tokens = random_sample(probs, {})
    assert set(tokens.tolist()) <= {1, 2}
    assert 0.75 < (tokens == 1).float().mean().item() < 0.85


def test_same_seed_same_tokens_whatever_else_is_in_the_batch():
    def run(others: int, position_first: bool) -> list[int]:
        batch = make_batch()
        mine = []
        if position_first:
            batch.add_request("mine", SamplingParams(temperature=1.0, seed=1234), None, mine)
        for i in range(others):
            batch.add_request(f"o{i}", SamplingParams(temperature=0.8), None, [])
        if not position_first:
            batch.add_request("mine", SamplingParams(temperature=1.0, seed=1234), None, mine)
        batch.refresh()
        row = batch.req_id_to_index["mine"]
        tokens = []
        for _ in range(6):
            out = Sampler()(torch.zeros(batch.num_reqs, V), batch.make_sampling_metadata())
            tokens.append(out.sampled_token_ids[row].item())
            mine.append(tokens[-1])  # as the runner does: the next draw is keyed by the next position
        return tokens

    alone = run(0, True)
    assert alone == run(3, False) == run(5, True)
    assert len(set(alone)) > 1  # uniform logits: it really is random


@pytest.mark.seed("001:9")
def test_min_p_applies_to_random_rows_only():
    batch = make_batch()
    out = []
    batch.add_request("r", SamplingParams(temperature=1.0, min_p=0.5, seed=0), None, out)
    batch.refresh()
    logits = torch.tensor([[2.0, 1.9, -5.0, -5.0, -5.0, -5.0, -5.0, -5.0, -5.0, -5.0]])
    for _ in range(50):
        out.append(Sampler()(logits, batch.make_sampling_metadata()).sampled_token_ids.item())
    assert set(out) == {0, 1}


@pytest.mark.seed("001:13")
def test_thinking_budget_forcing_in_sampler_beats_greedy_and_random_rows():
    batch = make_batch(ReasoningConfig((1,), (2, 3)))
    greedy_out, random_out = [], []
    batch.add_request("g", SamplingParams(temperature=0, thinking_token_budget=1), [1], greedy_out)
    batch.add_request("r", SamplingParams(temperature=1.0, top_k=3, min_p=0.2, thinking_token_budget=0, seed=3), [1], random_out)
    logits = torch.zeros(2, V)
    logits[:, 5] = 8.0
    for _ in range(4):
        batch.refresh()
        tokens = Sampler()(logits, batch.make_sampling_metadata()).sampled_token_ids.tolist()
        greedy_out.append(tokens[0])
        random_out.append(tokens[1])
    assert greedy_out == [5, 2, 3, 5]
    assert random_out[:2] == [2, 3]


def test_top_k_top_p_none_means_off_for_every_row():
    logits = torch.tensor([[0.3, 2.0, -1.0, 1.5], [1.0, 0.0, 4.0, 2.0]])
    k, p = torch.tensor([2, 0]), torch.tensor([0.5, 1.0])
    assert torch.equal(apply_top_k_top_p(logits, k, None), apply_top_k_top_p(logits, k, torch.ones(2)))
    assert torch.equal(apply_top_k_top_p(logits, None, p), apply_top_k_top_p(logits, torch.zeros(2, dtype=torch.int64), p))
    assert torch.isinf(apply_top_k_top_p(logits, k, None)).tolist() == [[True, False, True, False], [False] * 4]
    assert torch.equal(apply_top_k_top_p(logits, None, None), logits)


# -- SamplingMetadata -------------------------------------------------------------------


def make_metadata(temperature, top_p=None, top_k=None, seeds=None, outputs=None):
    temperature = torch.tensor(temperature, dtype=torch.float32)
    if outputs is None and seeds:
        outputs = tuple([] for _ in range(temperature.shape[0]))
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=bool((temperature == 0).all()),
        all_random=not bool((temperature == 0).any()),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int64),
        seeds=seeds or {},
        logitsprocs=LogitsProcessors(),
        thinking_budget=None,
        output_token_ids=outputs or (),
    )


def test_make_sampling_metadata_holds_the_rows_values():
    batch = make_batch()
    batch.add_request("greedy", SamplingParams(temperature=0), None, [])
    batch.add_request("nucleus", SamplingParams(temperature=0.8, top_p=0.9, seed=5), None, [])
    batch.add_request("topk", SamplingParams(temperature=1.5, top_k=4), None, [])
    batch.refresh()
    md = batch.make_sampling_metadata()
    assert md.num_reqs == 3
    assert md.temperature.dtype == torch.float32
    assert md.temperature.tolist() == torch.tensor([0.0, 0.8, 1.5]).tolist()
    assert md.top_p.tolist() == torch.tensor([1.0, 0.9, 1.0]).tolist()
    assert md.top_k.dtype == torch.int64 and md.top_k.tolist() == [0, 0, 4]
    assert (md.all_greedy, md.all_random) == (False, False)
    assert dict(md.seeds) == {1: 5} == batch.seeds  # draws keyed by the request's seed
    assert md.logitsprocs is batch.logitsprocs and md.thinking_budget is None


def test_make_sampling_metadata_flags_and_none_limits():
    batch = make_batch()
    batch.add_request("a", SamplingParams(temperature=0), None, [])
    batch.add_request("b", SamplingParams(temperature=0, top_k=3), None, [])
    batch.refresh()
    md = batch.make_sampling_metadata()
    assert (md.all_greedy, md.all_random) == (True, False)
    assert md.top_p is None and md.top_k.tolist() == [0, 3]
    assert dict(md.seeds) == {}

    batch.remove_request("a")
    batch.remove_request("b")
    batch.add_request("c", SamplingParams(temperature=1.0, seed=7), None, [])
    batch.add_request("d", SamplingParams(temperature=0.5, top_p=0.95), None, [])
    batch.add_request("e", SamplingParams(temperature=2.0, seed=8), None, [])
    batch.condense()
    batch.refresh()
    md = batch.make_sampling_metadata()
    assert (md.all_greedy, md.all_random) == (False, True)
    assert md.top_k is None and md.top_p.tolist() == torch.tensor([1.0, 0.95, 1.0]).tolist()
    assert dict(md.seeds) == {0: 7, 2: 8}


def test_make_sampling_metadata_is_a_frozen_snapshot():
    batch = make_batch()
    batch.add_request("a", SamplingParams(temperature=0.7, seed=1), None, [])
    batch.add_request("b", SamplingParams(temperature=0.3), None, [])
    batch.refresh()
    md = batch.make_sampling_metadata()
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.temperature = torch.zeros(2)
    with pytest.raises(TypeError):
        md.seeds[1] = 4
    batch.remove_request("a")
    batch.add_request("c", SamplingParams(temperature=0, seed=2), None, [])
    batch.refresh()
    assert md.temperature.tolist() == torch.tensor([0.7, 0.3]).tolist()  # the batch's edits do not leak in
    assert dict(md.seeds) == {0: 1} and batch.seeds == {0: 2}


def test_make_sampling_metadata_refuses_holes_and_unrefreshed_changes():
    batch = make_batch()
    for r in ("a", "b", "c"):
        batch.add_request(r, SamplingParams(), None, [])
    with pytest.raises(RuntimeError, match="refresh"):
        batch.make_sampling_metadata()  # added but not yet handed to the processors
    batch.refresh()
    batch.remove_request("a")
    with pytest.raises(RuntimeError, match=r"rows \[0\] are holes"):
        batch.make_sampling_metadata()
    batch.condense()
    with pytest.raises(RuntimeError, match="refresh"):
        batch.make_sampling_metadata()
    batch.refresh()
    assert batch.make_sampling_metadata().num_reqs == 2


def test_sampling_metadata_is_frozen_and_its_seeds_read_only():
    mine = {0: 3}
    md = make_metadata([1.0, 0.0], seeds=mine)
    assert md.num_reqs == 2
    for name, value in [("all_greedy", True), ("top_k", None), ("seeds", {})]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(md, name, value)
    assert isinstance(md.seeds, MappingProxyType)
    with pytest.raises(TypeError):
        md.seeds[1] = 4
    mine[1] = 4  # the caller's dict was copied
    assert list(md.seeds) == [0]


def test_sampling_metadata_rejects_inconsistent_shapes():
    with pytest.raises(ValueError, match=r"top_k must have shape \[2\], got \(3,\)"):
        make_metadata([1.0, 1.0], top_k=[1, 2, 3])
    with pytest.raises(ValueError, match=r"seeds name rows \[2\]"):
        make_metadata([1.0, 1.0], seeds={2: 5})
    with pytest.raises(ValueError, match=r"seeds need every row's output list: 0 lists for 2 rows"):
        make_metadata([1.0, 1.0], seeds={1: 5}, outputs=())
    with pytest.raises(ValueError, match=r"temperature must have shape \[R\]"):
        make_metadata([[1.0]])


def test_expand_spreads_every_request_over_its_rows():
    """``SamplingMetadata.expand`` (NOTE 4 of ``sample/metadata.py``): request r owns
    ``len(drafts[r]) + 1`` rows; each row has its request's values, and row j's output so
    far ends with drafts ``0 .. j - 1``, so a seeded row's draw is keyed by its position."""
    outputs = ([5], [], [7, 7])
    md = make_metadata([0.5, 0.0, 1.0], top_k=[0, 3, 0], top_p=[0.9, 1.0, 1.0], seeds={0: 11, 2: 12}, outputs=outputs)
    drafts = [[1, 2], [], [4]]  # rows 0-2, 3, 4-5
    rows = md.expand(drafts)
    assert rows.num_reqs == 6 and rows.rows_per_request == (3, 1, 2)
    assert rows.temperature.tolist() == torch.tensor([0.5, 0.5, 0.5, 0.0, 1.0, 1.0]).tolist()
    assert rows.top_k.tolist() == [0, 0, 0, 3, 0, 0]
    assert rows.top_p.tolist() == torch.tensor([0.9, 0.9, 0.9, 1.0, 1.0, 1.0]).tolist()
    assert rows.top_k_top_p_plan == TopKTopPPlan(top_k_rows=(3,), top_p_rows=(0, 1, 2), max_top_k=3)
    assert (rows.all_greedy, rows.all_random) == (md.all_greedy, md.all_random)
    assert dict(rows.seeds) == {0: 11, 1: 11, 2: 11, 4: 12, 5: 12}
    assert [list(o) for o in rows.output_token_ids] == [[5], [5, 1], [5, 1, 2], [], [7, 7], [7, 7, 4]]
    assert rows.output_token_ids[0] is outputs[0]  # a request's first row reads its live list
    positions = {0: 1, 1: 2, 2: 3, 4: 2, 5: 3}  # each seeded row's output position
    assert rows.draw_keys() == {row: draw_key(rows.seeds[row], pos) for row, pos in positions.items()}
    assert rows.num_logprobs == {}  # a speculative step's logprobs are taken after the rejection
    with pytest.raises(ValueError, match="drafts for 2 requests, the sampling metadata has 3"):
        md.expand([[1], []])


def test_expand_of_a_step_without_drafts_is_the_record_itself():
    md = make_metadata([0.5, 0.0], seeds={0: 3}, outputs=([1], [2]))
    assert md.expand([[], []]) is md and md.rows_per_request is None


def test_expand_gives_every_row_its_requests_allowed_ids_and_bad_words():
    """Allowed ids mask each row of a restricting request; a bad word bans at the row whose
    drafts before it would complete it. The expanded rows sample what the plain sampler
    samples for one request whose outputs already hold those drafts."""
    v = 6
    mask = torch.ones(1, v, dtype=torch.bool)
    mask[0, [2, 3, 4]] = False  # request 1 may sample 2, 3 and 4 only
    outputs = ([0], [1])
    md = dataclasses.replace(
        make_metadata([0.0, 0.0], outputs=outputs), allowed_token_ids_rows=torch.tensor([1]),
        allowed_token_ids_mask=mask, bad_words_token_ids={0: ((3, 5),), 1: ((2, 4),)},
    )  # fmt: skip
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]).repeat(5, 1)  # argmax 5 everywhere
    drafts = [[3, 1], [2]]  # rows 0-2 (request 0), rows 3-4 (request 1)
    got = Sampler()(logits, md.expand(drafts)).sampled_token_ids.tolist()
    # request 0: row 1 follows draft 3, so (3, 5) bans 5 there; request 1: 4 is its best
    # allowed token, banned at row 4, which follows draft 2 ((2, 4))
    assert got == [5, 4, 5, 4, 3]
    for r, d in enumerate(drafts):
        for j in range(len(d) + 1):
            one = dataclasses.replace(
                make_metadata([0.0], outputs=([*outputs[r], *d[:j]],)), bad_words_token_ids={0: md.bad_words_token_ids[r]},
                allowed_token_ids_rows=torch.tensor([0]) if r == 1 else None, allowed_token_ids_mask=mask if r == 1 else None,
            )  # fmt: skip
            row = [0, 3][r] + j
            assert Sampler()(logits[:1], one).sampled_token_ids.tolist() == [got[row]], (r, j)


def test_sampler_runs_from_metadata_alone():
    """No InputBatch: row 0 greedy, row 1 random but top-k 1, row 2 random among its top 2."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.5], [2.0, 0.0, 1.0, 1.9], [0.0, 0.0, 5.0, 5.0]])
    outputs = ([], [], [])
    md = make_metadata([0.0, 1.0, 1.0], top_k=[0, 1, 2], seeds={2: 0}, outputs=outputs)
    seen = []
    for _ in range(40):
        tokens = Sampler()(logits, md).sampled_token_ids.tolist()
        assert tokens[:2] == [1, 0]
        seen.append(tokens[2])
        outputs[2].append(tokens[2])  # the next draw is keyed by the next position
    assert set(seen) == {2, 3}
    outputs[2].clear()
    assert [Sampler()(logits, md).sampled_token_ids[2].item() for _ in range(3)] == [seen[0]] * 3  # same position, same draw


# -- random sampling on the CPU: -log(U) instead of exponential_ ----------------------

CHI2_P = [0.5, 0.25, 0.15, 0.07, 0.03, 0.0]
# Chi-square bound for the 5 tokens with p > 0 (4 degrees of freedom): a correct sampler
# exceeds 30 with probability about 5e-6, and the seeds below are fixed, so this never flakes.
CHI2_BOUND = 30.0


def chi_square(tokens: torch.Tensor, probs: list[float]) -> float:
    counts = torch.bincount(tokens, minlength=len(probs)).tolist()
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def test_cpu_random_sample_frequencies_match_the_probabilities():
    torch.manual_seed(0)
    probs = torch.tensor([CHI2_P]).repeat(20000, 1)
    tokens = random_sample(probs, {})
    assert (tokens == len(CHI2_P) - 1).sum().item() == 0  # probability 0 is never drawn
    assert chi_square(tokens, CHI2_P) < CHI2_BOUND
    # The bound has teeth: the same uniforms raced without the log (q ~ U(0, 1), not Exp(1)) fail it.
    torch.manual_seed(0)
    wrong = probs.div(torch.rand_like(probs)).argmax(dim=-1)
    assert chi_square(wrong, CHI2_P) > 10 * CHI2_BOUND


def test_cpu_seeded_row_frequencies_match_the_probabilities():
    probs = torch.tensor([CHI2_P, [1.0, 0, 0, 0, 0, 0]])  # row 1 unseeded, to share the call
    tokens = torch.stack([random_sample(probs, {0: draw_key(1, position)})[0] for position in range(4000)])
    assert chi_square(tokens, CHI2_P) < CHI2_BOUND


def test_cpu_random_sample_is_the_race_on_minus_log_uniforms():
    """The CPU draw of a keyed row, spelled out: U from a generator seeded with the row's key,
    token = argmax(p / -log U)."""
    probs = torch.randn(3, 20, generator=torch.Generator().manual_seed(2)).softmax(dim=-1)
    got = [random_sample(probs, {1: seed})[1].item() for seed in range(20)]
    want = []
    for seed in range(20):
        u = torch.rand(20, generator=torch.Generator().manual_seed(seed))
        want.append(probs[1].div(u.log().neg()).argmax().item())
    assert got == want
    assert len(set(got)) > 1


def first_zero_uniform(seed: int) -> int:
    """Where the CPU stream of ``seed`` first gives U == 0 (probability 2**-24 per draw)."""
    generator, offset = torch.Generator().manual_seed(seed), 0
    while offset < 1 << 28:
        zeros = (torch.rand(1 << 20, generator=generator) == 0).nonzero()
        if len(zeros):
            return offset + zeros[0].item()
        offset += 1 << 20
    raise AssertionError(f"no U == 0 in the first 2**28 draws of seed {seed}")


def test_cpu_random_sample_a_zero_uniform_never_picks_a_masked_token():
    """U == 0 would make q = -log(U) infinite and the score p / q of a surviving token 0,
    the score of a masked one: the sampler draws U from [tiny, 1) instead."""
    position = first_zero_uniform(12)  # 411302 with torch 2.x's Mersenne Twister
    row = torch.zeros(1, position + 1)
    row[0, position] = 1.0  # one survivor (top-k 1, say), whose U is the zero: the row's key is 12
    assert random_sample(row, {0: 12}).item() == position


def test_cpu_seeded_row_stream_ignores_the_rest_of_the_batch():
    def stream(num_rows: int, row: int, global_seed: int) -> list[int]:
        torch.manual_seed(global_seed)  # the unseeded rows' draws must not matter
        probs = torch.full((num_rows, 50), 1 / 50)
        return [random_sample(probs, {row: draw_key(9, position)})[row].item() for position in range(8)]

    alone = stream(1, 0, 0)
    assert alone == stream(5, 3, 1) == stream(3, 0, 2)
    assert len(set(alone)) > 1


def test_greedy_rows_are_untouched_by_random_sampling():
    batch = make_batch()
    batch.add_request("g1", SamplingParams(temperature=0), None, [])
    batch.add_request("r", SamplingParams(temperature=1.0), None, [])
    batch.add_request("g2", SamplingParams(temperature=0), None, [])
    batch.refresh()
    logits = torch.zeros(3, V)
    logits[0, 4] = 1e-3  # a near-flat row: any randomness would show
    logits[2, 9] = 1e-3
    random_tokens = set()
    for _ in range(30):
        tokens = Sampler()(logits, batch.make_sampling_metadata()).sampled_token_ids.tolist()
        assert (tokens[0], tokens[2]) == (4, 9)
        random_tokens.add(tokens[1])
    assert len(random_tokens) > 1
    # An all-greedy batch draws no random numbers at all.
    greedy = make_batch()
    greedy.add_request("g", SamplingParams(temperature=0), None, [])
    greedy.refresh()
    before = torch.get_rng_state()
    assert Sampler()(logits[:1], greedy.make_sampling_metadata()).sampled_token_ids.tolist() == [4]
    assert torch.equal(before, torch.get_rng_state())


# -- penalties, allowed token ids, bad words ---------------------------------------------


def sample_once(batch: InputBatch, logits: torch.Tensor) -> list[int]:
    batch.refresh()
    return Sampler()(logits, batch.make_sampling_metadata()).sampled_token_ids.tolist()


def test_penalties_apply_after_the_non_argmax_invariant_processors_on_greedy_and_random_rows():
    """Token 1 is in the prompt and biased by +3: bias first (1 + 3 = 4), then repetition
    2 (4 / 2 = 2), so token 2 (3.0) wins. Penalty first would give 1 / 2 + 3 = 3.5, and no
    penalty 4: token 1 either way."""
    batch = make_batch()
    params = dict(logit_bias={1: 3.0}, repetition_penalty=2.0)
    batch.add_request("g", SamplingParams(temperature=0, **params), [1], [])
    batch.add_request("r", SamplingParams(temperature=1.0, top_k=1, **params), [1], [])
    batch.add_request("plain", SamplingParams(temperature=0, logit_bias={1: 3.0}), [1], [])
    logits = torch.zeros(3, V)
    logits[:, 1], logits[:, 2] = 1.0, 3.0
    assert sample_once(batch, logits) == [2, 2, 1]


def test_frequency_and_presence_penalties_count_the_output_only():
    """Output [4, 4]: token 4 loses 2 * 1.0 + 0.5 (4.0 -> 1.5); token 3, only in the prompt,
    keeps its 2.0 and beats token 5 (1.9)."""
    batch = make_batch()
    batch.add_request("a", SamplingParams(temperature=0, frequency_penalty=1.0, presence_penalty=0.5), [3], [4, 4])
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 4], logits[0, 5] = 2.0, 4.0, 1.9
    assert sample_once(batch, logits) == [3]


def test_allowed_token_ids_restrict_greedy_and_random_rows():
    batch = make_batch()
    batch.add_request("g", SamplingParams(temperature=0, allowed_token_ids=(3, 8)), [0], [])
    drawn_out = []
    batch.add_request("r", SamplingParams(temperature=1.0, allowed_token_ids=(3, 8), seed=5), [0], drawn_out)
    batch.add_request("free", SamplingParams(temperature=0), [0], [])
    logits = torch.zeros(3, V)
    logits[:, 0], logits[:, 8] = 9.0, 0.5
    for _ in range(40):
        greedy, drawn, free = sample_once(batch, logits)
        assert (greedy, free) == (8, 0)
        drawn_out.append(drawn)
    assert set(drawn_out) == {3, 8}


def test_bad_words_ban_the_last_token_once_the_output_ends_with_the_rest():
    """Bad words (2,) and (5, 6): 2 is always banned, 6 only right after a 5."""
    batch = make_batch()
    out = [5]
    batch.add_request("a", SamplingParams(temperature=0, bad_words=("x", "y")), [6], out, bad_words_token_ids=[[2], [5, 6]])
    logits = torch.zeros(1, V)
    logits[0, 2], logits[0, 6], logits[0, 7] = 9.0, 8.0, 7.0
    assert sample_once(batch, logits) == [7]
    out.append(1)
    assert sample_once(batch, logits) == [6]


@pytest.mark.seed("001:13")
def test_thinking_budget_forcing_comes_after_the_penalties():
    """The forced end token 2 is in the prompt; a repetition penalty of 1e30 applied after
    the forcing would bring its 1e9 down to 1e-21, below token 5's 8.0."""
    batch = make_batch(ReasoningConfig((1,), (2, 3)))
    batch.add_request("g", SamplingParams(temperature=0, thinking_token_budget=0, repetition_penalty=1e30), [2, 1], [])
    logits = torch.zeros(1, V)
    logits[0, 5] = 8.0
    assert sample_once(batch, logits) == [2]
