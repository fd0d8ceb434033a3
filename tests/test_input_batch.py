"""The persistent batch (appendix U2) and the stream test: many requests with random
parameters pass through add / remove / condense / swap, and every row's processed logits
always equal a reference computed from that request's own parameters."""

import random

import pytest
import torch

from tinyvllm.config import EngineConfig, SchedulerConfig
from tinyvllm.sample.batch_update import MoveDirectionality
from tinyvllm.sample.logits_processors import MinPLogitsProcessor, build_logitsprocs
from tinyvllm.sample.sampler import Sampler
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.input_batch import InputBatch

CPU = torch.device("cpu")
UNI, SWAP = MoveDirectionality.UNIDIRECTIONAL, MoveDirectionality.SWAP
MAX = 6
V = 12


def make_batch(max_num_reqs=MAX, vocab_size=V):
    config = EngineConfig(scheduler_config=SchedulerConfig(max_num_seqs=max_num_reqs))
    return InputBatch(max_num_reqs, CPU, build_logitsprocs(config, CPU, False, False), vocab_size=vocab_size)


@pytest.mark.seed("001:U2")
def test_add_appends_then_fills_lowest_hole_u2():
    batch = make_batch()
    for i in range(5):
        assert batch.add_request(f"r{i}", SamplingParams(), None, []) == i
    batch.refresh()
    for req in ("r4", "r1", "r3"):  # holes 4, 1, 3
        batch.remove_request(req)
    assert batch.add_request("a", SamplingParams(), None, []) == 1  # the lowest hole
    assert batch.add_request("b", SamplingParams(), None, []) == 3
    batch.condense()  # hole 4 is the last row: nothing to move
    update = batch.refresh()
    assert update.batch_size == 4 and list(update.removed) == [4] and update.moved == []
    assert [a[0] for a in update.added] == [1, 3]
    assert batch.req_ids == ["r0", "a", "r2", "b"]
    batch.check_invariants()


@pytest.mark.seed("001:U2")
def test_condense_moves_highest_rows_into_lowest_holes():
    batch = make_batch()
    for i in range(6):
        batch.add_request(f"r{i}", SamplingParams(temperature=0.5 + i, seed=i if i % 2 else None), None, [])
    batch.refresh()
    batch.remove_request("r0")
    batch.remove_request("r2")
    batch.remove_request("r5")
    batch.condense()
    assert batch.req_ids == ["r4", "r1", "r3"]
    update = batch.refresh()
    assert list(update.removed) == [5, 2, 0]
    assert update.moved == [(4, 0, UNI), (3, 2, UNI)]
    assert batch.temperature[:3].tolist() == [4.5, 1.5, 3.5]
    assert set(batch.seeds) == {1, 2}  # r1 stays at 1, r3 moved to 2
    batch.check_invariants()


@pytest.mark.seed("001:7")
def test_swap_states_records_swap_and_moves_tensors():
    batch = make_batch()
    batch.add_request("a", SamplingParams(top_k=3, seed=1), None, [])
    batch.add_request("b", SamplingParams(top_p=0.5), None, [])
    batch.refresh()
    batch.swap_states(0, 1)
    update = batch.refresh()
    assert update.moved == [(0, 1, SWAP)] and batch.req_id_to_index == {"b": 0, "a": 1}
    assert batch.top_k[:2].tolist() == [0, 3] and set(batch.seeds) == {1}
    batch.check_invariants()
    with pytest.raises(ValueError, match="row 5"):
        batch.swap_states(0, 5)


def test_refresh_with_holes_raises_and_none_when_unchanged():
    batch = make_batch()
    batch.add_request("a", SamplingParams(), None, [])
    batch.add_request("b", SamplingParams(), None, [])
    batch.refresh()
    assert batch.refresh() is None
    batch.remove_request("a")
    with pytest.raises(RuntimeError, match="condense"):
        batch.refresh()


def test_add_errors():
    batch = make_batch(max_num_reqs=1)
    batch.add_request("a", SamplingParams(), None, [])
    with pytest.raises(ValueError, match="'a' is already"):
        batch.add_request("a", SamplingParams(), None, [])
    with pytest.raises(ValueError, match="full"):
        batch.add_request("b", SamplingParams(), None, [])
    assert batch.remove_request("zzz") is None


def test_eos_joins_stop_tokens_for_min_tokens_unless_ignore_eos():
    batch = make_batch()
    batch.add_request("a", SamplingParams(min_tokens=2, stop_token_ids=(4,)), None, [], eos_token_id=9)
    batch.add_request("b", SamplingParams(min_tokens=2, ignore_eos=True), None, [], eos_token_id=9)
    batch.refresh()
    logits = torch.zeros(2, V)
    for proc in batch.logitsprocs.non_argmax_invariant:
        logits = proc.apply(logits)
    assert torch.isinf(logits[0]).nonzero().view(-1).tolist() == [4, 9]
    assert not torch.isinf(logits[1]).any()


# ---- the stream test -------------------------------------------------------------------

def row_logits(req_id: str, step: int) -> torch.Tensor:
    """Deterministic fake logits of one request at one step ``[V]``."""
    g = torch.Generator().manual_seed(hash((req_id, step)) % (2**31))
    return torch.randn(V, generator=g) * 3


def reference(
    params: SamplingParams, prompt: list[int], output: list[int], bad_words: tuple, logits: torch.Tensor
) -> torch.Tensor:
    """What the sampler's logits steps must do to one row, from the request's own
    parameters, token by token, in the sampler's order: the allowed tokens, bad words,
    MinTokens, LogitBias, the penalties, then MinP."""
    logits = logits.clone()
    if params.allowed_token_ids is not None:
        allowed = list(params.allowed_token_ids)
        kept = torch.full_like(logits, float("-inf"))
        kept[allowed] = logits[allowed]
        logits = kept
    for word in bad_words:
        prefix = list(word[:-1])
        if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
            logits[word[-1]] = float("-inf")
    if len(output) < params.min_tokens:
        for tok in params.stop_token_ids:
            logits[tok] = float("-inf")
    for tok, bias in (params.logit_bias or {}).items():
        logits[tok] += bias
    rep = torch.tensor(params.repetition_penalty, dtype=torch.float32)
    for tok in set(prompt) | set(output):
        logits[tok] = logits[tok] / rep if logits[tok] > 0 else logits[tok] * rep
    for tok in set(output):
        logits[tok] -= torch.tensor(params.frequency_penalty, dtype=torch.float32) * output.count(tok)
        logits[tok] -= params.presence_penalty
    if params.min_p:
        probs = logits.softmax(-1)
        logits[probs < probs.max() * torch.tensor(params.min_p, dtype=torch.float32)] = float("-inf")
    return logits


BAD_WORDS = [(), ((5,),), ((4, 6), (7,)), ((6, 6, 8),)]  # token ids; the words themselves do not matter here


def random_request(rng: random.Random) -> tuple[SamplingParams, list[int], tuple]:
    """Random params, a random prompt and random bad-word token ids."""
    bad_words = rng.choice(BAD_WORDS)
    params = SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.0]),
        top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([0, 5]),
        min_p=rng.choice([0.0, 0.0, 0.1, 0.3]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5, -1.0]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.3, -0.2]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        bad_words=tuple(f"w{i}" for i in range(len(bad_words))),
        allowed_token_ids=rng.choice([None, None, tuple(rng.sample(range(V), 6))]),
        logit_bias=rng.choice([None, {rng.randrange(V): rng.uniform(-3, 3), rng.randrange(V): 2.0}]),
        min_tokens=rng.choice([0, 0, 2, 4]),
        stop_token_ids=rng.choice([(), (1,), (2, 3)]),
        seed=rng.choice([None, rng.randrange(100)]),
    )
    return params, [rng.randrange(V) for _ in range(rng.randint(1, 4))], bad_words


@pytest.mark.seed("001:U2")
@pytest.mark.parametrize("seed", range(6))
def test_stream_rows_always_match_per_request_reference(seed):
    """Requests come, go, are preempted and come back with their outputs so far; rows are
    condensed and swapped. Every step, every row's logits after the sampler's logits
    steps equal the reference computed from that request alone."""
    rng = random.Random(seed)
    batch = make_batch()
    live: dict[str, tuple[SamplingParams, list[int], list[int], tuple]] = {}  # params, prompt, output, bad words
    preempted: dict[str, tuple[SamplingParams, list[int], list[int], tuple]] = {}
    next_id = 0
    for step in range(40):
        for req_id in rng.sample(sorted(live), k=rng.randint(0, len(live))):
            batch.remove_request(req_id)
            request = live.pop(req_id)
            if rng.random() < 0.3:
                preempted[req_id] = request  # it comes back later, with its outputs
        for req_id in rng.sample(sorted(preempted), k=min(len(preempted), rng.randint(0, MAX - len(live)))):
            params, prompt, output, bad = live[req_id] = preempted.pop(req_id)
            batch.add_request(req_id, params, prompt, output, bad_words_token_ids=bad)
        for _ in range(rng.randint(0, MAX - len(live))):
            req_id, (params, prompt, bad), output = f"q{next_id}", random_request(rng), []
            next_id += 1
            batch.add_request(req_id, params, prompt, output, bad_words_token_ids=bad)
            live[req_id] = (params, prompt, output, bad)
        batch.condense()
        if batch.num_reqs >= 2 and rng.random() < 0.5:
            i1, i2 = rng.sample(range(batch.num_reqs), 2)
            batch.swap_states(i1, i2)
        batch.refresh()
        batch.check_invariants()
        minp = next(p for p in batch.logitsprocs.argmax_invariant if isinstance(p, MinPLogitsProcessor))
        minp.check_invariants()
        assert minp.min_p_count == sum(1 for p, *_ in live.values() if p.min_p)
        logits = torch.stack([row_logits(r, step) for r in batch.req_ids]) if batch.req_ids else torch.zeros(0, V)
        processed = Sampler.apply_logits_processors(logits.clone(), batch.make_sampling_metadata())
        for proc in batch.logitsprocs.argmax_invariant:
            processed = proc.apply(processed)
        for row, req_id in enumerate(batch.req_ids):
            params, prompt, output, bad = live[req_id]
            expected = reference(params, prompt, output, bad, logits[row])
            assert torch.allclose(processed[row], expected, equal_nan=False), f"step {step} row {row} {req_id} {params}"
            if rng.random() < 0.8:  # else: a partial prefill, no token this step
                output.append(rng.randrange(4, V))


def test_sampling_metadata_is_rebuilt_only_when_the_batch_changed():
    """A decode step that adds, removes and moves nothing reuses last step's metadata."""
    batch = make_batch()
    batch.add_request("a", SamplingParams(temperature=0.7, seed=1), None, [])
    batch.add_request("b", SamplingParams(temperature=0, top_k=3), None, [])
    batch.refresh()
    first = batch.make_sampling_metadata()
    batch.refresh()  # a step with no change
    assert batch.make_sampling_metadata() is first
    batch.swap_states(0, 1)
    batch.refresh()
    swapped = batch.make_sampling_metadata()
    assert swapped is not first and swapped.temperature.tolist() == torch.tensor([0.0, 0.7]).tolist()
    assert list(swapped.seeds) == [1] and first.temperature.tolist() == torch.tensor([0.7, 0.0]).tolist()
    batch.remove_request("b")
    batch.condense()
    batch.refresh()
    one = batch.make_sampling_metadata()
    assert one.num_reqs == 1 and one.top_k is None and one.all_random
    batch.add_request("c", SamplingParams(temperature=0), None, [])
    batch.refresh()
    assert batch.make_sampling_metadata().temperature.tolist() == torch.tensor([0.7, 0.0]).tolist()
    batch.reset()
    assert batch.make_sampling_metadata().num_reqs == 0


# ---- penalties, allowed tokens and bad words: per-row state that follows the rows ------


def bincount(tokens: list[int]) -> list[int]:
    return torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=V).tolist()


def counts_of(batch: InputBatch, req_id: str) -> list[int]:
    return batch.penalties.output_counts_of(batch.req_id_to_index[req_id]).tolist()


def test_penalty_counts_follow_rows_through_add_remove_condense_swap_preemption_and_reset():
    batch = make_batch()
    out = {"a": [5], "plain": [], "b": [], "c": []}
    batch.add_request("a", SamplingParams(frequency_penalty=1.0), [0, 1, 1], out["a"])
    batch.add_request("plain", SamplingParams(), [2], out["plain"])
    batch.add_request("b", SamplingParams(repetition_penalty=1.3), [3], out["b"])
    batch.refresh()
    batch.check_invariants()
    assert set(batch.penalties.rows) == {0, 2}  # "plain" uses no penalty
    assert counts_of(batch, "a") == bincount([5]) and counts_of(batch, "b") == [0] * V
    for name in ("a", "plain", "b"):  # the runner appends each step's token
        out[name].append(7)
    batch.refresh()
    assert counts_of(batch, "a") == bincount([5, 7]) and counts_of(batch, "b") == bincount([7])
    batch.remove_request("a")
    batch.condense()  # "b" moves from row 2 into row 0
    batch.refresh()
    batch.check_invariants()
    assert batch.req_id_to_index["b"] == 0 and counts_of(batch, "b") == bincount([7])
    batch.swap_states(0, 1)
    batch.refresh()
    batch.check_invariants()
    assert set(batch.penalties.rows) == {1} and counts_of(batch, "b") == bincount([7])
    batch.refresh()  # a step in which "b" sampled nothing (a partial prefill)
    assert counts_of(batch, "b") == bincount([7])
    out["b"].append(9)
    batch.remove_request("b")  # preempted: it leaves the batch ...
    batch.condense()
    batch.refresh()
    batch.add_request("c", SamplingParams(presence_penalty=0.5), [4], out["c"])  # takes b's slot
    batch.refresh()
    assert counts_of(batch, "c") == [0] * V
    batch.add_request("b", SamplingParams(repetition_penalty=1.3), [3], out["b"])  # ... and comes back
    batch.refresh()
    batch.check_invariants()
    assert counts_of(batch, "b") == bincount([7, 9])  # counted again from its whole output
    assert batch.penalties.prompt_mask_of(batch.req_id_to_index["b"]).nonzero().view(-1).tolist() == [3]
    batch.reset()  # after a failed step
    batch.check_invariants()
    assert batch.penalties.rows == {}


def test_check_invariants_catches_penalty_counts_out_of_step():
    batch = make_batch()
    batch.add_request("a", SamplingParams(presence_penalty=1.0), [0], [3])
    batch.refresh()
    batch.check_invariants()
    batch.penalties.output_counts[batch.penalties.rows[0].slot, 3] = 0
    with pytest.raises(AssertionError, match="row 0"):
        batch.check_invariants()


def test_a_batch_without_penalties_or_masks_allocates_and_hands_over_nothing():
    batch = make_batch()
    batch.add_request("a", SamplingParams(temperature=0.5, top_k=3, logit_bias={1: 1.0}), [0], [])
    batch.refresh()
    md = batch.make_sampling_metadata()
    assert md.penalties is None and md.no_penalties
    assert md.allowed_token_ids_mask is None and md.allowed_token_ids_rows is None
    assert dict(md.bad_words_token_ids) == {}
    assert batch.penalties.capacity == 0 and batch.penalties.output_counts.numel() == 0


def test_allowed_token_ids_mask_has_a_row_for_each_request_that_restricts():
    batch = make_batch()
    batch.add_request("all", SamplingParams(), [0], [])
    batch.add_request("some", SamplingParams(allowed_token_ids=(2, 5)), [0], [])
    batch.add_request("one", SamplingParams(allowed_token_ids=(7,)), [0], [])
    batch.refresh()
    md = batch.make_sampling_metadata()
    assert md.allowed_token_ids_rows.tolist() == [1, 2]
    assert [row.nonzero().view(-1).tolist() for row in ~md.allowed_token_ids_mask] == [[2, 5], [7]]
    batch.remove_request("all")
    batch.condense()  # "one" moves from row 2 to row 0
    batch.swap_states(0, 1)
    batch.refresh()
    md = batch.make_sampling_metadata()
    assert batch.req_ids == ["some", "one"]
    assert md.allowed_token_ids_rows.tolist() == [0, 1]
    assert [row.nonzero().view(-1).tolist() for row in ~md.allowed_token_ids_mask] == [[2, 5], [7]]


def test_bad_words_token_ids_follow_their_rows_and_must_match_the_params():
    batch = make_batch()
    out = [4]
    batch.add_request("plain", SamplingParams(), [0], [])
    batch.add_request("bad", SamplingParams(bad_words=("x",)), [0], out, bad_words_token_ids=[[5], [4, 6]])
    batch.refresh()
    batch.check_invariants()
    md = batch.make_sampling_metadata()
    assert dict(md.bad_words_token_ids) == {1: ((5,), (4, 6))} and md.output_token_ids[1] is out
    batch.remove_request("plain")
    batch.condense()
    batch.refresh()
    batch.check_invariants()
    assert dict(batch.make_sampling_metadata().bad_words_token_ids) == {0: ((5,), (4, 6))}
    with pytest.raises(ValueError, match="bad_words"):
        batch.add_request("no_ids", SamplingParams(bad_words=("x",)), [0], [])
    with pytest.raises(ValueError, match="bad_words"):
        batch.add_request("ids_only", SamplingParams(), [0], [], bad_words_token_ids=[[5]])
    assert batch.num_reqs == 1  # nothing was added


def test_penalties_and_allowed_token_ids_need_the_vocabulary_size():
    batch = make_batch(vocab_size=None)
    for params in (SamplingParams(presence_penalty=1.0), SamplingParams(allowed_token_ids=(1,))):
        with pytest.raises(ValueError, match="vocab_size"):
            batch.add_request("a", params, [0], [])
    assert batch.num_reqs == 0
    batch.add_request("plain", SamplingParams(), [0], [])  # a plain request needs no vocabulary


def test_a_reused_metadata_record_must_agree_with_the_rows_host_values():
    """The record handed out again for an unchanged batch carries host copies (all_greedy,
    the top-k/top-p plan); check_invariants compares them with the rows' host values, so a
    row edited behind the batch's back (a bug) shows, instead of sampling with stale rows."""
    batch = make_batch()
    batch.add_request("greedy", SamplingParams(temperature=0), None, [])
    batch.add_request("nucleus", SamplingParams(temperature=0.8, top_p=0.9), None, [])
    batch.refresh()
    md = batch.make_sampling_metadata()
    assert (md.all_greedy, md.all_random) == (False, False) and md.top_k_top_p_plan.top_p_rows == (1,)
    batch.refresh()  # no change: the same record is handed out again
    assert batch.make_sampling_metadata() is md
    batch.check_invariants()
    batch.top_p[1] = 1.0  # behind the batch's back
    with pytest.raises(AssertionError, match="cached plan"):
        batch._check_cached_metadata()
    batch.top_p[1] = 0.9
    batch.temperature[0] = 0.5  # now no row is greedy: all_random would be True
    with pytest.raises(AssertionError, match="cached all_greedy"):
        batch._check_cached_metadata()
