"""Hypothesis over the pooler's chunking (``worker/pooler.py``): however a batch of prompts is
cut into steps (chunked prefill, any number of rows a step, rows in any order, a prompt
restarted from position 0 as after a preemption), each prompt's vector equals pooling its
whole hidden states at once, the one-line oracle ``oracle`` below, and is made exactly once;
a classifier's label scores (a random ``score`` head, softmax or raw) and a ``token_embed``
request's every row likewise, or with a step tag only the rows of the positions holding it
(``pooling_params.py`` NOTE 6; prompts of tokens 0-2, tag 1).
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from tinyvllm.config import PoolerConfig
from tinyvllm.pooling_params import PoolingParams
from tinyvllm.worker.pooler import Pooler, PoolingState

HIDDEN = 8
SCORE = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(0))  # a classifier's head, 3 labels
TAG = 1  # a step tag among prompt tokens 0-2


def oracle(states: torch.Tensor, pooling_type: str, params: PoolingParams, prompt: list[int]) -> torch.Tensor:
    if params.task == "token_embed":  # every position, whatever the pooling type (or the tagged ones)
        if params.step_tag_id is not None:
            states = states[[p for p, t in enumerate(prompt) if t == params.step_tag_id]]
        return torch.nn.functional.normalize(states, dim=-1) if params.normalize else states
    vector = {"LAST": states[-1], "MEAN": states.mean(dim=0), "CLS": states[0]}[pooling_type]
    if params.task == "classify":
        logits = SCORE @ vector
        return torch.softmax(logits, dim=-1) if params.use_activation else logits
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    return torch.nn.functional.normalize(vector, dim=-1) if params.normalize else vector


@st.composite
def workloads(draw):
    """Prompt lengths, each prompt's chunk sizes, the steps' row orders, a restart or not."""
    lengths = draw(st.lists(st.integers(1, 12), min_size=1, max_size=4))
    chunks = []
    for n in lengths:
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
        bounds = [0, *cuts, n]
        chunks.append([b - a for a, b in zip(bounds, bounds[1:])])
    # a preemption after chunk r (never after the last: a finished prompt is not preempted)
    restarts = [draw(st.integers(0, len(c) - 2)) if len(c) > 1 and draw(st.booleans()) else None for c in chunks]
    params = []
    for _ in lengths:  # resolved params, as the input processor hands them on
        on = draw(st.booleans())
        task = draw(st.sampled_from(["embed", "classify", "token_embed"]))
        if task == "classify":
            params.append(PoolingParams(None, None, on, "classify"))
        elif task == "token_embed":
            params.append(PoolingParams(None, on, on, task, step_tag_id=draw(st.sampled_from([None, TAG]))))
        else:
            params.append(PoolingParams(draw(st.sampled_from([None, 3])), on, on, task))
    prompts = [draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)) for n in lengths]
    return lengths, chunks, restarts, params, prompts, draw(st.randoms(use_true_random=False))


@given(workload=workloads(), pooling_type=st.sampled_from(["LAST", "MEAN", "CLS"]))
def test_chunked_pooling_equals_pooling_the_whole_prompt(workload, pooling_type):
    lengths, chunks, restarts, params, prompts, rng = workload
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    states_of = [torch.randn(n, HIDDEN, generator=gen) for n in lengths]  # each prompt's final hidden states
    pooler = Pooler(PoolerConfig(pooling_type, True), lambda rows: rows @ SCORE.T, {"classify": "softmax"})
    pool_states = [PoolingState() for _ in lengths]
    # the chunks each prompt goes through: after a restart, once more from position 0
    plans = [c if r is None else c[: r + 1] + c for c, r in zip(chunks, restarts)]
    cursor, position = [0] * len(lengths), [0] * len(lengths)
    made: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(lengths))}
    while any(k < len(plan) for k, plan in zip(cursor, plans)):
        live = [i for i, plan in enumerate(plans) if cursor[i] < len(plan)]
        rows = rng.sample(live, rng.randint(1, len(live)))  # this step's rows, in any order
        hidden, computed, scheduled, complete = [], [], [], []
        for i in rows:
            n = plans[i][cursor[i]]
            if restarts[i] is not None and cursor[i] == restarts[i] + 1:
                position[i] = 0  # preempted: recomputed from the start
            c = position[i]
            hidden.append(states_of[i][c : c + n])
            computed.append(c)
            scheduled.append(n)
            complete.append(cursor[i] == len(plans[i]) - 1)
            position[i] += n
            cursor[i] += 1
        out = pooler.pool(torch.cat(hidden), [params[i] for i in rows], [pool_states[i] for i in rows],
                          computed, scheduled, complete, [prompts[i] for i in rows])  # fmt: skip
        for i, vector, done in zip(rows, out, complete):
            assert (vector is not None) is done
            if vector is not None:
                made[i].append(vector)
    for i, vectors in made.items():
        assert len(vectors) == 1, f"prompt {i}: {len(vectors)} vectors"
        want = oracle(states_of[i], pooling_type, params[i], prompts[i])
        assert vectors[0].shape == want.shape and torch.allclose(vectors[0], want, atol=1e-5)
