"""The persistent batch (appendix U2) and the stream test: many requests with random
parameters pass through add / remove / condense / swap, and every row's processed logits
always equal a reference computed from that request's own parameters."""

import random

import pytest
import torch

from tinyvllm.config import EngineConfig, SchedulerConfig
from tinyvllm.sample.batch_update import MoveDirectionality
from tinyvllm.sample.logits_processors import MinPLogitsProcessor, build_logitsprocs
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.input_batch import InputBatch

CPU = torch.device("cpu")
UNI, SWAP = MoveDirectionality.UNIDIRECTIONAL, MoveDirectionality.SWAP
MAX = 6
V = 12


def make_batch(max_num_reqs=MAX):
    config = EngineConfig(scheduler_config=SchedulerConfig(max_num_seqs=max_num_reqs))
    return InputBatch(max_num_reqs, CPU, build_logitsprocs(config, CPU, False, False))


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
    assert set(batch.generators) == {1, 2}  # r1 stays at 1, r3 moved to 2
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
    assert batch.top_k[:2].tolist() == [0, 3] and set(batch.generators) == {1}
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


def reference(params: SamplingParams, output: list[int], logits: torch.Tensor) -> torch.Tensor:
    """What the processors must do to one row, from the request's own parameters."""
    logits = logits.clone()
    if len(output) < params.min_tokens:
        for tok in params.stop_token_ids:
            logits[tok] = float("-inf")
    for tok, bias in (params.logit_bias or {}).items():
        logits[tok] += bias
    if params.min_p:
        probs = logits.softmax(-1)
        logits[probs < probs.max() * torch.tensor(params.min_p, dtype=torch.float32)] = float("-inf")
    return logits


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.0]),
        top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([0, 5]),
        min_p=rng.choice([0.0, 0.0, 0.1, 0.3]),
        logit_bias=rng.choice([None, {rng.randrange(V): rng.uniform(-3, 3), rng.randrange(V): 2.0}]),
        min_tokens=rng.choice([0, 0, 2, 4]),
        stop_token_ids=rng.choice([(), (1,), (2, 3)]),
        seed=rng.choice([None, rng.randrange(100)]),
    )


@pytest.mark.seed("001:U2")
@pytest.mark.parametrize("seed", range(6))
def test_stream_rows_always_match_per_request_reference(seed):
    rng = random.Random(seed)
    batch = make_batch()
    live: dict[str, tuple[SamplingParams, list[int]]] = {}
    next_id = 0
    for step in range(40):
        for req_id in rng.sample(sorted(live), k=rng.randint(0, len(live))):
            batch.remove_request(req_id)
            del live[req_id]
        for _ in range(rng.randint(0, MAX - len(live))):
            req_id, params, output = f"q{next_id}", random_params(rng), []
            next_id += 1
            batch.add_request(req_id, params, [0, 1], output)
            live[req_id] = (params, output)
        batch.condense()
        if batch.num_reqs >= 2 and rng.random() < 0.5:
            i1, i2 = rng.sample(range(batch.num_reqs), 2)
            batch.swap_states(i1, i2)
        batch.refresh()
        batch.check_invariants()
        minp = next(p for p in batch.logitsprocs.argmax_invariant if isinstance(p, MinPLogitsProcessor))
        minp.check_invariants()
        assert minp.min_p_count == sum(1 for p, _ in live.values() if p.min_p)
        logits = torch.stack([row_logits(r, step) for r in batch.req_ids]) if batch.req_ids else torch.zeros(0, V)
        processed = logits.clone()
        for proc in batch.logitsprocs.non_argmax_invariant:
            processed = proc.apply(processed)
        for proc in batch.logitsprocs.argmax_invariant:
            processed = proc.apply(processed)
        for row, req_id in enumerate(batch.req_ids):
            params, output = live[req_id]
            expected = reference(params, output, logits[row])
            assert torch.allclose(processed[row], expected, equal_nan=False), f"step {step} row {row} {req_id} {params}"
            output.append(rng.randrange(4, V))  # the step's token


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
    assert list(swapped.generators) == [1] and first.temperature.tolist() == torch.tensor([0.7, 0.0]).tolist()
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
