"""The server around the requests: big bodies and long prompts, keys, CORS, request ids, the
utility routes, and the counters and histograms of ``/metrics``.

``test_a_10_mb_prompt_never_stalls_a_stream`` is issue 25's freeze: a 10 MB prompt used to
be tokenized on the engine's only thread (16 s, every stream stopped); now it is refused on
the tokenizer's thread at once, and a concurrent stream keeps its pace.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from serve_fixtures import CHAT_TEMPLATE, require_serve_extra, running_server, slow_steps

require_serve_extra()  # without the serve extra (the GPU machine) this module skips at collection

import httpx  # noqa: E402
import openai  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import tinyvllm  # noqa: E402
from tinyvllm import LLM  # noqa: E402

NAME = "tiny-qwen3"
ENGINE = dict(device="cpu", max_model_len=128, block_size=4)
PROMPT = "def main():\n    return"
MESSAGES = [{"role": "user", "content": "Write a loop."}]


@pytest.fixture(scope="module")
def folder(tiny_model_dirs):
    return str(tiny_model_dirs["qwen3"])


@pytest.fixture(scope="module")
def server(folder):
    llm = LLM(folder, **ENGINE)
    with running_server(llm, NAME, chat_template=CHAT_TEMPLATE) as (url, app):
        yield url, llm, app


@pytest.fixture(scope="module")
def locked(folder):
    """A second server with an API key, one allowed CORS origin and a 2,000-byte body limit."""
    with running_server(LLM(folder, **ENGINE), NAME, api_key="sekrit", allowed_origins=["http://ok.example"],
                        max_request_body_bytes=2000) as (url, _):  # fmt: skip
        yield url


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


# -- a prompt or a body too big never stalls anyone ----------------------------------------------------


def stream_with_gaps(url: str, started: threading.Event, result: dict) -> None:
    """Stream 100 tokens; record the gaps between chunks (and when each came)."""
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True}
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
                if len(times) == 5:
                    started.set()
    result["times"] = times


def big_request_during_a_stream(url: str, body: bytes, endpoint: str = "/v1/completions") -> tuple[httpx.Response, float, float]:
    """Send ``body`` while a stream runs: ``(its response, its seconds, the stream's longest gap while it ran)``."""
    started, result = threading.Event(), {}
    streamer = threading.Thread(target=stream_with_gaps, args=(url, started, result))
    streamer.start()
    assert started.wait(30)
    sent = time.perf_counter()
    response = httpx.post(url + endpoint, content=body, headers={"content-type": "application/json"}, timeout=60)
    done = time.perf_counter()
    streamer.join(60)
    times = result["times"]
    assert len(times) >= 50  # a chunk per token, but for tokens that end inside a character
    during = [b - a for a, b in zip(times, times[1:]) if b > sent and a < done] or [0.0]
    return response, done - sent, max(during)


def test_a_10_mb_prompt_never_stalls_a_stream(server, monkeypatch):
    url, llm, _ = server
    slow_steps(monkeypatch, llm, 0.02)  # the stream lasts about 2 s
    body = json.dumps({"model": NAME, "prompt": "x = 1\n" * (10_000_000 // 6), "max_tokens": 4}).encode()
    assert len(body) > 10_000_000
    response, seconds, gap = big_request_during_a_stream(url, body)
    error = error_of(response, 400)
    assert error["param"] == "prompt" and "more than max_model_len 128" in error["message"]
    print(f"\n10 MB prompt refused in {seconds:.3f} s; the stream's longest gap meanwhile {gap:.3f} s")
    assert seconds < 3.0  # parsed and refused without tokenizing (16 s before)
    assert gap < 1.0  # the stream kept flowing (a step is 0.02 s; it stopped for the whole 16 s before)


def test_a_long_tokenization_runs_beside_the_stream(server, monkeypatch):
    """Without the bound (a tokenizer with a normalizer, such as Qwen's), a long prompt is
    tokenized in full, on the tokenizer's thread: the stream still flows."""
    url, llm, app = server
    slow_steps(monkeypatch, llm, 0.02)
    monkeypatch.setattr(app.state.serving.async_llm.prompt_tokenizer, "max_token_bytes", None)
    body = json.dumps({"model": NAME, "prompt": "x = 1\n" * 200_000, "max_tokens": 4}).encode()  # 1.2 MB
    response, seconds, gap = big_request_during_a_stream(url, body)
    error = error_of(response, 400)
    assert error["param"] == "prompt" and "more than max_model_len 128" in error["message"]
    print(f"\n1.2 MB prompt tokenized and refused in {seconds:.3f} s; the stream's longest gap meanwhile {gap:.3f} s")
    assert gap < 1.0


def test_a_body_over_the_limit_gets_413_before_it_is_parsed(locked):
    auth = {"authorization": "Bearer sekrit"}
    big = json.dumps({"model": NAME, "prompt": "x" * 5000}).encode()
    start = time.perf_counter()
    error = error_of(httpx.post(locked + "/v1/completions", content=big, headers=auth), 413)
    assert error["type"] == "RequestTooLargeError" and "2000 bytes" in error["message"]
    chunks = (big[i : i + 500] for i in range(0, len(big), 500))  # no Content-Length: counted as it arrives
    error_of(httpx.post(locked + "/v1/completions", content=chunks, headers=auth), 413)
    assert time.perf_counter() - start < 5
    ok = httpx.post(locked + "/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 2}, headers=auth)
    assert ok.status_code == 200


# -- keys, CORS, request ids -----------------------------------------------------------------------------


def test_api_key(locked):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sekrit"}):
        response = httpx.get(locked + "/v1/models", headers=headers)
        error = error_of(response, 401)
        assert error["type"] == "AuthenticationError" and response.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=locked + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=locked + "/v1", api_key="sekrit", max_retries=0)
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1
    for path in ("/health", "/metrics", "/version"):  # as vLLM: only /v1 needs the key
        assert httpx.get(locked + path).status_code == 200


def test_cors(locked, server):
    preflight = {"origin": "http://ok.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}  # fmt: skip
    response = httpx.options(locked + "/v1/completions", headers=preflight)  # no key needed for a preflight
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "http://ok.example"
    other = httpx.options(locked + "/v1/completions", headers={**preflight, "origin": "http://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    got = httpx.get(locked + "/health", headers={"origin": "http://ok.example"})
    assert got.headers["access-control-allow-origin"] == "http://ok.example"
    assert "x-request-id" in got.headers["access-control-expose-headers"].lower()
    plain = httpx.get(server[0] + "/health", headers={"origin": "http://ok.example"})  # no --allowed-origins: no CORS
    assert "access-control-allow-origin" not in plain.headers


def test_x_request_id(server):
    url = server[0]
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 2}
    given = httpx.post(url + "/v1/completions", json=body, headers={"x-request-id": "abc-123"})
    assert given.headers["x-request-id"] == "abc-123" and given.json()["id"] == "cmpl-abc-123"
    named = httpx.post(url + "/v1/completions", json={**body, "request_id": "from-body"})
    assert named.headers["x-request-id"] == "from-body" and named.json()["id"] == "cmpl-from-body"
    fresh = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": MESSAGES, "max_tokens": 2})
    assert fresh.json()["id"] == "chatcmpl-" + fresh.headers["x-request-id"]
    again = httpx.post(url + "/v1/completions", json=body, headers={"x-request-id": "abc-123"})
    assert again.status_code == 200  # an id used again is fine: engine ids are unique anyway
    for response in (httpx.get(url + "/nope", headers={"x-request-id": "e1"}),
                     httpx.post(url + "/v1/completions", json={"prompt": 5}, headers={"x-request-id": "e1"})):  # fmt: skip
        assert response.status_code in (400, 404) and response.headers["x-request-id"] == "e1"


# -- the utility routes --------------------------------------------------------------------------------


def test_head_health_and_version(server):
    url = server[0]
    assert httpx.head(url + "/health").status_code == 200
    assert httpx.get(url + "/version").json() == {"version": tinyvllm.__version__}


def test_tokenize_and_detokenize(server):
    url, llm, _ = server
    tok = llm.get_tokenizer()
    got = httpx.post(url + "/tokenize", json={"model": NAME, "prompt": PROMPT, "return_token_strs": True}).json()
    ids = tok(PROMPT).input_ids
    assert got == {"count": len(ids), "max_model_len": 128, "tokens": ids, "token_strs": tok.convert_ids_to_tokens(ids)}
    chat = httpx.post(url + "/tokenize", json={"messages": MESSAGES}).json()
    text = tok.apply_chat_template(MESSAGES, chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok(text, add_special_tokens=False).input_ids and chat["token_strs"] is None
    bare = httpx.post(url + "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"]
    long = httpx.post(url + "/tokenize", json={"prompt": "ab " * 100}).json()  # past the context: still counted
    assert long["count"] > 128
    assert httpx.post(url + "/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPT}
    assert error_of(httpx.post(url + "/detokenize", json={"tokens": [5, 512]}), 400)["param"] == "tokens"
    assert error_of(httpx.post(url + "/tokenize", json={"prompt": "x" * 1_000_000}), 400)["param"] == "prompt"
    assert error_of(httpx.post(url + "/tokenize", json={"prompt": "x", "model": "other"}), 404)["param"] == "model"


# -- errors name the field --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint, body, param, words",
    [
        ("completions", {"max_tokens": True}, "max_tokens", "must be an integer or null, got true"),
        ("completions", {"max_tokens": "10"}, "max_tokens", 'got "10"'),
        ("completions", {"stream": "yes"}, "stream", "must be a boolean"),
        ("completions", {"prompt": [True, False]}, "prompt", "got [true, false]"),
        ("completions", {"temperature": "0.5"}, "temperature", "must be a number"),
        ("completions", {"max_tokens": 10**9}, "max_tokens", "maximum context length is 128 tokens"),
        ("completions", {"max_tokens": 126}, "max_tokens", "is too large: 126"),
        ("completions", {"prompt": [5, 512]}, "prompt", "prompt 0 has token id 512, outside the vocabulary"),
        ("completions", {"prompt": ["def f", ""]}, "prompt", "prompt 1 is empty"),
        ("completions", {"prompt": []}, "prompt", "must not be an empty list"),
        ("completions", {"presence_penalty": 99}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
        ("completions", {"repetition_penalty": -5}, "repetition_penalty", "repetition_penalty must be greater than 0"),
        ("completions", {"min_tokens": 9, "max_tokens": 4}, "min_tokens", "min_tokens must be an int in [0, max_tokens=4]"),
        ("completions", {"top_k": -2}, "top_k", "top_k must be an int in [-1"),
        ("completions", {"stop_token_ids": [9999]}, "stop_token_ids", "outside the vocabulary"),
        ("completions", {"vllm_xargs": {"a": [1]}}, "vllm_xargs", "`vllm_xargs"),
        ("completions", {"truncate_prompt_tokens": 500}, "truncate_prompt_tokens", "more than max_model_len 128"),
        ("chat", {"max_completion_tokens": 10**9}, "max_completion_tokens", "maximum context length"),
        ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages", "messages[0].role"),
        ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages",
         "`messages[0].content` must be a string or array of objects or null, got 5"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages",
         "`messages[0].content[0].text` must be a string or null, got 5"),
        ("chat", {"messages": [{"role": "user", "content": [5]}]}, "messages", "`messages[0].content[0]` must be an object, got 5"),
        ("chat", {"messages": [5]}, "messages", "`messages[0]` must be an object, got 5"),
        ("chat", {"messages": {"role": "user"}}, "messages", "`messages` must be an array of objects, got {"),
        ("completions", {"prompt": [[1, "a"]]}, "prompt", '`prompt[0][1]` must be an integer, got "a"'),
        ("completions", {"stop": [1]}, "stop", "`stop[0]` must be a string, got 1"),
        ("completions", {"logit_bias": {"7": "a"}}, "logit_bias", '`logit_bias["7"]` must be a number, got "a"'),
        ("completions", {"vllm_xargs": {"k": [1]}}, "vllm_xargs", "`vllm_xargs.k` must be a string or integer or number"),
        ("chat", {"messages": []}, "messages", "at least one message"),
        ("chat", {"chat_template": "{% for m in messages %}"}, "chat_template", "not valid Jinja"),
        ("chat", {"chat_template": "{{ raise_exception('no') }}"}, "messages", "the chat template failed"),
        ("chat", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "may not set 'tokenize'"),
    ],
)
def test_errors_name_the_field(server, endpoint, body, param, words):
    base = ({"model": NAME, "prompt": PROMPT} if endpoint == "completions"
            else {"model": NAME, "messages": MESSAGES})  # fmt: skip
    response = httpx.post(f"{server[0]}/v1/{'completions' if endpoint == 'completions' else 'chat/completions'}",
                          json={**base, **body})  # fmt: skip
    error = error_of(response, 400)
    assert error["param"] == param and words in error["message"], error


def test_unset_max_tokens_are_cut_to_the_context_not_refused(server):
    url = server[0]
    long = "ab " * 60  # about 120 tokens of 128: completions' default 16 would not fit
    out = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": long, "ignore_eos": True}).json()
    assert out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] == 128
    up_to = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": None,
                                                      "ignore_eos": True}).json()  # fmt: skip
    assert up_to["usage"]["total_tokens"] == 128  # null: up to the context, as vLLM


# -- /metrics ---------------------------------------------------------------------------------------------


def samples(url: str) -> dict[tuple[str, str | None], float]:
    """``{(sample name, finished_reason label): value}``, histogram buckets left out."""
    text = httpx.get(url + "/metrics").text
    return {(s.name, s.labels.get("finished_reason")): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if "le" not in s.labels}  # fmt: skip


def test_metrics_count_tokens_finishes_and_latencies(server, monkeypatch):
    url, llm, _ = server
    before = samples(url)
    outs = [httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 5,
                                                      "ignore_eos": True}).json(),
            httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 3,
                                                      "logit_bias": {"0": 100}}).json()]  # fmt: skip
    slow_steps(monkeypatch, llm, 0.02)  # 100 tokens would take 2 s
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()  # keep a reference: a collected iterator closes the response
        next(lines)  # leave after the first event: an abort
    deadline = time.monotonic() + 10
    while samples(url)[("vllm:request_success_total", "abort")] == before[("vllm:request_success_total", "abort")]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    after = samples(url)

    def delta(name: str, reason: str | None = None) -> float:
        return after[(name, reason)] - before[(name, reason)]

    prompt_tokens = sum(o["usage"]["prompt_tokens"] for o in outs)
    assert delta("vllm:prompt_tokens_total") == prompt_tokens + outs[0]["usage"]["prompt_tokens"]  # the aborted one too
    generated = sum(o["usage"]["completion_tokens"] for o in outs)
    assert generated < delta("vllm:generation_tokens_total") <= generated + 100
    assert (delta("vllm:request_success_total", "length"), delta("vllm:request_success_total", "stop"),
            delta("vllm:request_success_total", "abort")) == (1, 1, 1)  # fmt: skip
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") >= 4  # 5 tokens: 4 gaps, and more from the others
    assert after[("vllm:e2e_request_latency_seconds_sum", None)] > before[("vllm:e2e_request_latency_seconds_sum", None)]
