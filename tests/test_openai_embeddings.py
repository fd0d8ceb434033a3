"""``POST /v1/embeddings`` through the real ``openai`` client, against a real pooling server
(``tinyvllm serve --runner pooling``) on 127.0.0.1, and a generating one that refuses it.

The model is the tiny random Qwen3, copied with ``is_matryoshka: true`` in its config.json
so that ``dimensions`` may be served. Every vector is checked against
``LLM(runner="pooling").embed`` on a second engine built from the same folder.
"""

from __future__ import annotations

import base64
import json
import shutil
import struct

import pytest
from serve_fixtures import aborts_when_the_client_leaves, require_serve_extra, running_server

require_serve_extra()  # without the serve extra (the GPU machine) this module skips at collection

import httpx  # noqa: E402
import openai  # noqa: E402

from tinyvllm import LLM  # noqa: E402
from tinyvllm.pooling_params import PoolingParams  # noqa: E402

NAME = "tiny-embed"
ENGINE = dict(device="cpu", max_model_len=64, block_size=4)
PROMPTS = ["def main():\n    return 1", "hello world", "import os\nimport sys\n\nprint(os.sep)"]


@pytest.fixture(scope="module")
def folder(tiny_model_dirs, tmp_path_factory):
    path = tmp_path_factory.mktemp("embed") / "qwen3-matryoshka"
    shutil.copytree(tiny_model_dirs["qwen3"], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    return str(path)


@pytest.fixture(scope="module")
def offline(folder):
    return LLM(folder, runner="pooling", **ENGINE)


@pytest.fixture(scope="module")
def server(folder):
    """The pooling server's base URL, its ``LLM`` and an ``openai`` client (two sequences a step, for the abort test)."""
    llm = LLM(folder, runner="pooling", max_num_seqs=2, **ENGINE)
    with running_server(llm, NAME) as (url, _):
        yield url, llm, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def embed(offline, prompts, **params) -> list[list[float]]:
    return [o.outputs.embedding for o in offline.embed(prompts, PoolingParams(**params), use_tqdm=False)]


def assert_close(got: list[list[float]], want: list[list[float]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert len(g) == len(w) and max(abs(a - b) for a, b in zip(g, w)) < 1e-5


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server[0] + "/v1/embeddings", json={"model": NAME, **body}, timeout=60)


def test_float_vectors_equal_the_offline_engine_in_input_order(server, offline):
    out = server[2].embeddings.create(model=NAME, input=PROMPTS, encoding_format="float")
    assert [d.index for d in out.data] == [0, 1, 2] and {d.object for d in out.data} == {"embedding"}
    assert_close([d.embedding for d in out.data], embed(offline, PROMPTS))
    lengths = [len(o.prompt_token_ids) for o in offline.embed(PROMPTS, use_tqdm=False)]
    assert (out.usage.prompt_tokens, out.usage.total_tokens) == (sum(lengths), sum(lengths))
    assert out.model == NAME and out.object == "list" and out.id.startswith("embd-") and out.created > 0


def test_base64_is_float32_little_endian_and_the_clients_default(server, offline):
    want = embed(offline, PROMPTS[:2])
    decoded = server[2].embeddings.create(model=NAME, input=PROMPTS[:2])  # the client asks for base64 and decodes it
    assert_close([d.embedding for d in decoded.data], want)
    raw = post(server, {"input": PROMPTS[:2], "encoding_format": "base64"}).json()["data"]
    for item, vector in zip(raw, want):
        data = base64.b64decode(item["embedding"])
        assert list(struct.unpack(f"<{len(data) // 4}f", data)) == vector  # float32 exactly: both are the engine's


def test_token_id_inputs_one_or_many(server, offline):
    tok = offline.get_tokenizer()
    ids = [tok(p).input_ids for p in PROMPTS[:2]]
    want = embed(offline, [{"prompt_token_ids": i} for i in ids])
    one = server[2].embeddings.create(model=NAME, input=ids[0], encoding_format="float")
    many = server[2].embeddings.create(model=NAME, input=ids, encoding_format="float")
    assert_close([d.embedding for d in one.data], want[:1])
    assert_close([d.embedding for d in many.data], want)
    assert many.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_dimensions_normalize_and_truncation_are_honoured(server, offline):
    out = server[2].embeddings.create(model=NAME, input=PROMPTS[0], dimensions=8, encoding_format="float")
    assert_close([out.data[0].embedding], embed(offline, PROMPTS[:1], dimensions=8))
    raw = post(server, {"input": PROMPTS[0], "normalize": False}).json()["data"][0]["embedding"]
    assert_close([raw], embed(offline, PROMPTS[:1], normalize=False))
    assert abs(sum(v * v for v in raw) - 1) > 1e-3  # not unit length: a weak row otherwise
    ids = offline.get_tokenizer()(PROMPTS[2]).input_ids
    cut = post(server, {"input": PROMPTS[2], "truncate_prompt_tokens": 3}).json()
    assert cut["usage"]["prompt_tokens"] == 3
    assert_close([cut["data"][0]["embedding"]], embed(offline, [{"prompt_token_ids": ids[-3:]}]))


def test_request_id_user_and_add_special_tokens(server, offline):
    """``request_id`` names the answer; ``user`` changes nothing; ``add_special_tokens`` is the tokenizer's."""
    out = post(server, {"input": PROMPTS[1], "request_id": "row-7", "user": "someone", "add_special_tokens": False}).json()
    ids = offline.get_tokenizer()(PROMPTS[1], add_special_tokens=False).input_ids
    assert out["id"] == "embd-row-7" and out["usage"]["prompt_tokens"] == len(ids)
    assert_close([out["data"][0]["embedding"]], embed(offline, [{"prompt_token_ids": ids}]))


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"input": []}, "input", "`input` must not be empty"),
        ({"input": ""}, "input", "`input` must not be empty"),
        ({"input": ["a", ""]}, "input", "`input[1]` is empty"),
        ({"input": [[1, 2], [3, 10**6]]}, "input", "`input[1]` has token id 1000000, outside the vocabulary"),
        ({"input": [5] * 65}, "input", "`input` has 65 tokens, more than max_model_len 64"),
        ({"input": ["a", "x" * 5000]}, "input", "`input[1]` has at least"),
        ({"input": "a", "dimensions": 0}, "dimensions", "dimensions must be an int >= 1, got 0"),
        ({"input": "a", "dimensions": 10**4}, "dimensions", "more than the model's hidden size"),
        ({"input": "a", "encoding_format": "bytes"}, "encoding_format", "`encoding_format` must be one of"),
        ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "must be >= 1 or -1"),
        ({"input": "a", "priority": 3}, "priority", "priority"),
        ({"input": "a", "suffix": "b"}, "suffix", "Unrecognized request argument supplied: suffix"),
        ({"input": 3}, "input", "`input` must be"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field_and_queue_nothing(server, body, param, words):
    response = post(server, body)
    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (400, param), error
    assert words in error["message"], error
    assert not server[1].engine.has_unfinished_requests()


def test_a_client_that_leaves_aborts_the_inputs_still_queued(server, monkeypatch):
    """Four inputs, two a step, 0.6 s a step: the client leaves after 0.3 s, the server aborts the rest."""
    aborted = aborts_when_the_client_leaves(monkeypatch, server[0] + "/v1/embeddings", server[1],
                                            {"input": PROMPTS + PROMPTS[:1]})  # fmt: skip
    assert aborted and all(str(ids).startswith("embd-") for ids in aborted), aborted


def test_a_pooling_server_refuses_completions_and_chat_and_keeps_its_other_routes(server):
    url, _, client = server
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt="x")
    assert info.value.body["param"] == "model" and "this server embeds" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}])
    assert "does not support Chat Completions API" in info.value.body["message"]
    assert httpx.get(url + "/health").status_code == 200
    assert [m.id for m in client.models.list()] == [NAME]
    metrics = httpx.get(url + "/metrics").text
    assert 'vllm:prompt_tokens_total{model_name="tiny-embed"}' in metrics and "vllm:request_success_total" in metrics


def test_a_generating_server_refuses_embeddings(folder):
    with running_server(LLM(folder, **ENGINE), NAME) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model=NAME, input="x")
        assert client.completions.create(model=NAME, prompt="x", max_tokens=2).choices[0].text is not None
    assert info.value.body["param"] == "model"
    assert "does not support Embeddings API" in info.value.body["message"] and "--runner pooling" in info.value.body["message"]
