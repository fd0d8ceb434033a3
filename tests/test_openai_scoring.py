"""``POST /score`` and ``POST /rerank`` against a real pooling server (``tinyvllm serve --runner
pooling``) on 127.0.0.1, and a generating one that refuses them.

Every score is checked against ``LLM(runner="pooling").score`` on a second engine built from
the same folder (the tiny random Qwen3): the server and the offline call embed the same ids
and take the same cosine.
"""

from __future__ import annotations


import pytest
from serve_fixtures import aborts_when_the_client_leaves, require_serve_extra, running_server

require_serve_extra()  # without the serve extra (the GPU machine) this module skips at collection

import httpx  # noqa: E402

from tinyvllm import LLM  # noqa: E402

NAME = "tiny-embed"
ENGINE = dict(device="cpu", max_model_len=64, block_size=4)
QUERY = "def add(a, b):"
DOCS = ["import os\nprint(os.sep)", "def sum_two(x, y):\n    return x + y", "class Stack:\n    pass", "x = 1"]


@pytest.fixture(scope="module")
def offline(tiny_model_dirs):
    return LLM(tiny_model_dirs["qwen3"], runner="pooling", **ENGINE)


@pytest.fixture(scope="module")
def server(tiny_model_dirs):
    """The pooling server's base URL and its ``LLM`` (two sequences a step, for the abort test)."""
    llm = LLM(tiny_model_dirs["qwen3"], runner="pooling", max_num_seqs=2, **ENGINE)
    with running_server(llm, NAME) as (url, _):
        yield url, llm


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server[0] + route, json={"model": NAME, **body}, timeout=60)


def offline_scores(offline, data_1, data_2) -> tuple[list[float], int]:
    outputs = offline.score(data_1, data_2, use_tqdm=False)
    return [o.outputs.score for o in outputs], sum(len(o.prompt_token_ids) for o in outputs)


@pytest.mark.parametrize("route", ["/score", "/v1/score"])
@pytest.mark.parametrize(
    "text_1, text_2",
    [(QUERY, DOCS[0]), (QUERY, DOCS), ([QUERY], DOCS), ([QUERY, DOCS[0], DOCS[2]], [DOCS[1], DOCS[0], QUERY])],
    ids=["1-to-1", "1-to-N", "list-of-1-to-N", "N-to-N"],
)
def test_score_equals_the_offline_scores_in_pair_order(server, offline, route, text_1, text_2):
    want, n_tokens = offline_scores(offline, text_1, text_2)
    out = post(server, route, {"text_1": text_1, "text_2": text_2}).json()
    assert [d["index"] for d in out["data"]] == list(range(len(want))) and {d["object"] for d in out["data"]} == {"score"}
    assert [d["score"] for d in out["data"]] == pytest.approx(want, abs=1e-5)
    assert out["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}  # each pair's two prompts
    assert out["object"] == "list" and out["model"] == NAME and out["id"].startswith("score-") and out["created"] > 0


@pytest.mark.parametrize("route", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_sorts_the_documents_by_score_with_their_indices(server, offline, route):
    want, n_tokens = offline_scores(offline, QUERY, DOCS)
    out = post(server, route, {"query": QUERY, "documents": DOCS}).json()
    order = sorted(range(len(DOCS)), key=lambda j: -want[j])
    assert [r["index"] for r in out["results"]] == order and len(set(want)) == len(want)
    assert [r["relevance_score"] for r in out["results"]] == pytest.approx([want[j] for j in order], abs=1e-5)
    assert [r["document"] for r in out["results"]] == [{"text": DOCS[j]} for j in order]
    assert out["usage"] == {"total_tokens": n_tokens} and out["model"] == NAME and out["id"].startswith("rerank-")


def test_rerank_top_n_keeps_the_best_and_counts_every_document(server, offline):
    want, n_tokens = offline_scores(offline, QUERY, DOCS)
    best = sorted(range(len(DOCS)), key=lambda j: -want[j])
    for top_n, expect in ((2, best[:2]), (1, best[:1]), (0, best), (10, best)):
        out = post(server, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": top_n}).json()
        assert [r["index"] for r in out["results"]] == expect, top_n
        assert out["usage"]["total_tokens"] == n_tokens


def test_a_text_repeated_is_embedded_once_and_truncation_is_honoured(server, offline, monkeypatch):
    llm, asked = server[1], []
    add = llm.engine.add_core_request
    monkeypatch.setattr(llm.engine, "add_core_request", lambda request: (asked.append(request), add(request))[1])
    docs = [DOCS[0], DOCS[1], DOCS[0], QUERY]
    out = post(server, "/score", {"text_1": QUERY, "text_2": docs}).json()
    assert len(asked) == 3  # the query and DOCS[0] once each
    assert [d["score"] for d in out["data"]] == pytest.approx(offline_scores(offline, QUERY, docs)[0], abs=1e-5)
    tok = offline.get_tokenizer()
    cut = [{"prompt_token_ids": tok(t).input_ids[-3:]} for t in (QUERY, DOCS[1])]
    got = post(server, "/score", {"text_1": QUERY, "text_2": DOCS[1], "truncate_prompt_tokens": 3}).json()
    assert got["data"][0]["score"] == pytest.approx(offline_scores(offline, cut[0], cut[1])[0][0], abs=1e-5)
    assert got["usage"]["prompt_tokens"] == 6


@pytest.mark.parametrize(
    "route, body, param, words",
    [
        ("/score", {"text_1": ["a", "b", "c"], "text_2": ["x", "y"]}, "text_2", "text_1 has 3 items and text_2 has 2"),
        ("/score", {"text_1": ["a", "b"], "text_2": "x"}, "text_2", "text_1 has 2 items and text_2 has 1"),
        ("/score", {"text_1": [], "text_2": ["x"]}, "text_1", "text_1 has 0 items"),
        ("/score", {"text_1": "a", "text_2": ["x", ""]}, "text_2", "`text_2[1]` is empty"),
        ("/score", {"text_1": "", "text_2": "x"}, "text_1", "`text_1` is empty"),
        ("/score", {"text_1": "a", "text_2": ["x", "y " * 80]}, "text_2", "`text_2[1]` has"),
        ("/score", {"text_1": "a", "text_2": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "must be >= 1 or -1"),
        ("/score", {"text_1": "a", "text_2": "x", "priority": 3}, "priority", "priority"),
        ("/score", {"text_1": 3, "text_2": "x"}, "text_1", "text_1"),
        ("/score", {"text_1": "a", "text_2": "x", "activation": True}, "activation", "Unrecognized request argument"),
        ("/rerank", {"query": "a", "documents": []}, "documents", "`documents` must not be empty"),
        ("/rerank", {"query": "a", "documents": ["x", "", "y"]}, "documents", "`documents[1]` is empty"),
        ("/rerank", {"query": "", "documents": ["x"]}, "query", "`query` is empty"),
        ("/rerank", {"query": "a", "documents": ["x"], "top_n": -1}, "top_n", "`top_n` must be >= 0"),
        ("/rerank", {"query": "a", "documents": "x"}, "documents", "documents"),
        ("/rerank", {"query": "a", "documents": ["x"], "return_documents": True}, "return_documents", "Unrecognized"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field_and_queue_nothing(server, route, body, param, words):
    response = post(server, route, body)
    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (400, param), error
    assert words in error["message"], error
    assert not server[1].engine.has_unfinished_requests()


def test_a_client_that_leaves_aborts_the_texts_still_queued(server, monkeypatch):
    """Five texts, two a step, 0.6 s a step: the client leaves after 0.3 s, the server aborts the rest."""
    aborted = aborts_when_the_client_leaves(monkeypatch, server[0] + "/rerank", server[1],
                                            {"query": QUERY, "documents": DOCS})  # fmt: skip
    assert aborted and all(str(ids).startswith("rerank-") for ids in aborted), aborted


def test_a_generating_server_refuses_score_and_rerank(tiny_model_dirs):
    with running_server(LLM(tiny_model_dirs["qwen3"], **ENGINE), NAME) as (url, _):
        score = httpx.post(url + "/v1/score", json={"text_1": "a", "text_2": "b"}, timeout=60)
        rerank = httpx.post(url + "/rerank", json={"query": "a", "documents": ["b"]}, timeout=60)
    for response, api in ((score, "Score API"), (rerank, "Rerank API")):
        error = response.json()["error"]
        assert (response.status_code, error["param"]) == (400, "model")
        assert f"does not support {api}" in error["message"] and "--runner pooling" in error["message"]
