"""``POST /classify`` and a cross-encoder's ``/score`` and ``/rerank`` against real servers on
127.0.0.1: a three-label classifier's and a one-label cross-encoder's (tiny random models built
here), each checked against the offline ``LLM.classify`` and ``LLM.score`` of a second engine
on the same folder; and the refusals of a server whose model cannot do the route.
"""

from __future__ import annotations

import base64
import struct

import pytest
import torch
from serve_fixtures import require_serve_extra, running_server

require_serve_extra()  # without the serve extra (the GPU machine) this module skips at collection

import httpx  # noqa: E402

from tinyvllm import LLM, PoolingParams  # noqa: E402
from tinyvllm.models.tiny import build_tiny_model  # noqa: E402

ENGINE = dict(device="cpu", max_model_len=64, block_size=4)
TEXTS = ["def add(a, b):", "import os\nprint(os.sep)", "class Stack:\n    pass"]
QUERY = "def add(a, b):"
DOCS = ["import os", "def sum_two(x, y):\n    return x + y", "x = 1"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("served-classifiers")
    three = build_tiny_model(root / "cls", "qwen3", num_labels=3, id2label={0: "neg", 1: "neu", 2: "pos"})
    return {"three": three, "one": build_tiny_model(root / "ce", "llama", num_labels=1)}


@pytest.fixture(scope="module")
def classifier(folders):
    llm = LLM(str(folders["three"]), **ENGINE)
    with running_server(llm, "cls") as (url, _):
        yield url, LLM(str(folders["three"]), **ENGINE)


@pytest.fixture(scope="module")
def cross_encoder(folders):
    llm = LLM(str(folders["one"]), **ENGINE)
    with running_server(llm, "ce") as (url, _):
        yield url, LLM(str(folders["one"]), **ENGINE)


def test_classify_answers_each_inputs_probs_and_best_label(classifier):
    url, offline = classifier
    want = offline.classify(TEXTS, use_tqdm=False)
    out = httpx.post(url + "/classify", json={"model": "cls", "input": TEXTS}, timeout=60).json()
    assert out["object"] == "list" and out["id"].startswith("classify-") and out["model"] == "cls"
    labels = ["neg", "neu", "pos"]
    for item, expected in zip(out["data"], want):
        probs = expected.outputs.probs
        assert item["probs"] == pytest.approx(probs, abs=1e-5) and item["num_classes"] == 3
        assert item["label"] == labels[max(range(3), key=probs.__getitem__)]
    assert [d["index"] for d in out["data"]] == [0, 1, 2]
    n_tokens = sum(len(o.prompt_token_ids) for o in want)
    assert out["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
    raw = httpx.post(url + "/classify", json={"input": [1, 2, 3], "use_activation": False}, timeout=60).json()
    [expected] = offline.classify({"prompt_token_ids": [1, 2, 3]}, PoolingParams(use_activation=False), use_tqdm=False)
    assert raw["data"][0]["probs"] == pytest.approx(expected.outputs.probs, abs=1e-5)


def test_a_classifier_refuses_embeddings_and_scores_and_generation(classifier):
    url, _ = classifier
    for route, body in (("/v1/embeddings", {"input": "x"}), ("/score", {"text_1": "a", "text_2": "b"}),
                        ("/v1/completions", {"prompt": "x", "max_tokens": 2})):  # fmt: skip
        response = httpx.post(url + route, json=body, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "model", route
    bad = httpx.post(url + "/classify", json={"input": []}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


def test_a_cross_encoder_serves_score_and_rerank_as_llm_score(cross_encoder):
    url, offline = cross_encoder
    want = [o.outputs.score for o in offline.score(QUERY, DOCS, use_tqdm=False)]
    n_tokens = sum(len(o.prompt_token_ids) for o in offline.score(QUERY, DOCS, use_tqdm=False))
    out = httpx.post(url + "/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=60).json()
    assert [d["score"] for d in out["data"]] == pytest.approx(want, abs=1e-5)
    assert out["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}  # each pair's one prompt
    ranked = httpx.post(url + "/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2}, timeout=60).json()
    order = sorted(range(len(DOCS)), key=lambda j: -want[j])[:2]
    assert [r["index"] for r in ranked["results"]] == order
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([want[j] for j in order], abs=1e-5)
    long = httpx.post(url + "/score", json={"text_1": QUERY, "text_2": ["ok", "word " * 200]}, timeout=60)
    assert long.status_code == 400 and long.json()["error"]["param"] == "text_2"
    assert "`text_2[1]` has" in long.json()["error"]["message"]


def test_pooling_answers_any_task_the_model_does_as_llm_encode(classifier):
    """``POST /pooling``: the body's task (None: the model's first), each input's tensor as
    nested lists, equal to ``LLM.encode(..., pooling_task=task)``."""
    url, offline = classifier
    for task in (None, "token_classify"):
        want = offline.encode(TEXTS, use_tqdm=False, pooling_task=task)
        out = httpx.post(url + "/pooling", json={"input": TEXTS, "task": task}, timeout=60).json()
        assert out["object"] == "list" and out["id"].startswith("pool-")
        for item, expected in zip(out["data"], want):
            assert item["object"] == "pooling"
            assert torch.allclose(torch.tensor(item["data"]), expected.outputs.data, atol=1e-5)
    assert len(out["data"][0]["data"]) == len(want[0].prompt_token_ids)  # token_classify: a row per token
    bad = httpx.post(url + "/pooling", json={"input": "x", "task": "embed"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "task"
    bad = httpx.post(url + "/pooling", json={"input": "x", "dimensions": 2}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"
    bad = httpx.post(url + "/pooling", json={"input": "x", "encoding_format": "hex"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "encoding_format"


def test_pooling_in_base64_is_the_same_floats_in_row_order(classifier):
    """``encoding_format: "base64"`` (``pooling.py`` NOTE 2): float32 little-endian bytes of the
    flattened tensor, a pooled task's vector or a token task's rows one after another."""
    url, offline = classifier
    for task in ("classify", "token_classify"):
        [want] = offline.encode(TEXTS[1], use_tqdm=False, pooling_task=task)
        body = {"input": TEXTS[1], "task": task, "encoding_format": "base64"}
        [item] = httpx.post(url + "/pooling", json=body, timeout=60).json()["data"]
        raw = base64.b64decode(item["data"])
        values = struct.unpack(f"<{len(raw) // 4}f", raw)
        assert torch.allclose(torch.tensor(values).reshape(want.outputs.data.shape), want.outputs.data, atol=1e-5)


def test_a_step_tag_reward_server_answers_the_tagged_rows(folders):
    """A server started with ``pooler_config={"step_tag_id": t}`` answers ``token_classify``
    with the rows of the prompt positions holding ``t`` (``pooling_params.py`` NOTE 6), as the
    offline engine does; ``classify`` is as before."""
    llm = LLM(str(folders["three"]), pooler_config={"step_tag_id": 7}, **ENGINE)
    prompt = [5, 7, 9, 11, 7, 13]
    with running_server(llm, "prm") as (url, _):
        out = httpx.post(url + "/pooling", json={"input": prompt, "task": "token_classify"}, timeout=60).json()
    [whole] = LLM(str(folders["three"]), **ENGINE).reward({"prompt_token_ids": prompt}, use_tqdm=False)
    assert torch.allclose(torch.tensor(out["data"][0]["data"]), whole.outputs.data[[1, 4]], atol=1e-5)
