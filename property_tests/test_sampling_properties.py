"""Hypothesis properties of the sampling modules (seed 001 ch. 10, 13)."""

import torch
import pytest
from hypothesis import given, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tinyvllm.config import EngineConfig, ReasoningConfig, SchedulerConfig
from tinyvllm.sample.batch_update import BatchUpdate, MoveDirectionality
from tinyvllm.sample.logits_processors import LogitBiasLogitsProcessor, MinPLogitsProcessor, MinTokensLogitsProcessor
from tinyvllm.sample.penalties import apply_penalties
from tinyvllm.sample.sampler import Sampler
from tinyvllm.sample.thinking_budget import ThinkingBudgetStateHolder
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.input_batch import InputBatch

CPU = torch.device("cpu")
V = 16
MAX = 6
CONFIG = EngineConfig(scheduler_config=SchedulerConfig(max_num_seqs=MAX))
finite = st.floats(-20, 20, allow_nan=False, width=32)
logit_rows = st.lists(st.lists(finite, min_size=V, max_size=V), min_size=1, max_size=MAX)


def added_update(params_list, outputs=None):
    outputs = outputs or [[] for _ in params_list]
    return BatchUpdate(len(params_list), [], [(i, p, None, o) for i, (p, o) in enumerate(zip(params_list, outputs))], [])


@pytest.mark.seed("001:9", "001:10")
@given(rows=logit_rows, data=st.data())
def test_min_p_never_changes_the_argmax(rows, data):
    logits = torch.tensor(rows)
    min_ps = data.draw(st.lists(st.floats(0, 1), min_size=len(rows), max_size=len(rows)))
    proc = MinPLogitsProcessor(CONFIG, CPU, False)
    proc.update_state(added_update([SamplingParams(min_p=m) for m in min_ps]))
    out = proc.apply(logits.clone())
    best = logits.argmax(-1)
    assert torch.equal(out.gather(1, best[:, None]), logits.gather(1, best[:, None]))
    assert torch.equal(out.max(-1).values, logits.max(-1).values)


@pytest.mark.seed("001:10")
@given(rows=logit_rows, data=st.data())
def test_logit_bias_changes_exactly_the_biased_entries_by_the_bias(rows, data):
    logits = torch.tensor(rows)
    bias_st = st.one_of(st.none(), st.dictionaries(st.integers(0, V - 1), st.floats(-5, 5, width=32), max_size=4))
    biases = data.draw(st.lists(bias_st, min_size=len(rows), max_size=len(rows)))
    proc = LogitBiasLogitsProcessor(CONFIG, CPU, False)
    proc.update_state(added_update([SamplingParams(logit_bias=b) for b in biases]))
    diff = proc.apply(logits.clone()) - logits
    expected = torch.zeros_like(logits)
    for row, bias in enumerate(biases):
        for tok, value in (bias or {}).items():
            expected[row, tok] = value
    assert torch.allclose(diff, expected, atol=1e-5)


@pytest.mark.seed("001:10")
@given(data=st.data())
def test_min_tokens_masks_stop_tokens_exactly_while_output_is_short(data):
    n = data.draw(st.integers(1, MAX))
    params = [
        SamplingParams(min_tokens=data.draw(st.integers(0, 4)), stop_token_ids=data.draw(st.lists(st.integers(0, V - 1), max_size=3)))
        for _ in range(n)
    ]
    outputs = [[] for _ in range(n)]
    proc = MinTokensLogitsProcessor(CONFIG, CPU, False)
    proc.update_state(added_update(params, outputs))
    for _ in range(6):
        out = proc.apply(torch.zeros(n, V))
        for row, (p, o) in enumerate(zip(params, outputs)):
            masked = set(torch.isinf(out[row]).nonzero().view(-1).tolist())
            assert masked == (set(p.stop_token_ids) if len(o) < p.min_tokens else set()), (row, p, o)
        for row in range(n):
            if data.draw(st.booleans()):
                outputs[row].append(V - 1)
        proc.update_state(None)


class MinPBatchMachine(RuleBasedStateMachine):
    """Random add / remove / condense / swap through the InputBatch; MinP's count follows."""

    def __init__(self):
        super().__init__()
        self.proc = MinPLogitsProcessor(CONFIG, CPU, False)
        from tinyvllm.sample.logits_processors import LogitsProcessors

        self.batch = InputBatch(MAX, CPU, LogitsProcessors([self.proc]))
        self.live: dict[str, float] = {}
        self.next_id = 0
        self.added_this_step = False
        self.pending = False  # changes not yet handed over by refresh()

    @precondition(lambda self: len(self.live) < MAX)
    @rule(min_p=st.sampled_from([0.0, 0.0, 0.1, 0.5, 1.0]))
    def add(self, min_p):
        req_id = f"r{self.next_id}"
        self.next_id += 1
        self.batch.add_request(req_id, SamplingParams(min_p=min_p), None, [])
        self.live[req_id] = min_p
        self.added_this_step = self.pending = True

    @precondition(lambda self: self.live and not self.added_this_step)
    @rule(data=st.data())
    def remove(self, data):
        req_id = data.draw(st.sampled_from(sorted(self.live)))
        self.batch.remove_request(req_id)
        del self.live[req_id]
        self.pending = True

    @rule(data=st.data(), swap=st.booleans())
    def step(self, data, swap):
        self.batch.condense()
        if swap and self.batch.num_reqs >= 2:
            i1, i2 = data.draw(st.lists(st.integers(0, self.batch.num_reqs - 1), min_size=2, max_size=2, unique=True))
            self.batch.swap_states(i1, i2)
        self.batch.refresh()
        self.added_this_step = self.pending = False
        rows = [self.live[r] for r in self.batch.req_ids]
        assert self.proc.min_p_cpu[: len(rows)].tolist() == torch.tensor(rows, dtype=torch.float32).tolist()

    @invariant()
    def count_matches_rows(self):
        self.proc.check_invariants()
        if not self.pending:
            assert self.proc.min_p_count == sum(1 for m in self.live.values() if m)


TestMinPCountMatchesRows = pytest.mark.seed("001:R2")(MinPBatchMachine.TestCase)


@given(seed=st.integers(0, 2**31 - 1), others=st.integers(0, 4), temperature=st.sampled_from([0.5, 1.0, 2.0]))
def test_seeded_sampling_is_reproducible(seed, others, temperature):
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(7))

    def run(n_others):
        batch = InputBatch(MAX, CPU)
        for i in range(n_others):
            batch.add_request(f"o{i}", SamplingParams(temperature=1.0), None, [])
        batch.add_request("me", SamplingParams(temperature=temperature, top_k=8, seed=seed), None, [])
        batch.refresh()
        row = batch.req_id_to_index["me"]
        full = logits.repeat(batch.num_reqs, 1)
        return [Sampler()(full, batch.make_sampling_metadata()).sampled_token_ids[row].item() for _ in range(5)]

    assert run(0) == run(others)


@pytest.mark.seed("001:13")
@given(
    budget=st.integers(0, 6),
    end_len=st.integers(1, 3),
    prefix=st.lists(st.integers(8, V - 1), max_size=3),
    tail=st.lists(st.integers(8, V - 1), min_size=12, max_size=12),
    temperature=st.sampled_from([0.0, 1.0]),
)
def test_thinking_budget_thinks_exactly_budget_tokens_then_forces_end(budget, end_len, prefix, tail, temperature):
    start, end = (4,), tuple(range(5, 5 + end_len))
    holder = ThinkingBudgetStateHolder(ReasoningConfig(start, end), MAX, 0, CPU, False)
    batch = InputBatch(MAX, CPU, None, holder)
    out: list[int] = []
    batch.add_request("r", SamplingParams(temperature=temperature, thinking_token_budget=budget, seed=1), [0], out)
    wanted = list(prefix) + list(start) + list(tail)  # what the fake model would say
    for step in range(len(wanted)):
        batch.refresh()
        logits = torch.full((1, V), -30.0)
        logits[0, wanted[len(out)] if len(out) < len(wanted) else 8] = 30.0
        out.append(Sampler()(logits, batch.make_sampling_metadata()).sampled_token_ids.item())
        holder.check_invariants()
    k = len(prefix) + len(start)
    expected = list(prefix) + list(start) + list(tail[:budget]) + list(end)
    expected += list(tail[budget + len(end):])  # the fake model indexes by position
    assert out[: len(expected)] == expected[: len(out)]
    assert out[k : k + budget] == tail[:budget]
    assert out[k + budget : k + budget + end_len] == list(end)


@pytest.mark.seed("001:R2")
@given(data=st.data())
def test_min_p_count_matches_rows_under_raw_updates_with_moves_onto_occupied_rows(data):
    """Hand-built BatchUpdates, including UNIDIRECTIONAL moves onto occupied rows (appendix R2)."""
    proc = MinPLogitsProcessor(CONFIG, CPU, False)
    model = [0.0] * MAX  # the reference: row -> min_p
    values = st.sampled_from([0.0, 0.1, 0.5])
    rows = st.integers(0, MAX - 1)
    for _ in range(data.draw(st.integers(1, 6))):
        removed = data.draw(st.lists(rows, max_size=2, unique=True))
        added = data.draw(st.lists(st.tuples(rows, values), max_size=3, unique_by=lambda t: t[0]))
        moved = data.draw(st.lists(st.tuples(rows, rows, st.booleans()).filter(lambda t: t[0] != t[1]), max_size=3))
        for r in removed:
            model[r] = 0.0
        for r, v in added:
            model[r] = v
        for a, b, swap in moved:
            model[a], model[b] = (model[b] if swap else 0.0), model[a]
        proc.update_state(BatchUpdate(MAX, removed, [(r, SamplingParams(min_p=v), None, []) for r, v in added],
                                      [(a, b, MoveDirectionality.SWAP if swap else MoveDirectionality.UNIDIRECTIONAL) for a, b, swap in moved]))
        assert proc.min_p_cpu.tolist() == torch.tensor(model, dtype=torch.float32).tolist()
        assert proc.min_p_count == sum(1 for v in model if v)
        proc.check_invariants()


# -- penalties and allowed token ids (issue 25) ------------------------------------------

token_lists = st.lists(st.integers(0, V - 1), max_size=8)


@given(rows=logit_rows, data=st.data())
def test_neutral_penalties_change_nothing(rows, data):
    """Presence 0, frequency 0 and repetition 1 leave a row exactly as it was, whatever
    its prompt and output; the other rows of the batch keep their own penalties."""
    logits = torch.tensor(rows)  # [R, V]
    n = len(rows)
    prompt_mask = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=V, max_size=V), min_size=n, max_size=n)))
    counts = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 5), min_size=V, max_size=V), min_size=n, max_size=n)), dtype=torch.int32)
    neutral = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    penalty = st.floats(-2, 2, width=32)
    presence = torch.tensor([0.0 if z else data.draw(penalty) for z in neutral])
    frequency = torch.tensor([0.0 if z else data.draw(penalty) for z in neutral])
    repetition = torch.tensor([1.0 if z else data.draw(st.floats(0.125, 3, width=32)) for z in neutral])
    out = apply_penalties(logits, prompt_mask, counts, presence, frequency, repetition)
    for row, z in enumerate(neutral):
        if z:
            assert torch.equal(out[row], logits[row]), row


def per_row_penalties(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """vLLM's formula for one row, token by token (the reference)."""
    logits = logits.clone()
    rep = torch.tensor(params.repetition_penalty, dtype=torch.float32)
    for tok in set(prompt) | set(output):
        logits[tok] = logits[tok] / rep if logits[tok] > 0 else logits[tok] * rep
    for tok in set(output):
        logits[tok] -= torch.tensor(params.frequency_penalty, dtype=torch.float32) * output.count(tok)
        logits[tok] -= params.presence_penalty
    return logits


penalty_params = st.builds(
    SamplingParams,
    presence_penalty=st.sampled_from([0.0, 0.0, 0.5, -1.5, 2.0]),
    frequency_penalty=st.sampled_from([0.0, 0.0, 0.25, -0.7, 2.0]),
    repetition_penalty=st.sampled_from([1.0, 1.0, 1.2, 0.6, 3.0]),
)


@given(rows=logit_rows, data=st.data())
def test_batched_penalties_equal_a_per_row_loop(rows, data):
    """The persistent batch's counts and one batched formula give, for every row, what
    the formula gives applied token by token to that row alone; output tokens arrive
    over a few steps, some rows getting none (partial prefills)."""
    logits = torch.tensor(rows)  # [R, V]
    batch = InputBatch(MAX, CPU, vocab_size=V)
    requests = []
    for row in range(len(rows)):
        params, prompt, output = data.draw(penalty_params), data.draw(token_lists.filter(bool)), data.draw(token_lists)
        batch.add_request(f"r{row}", params, prompt, output)
        requests.append((params, prompt, output))
    for _ in range(data.draw(st.integers(0, 3))):
        batch.refresh()
        for _, _, output in requests:
            output.extend(data.draw(st.lists(st.integers(0, V - 1), max_size=1)))
    batch.refresh()
    batch.check_invariants()
    md = batch.make_sampling_metadata()
    out = logits.clone() if md.penalties is None else md.penalties.apply(logits.clone())
    for row, (params, prompt, output) in enumerate(requests):
        expected = per_row_penalties(logits[row], params, prompt, output)
        assert torch.allclose(out[row], expected, rtol=1e-6, atol=1e-6), (row, params, prompt, output)


@given(
    rows=logit_rows,
    seed=st.integers(0, 2**31 - 1),
    temperatures=st.lists(st.sampled_from([0.0, 0.7, 1.0]), min_size=MAX, max_size=MAX),
)
def test_allowed_token_ids_of_the_whole_vocabulary_change_nothing(rows, seed, temperatures):
    """Every row allowed every token samples exactly what it samples unrestricted."""
    logits = torch.tensor(rows)

    def run(allowed):
        batch = InputBatch(MAX, CPU, vocab_size=V)
        for row in range(len(rows)):
            params = SamplingParams(temperature=temperatures[row], seed=seed + row, allowed_token_ids=allowed)
            batch.add_request(f"r{row}", params, [0], [])
        batch.refresh()
        return [Sampler()(logits, batch.make_sampling_metadata()).sampled_token_ids.tolist() for _ in range(3)]

    assert run(tuple(range(V))) == run(None)


@given(
    rows=st.integers(1, 6),
    vocab=st.integers(2, 40),
    k=st.integers(0, 8),
    seed=st.integers(0, 2**31),
    scale=st.sampled_from([0.1, 1.0, 30.0]),
)
def test_logprobs_are_at_most_zero_sorted_and_ranked(rows, vocab, k, seed, scale):
    """``sample/logprobs.py``: every logprob <= 0, the top k in descending order, and the
    chosen token's rank counts the tokens at least as likely as it."""
    from tinyvllm.sample.logprobs import compute_logprobs, gather_logprobs

    k = min(k, vocab)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * scale  # [R, V]
    chosen = torch.randint(0, vocab, (rows,), generator=gen)  # [R]
    logprobs = compute_logprobs(logits)
    out = gather_logprobs(logprobs, chosen, k)
    assert (out.logprobs <= 0).all()
    assert torch.allclose(logprobs.exp().sum(dim=-1), torch.ones(rows), atol=1e-5)
    top = out.logprobs[:, 1:]
    assert (top[:, :-1] >= top[:, 1:]).all()  # descending
    assert torch.equal(out.token_ids[:, 0], chosen)
    for r in range(rows):
        assert out.ranks[r] == int((logprobs[r] >= logprobs[r, chosen[r]]).sum()) >= 1
        assert torch.allclose(top[r], logprobs[r].sort(descending=True).values[:k])
