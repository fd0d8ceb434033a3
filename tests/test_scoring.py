"""``LLM.score`` on an embedding model: each pair's score is the cosine of the two vectors
``LLM.embed`` gives, by vLLM's pairing rule (1-to-1, 1-to-N, N-to-N), each distinct text
embedded once; a bad pairing or prompt is refused by name before anything is queued.
"""

from __future__ import annotations

import math

import pytest
import torch

from tinyvllm import LLM, ScoringOutput, ScoringRequestOutput
from tinyvllm.engine.scoring import cosine, score_plan

QUERY = "def add(a, b):"
DOCS = ["def sum_two(x, y):\n    return x + y", "import os\nprint(os.sep)", "class Stack:\n    pass"]
ENGINE = dict(device="cpu", max_model_len=64, block_size=4)


@pytest.fixture(scope="module")
def llm():
    return LLM(runner="pooling", **ENGINE)


@pytest.fixture
def queued(llm, monkeypatch):
    """The prompt ids of every request the engine is given, in order."""
    seen = []
    add = llm.engine.add_core_request
    spy = lambda request: (seen.append(request.prompt_token_ids), add(request))[1]  # noqa: E731
    monkeypatch.setattr(llm.engine, "add_core_request", spy)
    return seen


def embedded(llm, texts: list[str]) -> list[list[float]]:
    return [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]


def reference_cosine(u: list[float], v: list[float]) -> float:
    return sum(a * b for a, b in zip(u, v)) / math.sqrt(sum(a * a for a in u) * sum(b * b for b in v))


def scores(outputs: list[ScoringRequestOutput]) -> list[float]:
    assert all(isinstance(o.outputs, ScoringOutput) and o.finished for o in outputs)
    return [o.outputs.score for o in outputs]


def test_one_to_one_is_the_cosine_of_the_two_embeddings(llm):
    q, d = embedded(llm, [QUERY, DOCS[0]])
    (out,) = llm.score(QUERY, DOCS[0], use_tqdm=False)
    assert out.outputs.score == pytest.approx(reference_cosine(q, d), abs=1e-6)
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok(QUERY).input_ids + tok(DOCS[0]).input_ids  # vLLM's: both prompts' ids
    first, second = out.request_id.split("_")
    assert first != second and first.isdigit() and second.isdigit()


def test_one_to_n_scores_the_query_against_each_document_in_order(llm):
    q, *docs = embedded(llm, [QUERY, *DOCS])
    want = [reference_cosine(q, d) for d in docs]
    assert scores(llm.score(QUERY, DOCS, use_tqdm=False)) == pytest.approx(want, abs=1e-6)
    assert scores(llm.score([QUERY], DOCS, use_tqdm=False)) == pytest.approx(want, abs=1e-6)  # a list of one: the same
    assert len(set(want)) == len(want)  # different documents, different scores: the order is checked


def test_n_to_n_pairs_the_two_lists_in_order(llm):
    firsts = [QUERY, DOCS[1], "x = 1"]
    vectors = embedded(llm, firsts + DOCS)
    want = [reference_cosine(vectors[i], vectors[3 + i]) for i in range(3)]
    assert scores(llm.score(firsts, DOCS, use_tqdm=False)) == pytest.approx(want, abs=1e-6)


def test_each_distinct_text_is_embedded_once(llm, queued):
    tok = llm.get_tokenizer()
    out = llm.score(QUERY, [DOCS[0], DOCS[1], DOCS[0], QUERY], use_tqdm=False)
    assert queued == [tuple(tok(t).input_ids) for t in (QUERY, DOCS[0], DOCS[1])]  # the query once, DOCS[0] once
    assert out[0] == out[2]  # the same pair of requests
    first, second = out[3].request_id.split("_")
    assert first == second and out[3].outputs.score == pytest.approx(1.0, abs=1e-6)  # a text against itself
    queued.clear()
    llm.score([QUERY, DOCS[2]], [DOCS[2], QUERY], use_tqdm=False)
    assert len(queued) == 2


@pytest.mark.parametrize(
    "data_1, data_2, words",
    [
        (["a", "b", "c"], ["x", "y"], "data_1 has 3 items and data_2 has 2"),
        (["a", "b"], "x", "data_1 has 2 items and data_2 has 1"),
        ([], ["x"], "data_1 has 0 items and data_2 has 1"),
        ("a", [], "data_1 has 1 items and data_2 has 0"),
    ],
)
def test_a_bad_pairing_is_a_value_error_naming_both_lengths(llm, queued, data_1, data_2, words):
    with pytest.raises(ValueError, match=words):
        llm.score(data_1, data_2, use_tqdm=False)
    assert queued == [] and not llm.engine.has_unfinished_requests()


def test_a_bad_prompt_is_named_by_its_place_and_nothing_is_queued(llm, queued):
    with pytest.raises(ValueError, match=r"^data_2\[1\] is empty"):
        llm.score(QUERY, [DOCS[0], ""], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^data_1 has 65 tokens, more than max_model_len 64"):
        llm.score({"prompt_token_ids": [5] * 65}, DOCS[0], use_tqdm=False)
    with pytest.raises(TypeError, match="data_1 must be a str, a prompt dict or a list of them"):
        llm.score(3, DOCS[0], use_tqdm=False)
    with pytest.raises(TypeError, match="use_tqdm"):
        llm.score(QUERY, DOCS[0], use_tqdm="no")
    assert queued == [] and not llm.engine.has_unfinished_requests()


def test_token_id_prompts_score_as_their_text(llm):
    ids = llm.get_tokenizer()(DOCS[1]).input_ids
    by_ids = llm.score(QUERY, {"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.score
    assert by_ids == pytest.approx(llm.score(QUERY, DOCS[1], use_tqdm=False)[0].outputs.score, abs=1e-6)


def test_a_generating_engine_refuses_to_score():
    llm = LLM(**ENGINE)
    with pytest.raises(ValueError, match=r"scoring needs a pooling engine, LLM\(model, runner='pooling'\)"):
        llm.score(QUERY, DOCS)
    assert not llm.engine.has_unfinished_requests()


def test_the_plan_and_the_cosine_alone():
    plan = score_plan(["q", "r"], ["d", "q"], names=("text_1", "text_2"))
    assert plan.prompts == ["q", "r", "d"] and plan.names == ["text_1[0]", "text_1[1]", "text_2[0]"]
    assert plan.pairs == [(0, 2), (1, 0)]
    u, v = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    want = float(u @ v / (u.norm() * v.norm()))
    assert cosine(u, v) == pytest.approx(want, abs=1e-6)
    half = u.to(torch.bfloat16)
    assert cosine(4 * half, half) == pytest.approx(1.0, abs=1e-6)  # in float32 (the product is exact), scale-free
