"""The OpenAI-compatible server, tested through the ``openai`` client (and raw HTTP where the
client cannot send what a test needs) against a real server on 127.0.0.1.

One server per module (``server`` fixture): a tiny random Qwen3 with a chat template added.
Every greedy answer is compared with ``LLM.generate`` on a second engine built from the same
folder, so the server must produce exactly the offline engine's text.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
from serve_fixtures import CHAT_TEMPLATE, require_serve_extra, running_server, slow_steps

require_serve_extra()  # without the serve extra (the GPU machine) this module skips at collection

import httpx  # noqa: E402
import openai  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tinyvllm import LLM, SamplingParams  # noqa: E402

NAME = "tiny-qwen3"
ENGINE = dict(device="cpu", max_model_len=128, block_size=4)
PROMPT = "def main():\n    return"


@pytest.fixture(scope="module")
def folder(tiny_model_dirs):
    return str(tiny_model_dirs["qwen3"])


@pytest.fixture(scope="module")
def offline(folder):
    """A second engine on the same folder: what the server's answers must equal."""
    llm = LLM(folder, **ENGINE)
    llm.get_tokenizer().chat_template = CHAT_TEMPLATE
    return llm


@pytest.fixture(scope="module")
def server(folder):
    llm = LLM(folder, **ENGINE)
    llm.get_tokenizer().chat_template = CHAT_TEMPLATE
    with running_server(llm, NAME) as (url, app):
        yield url, llm, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def expected(offline, prompt, max_tokens, **kwargs):
    """The offline engine's greedy completion of ``prompt`` (a str or a prompt dict)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)
    [out] = offline.generate(prompt, params, use_tqdm=False)
    return out


def chat_prompt(offline, messages) -> dict:
    tok = offline.get_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return {"prompt_token_ids": tok(text, add_special_tokens=False).input_ids}


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` as ``{sample name: value}`` (the ``model_name`` label dropped)."""
    text = httpx.get(url + "/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if "le" not in s.labels}  # fmt: skip


def wait_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    """Poll ``/metrics`` until no request runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"], m["vllm:kv_cache_usage_perc"])
        if idle == (0, 0, 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


# -- the happy paths ----------------------------------------------------------------------


def test_health_and_models(server, client):
    assert httpx.get(server[0] + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [NAME]


def test_completion_equals_offline_greedy_text(client, offline):
    ref = expected(offline, PROMPT, 10)
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0)
    assert out.choices[0].text == ref.outputs[0].text
    assert out.choices[0].finish_reason == ref.outputs[0].finish_reason
    usage = out.usage
    assert usage.prompt_tokens == len(ref.prompt_token_ids)
    assert usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streamed_completion_equals_offline_greedy_text(client, offline):
    ref = expected(offline, PROMPT, 10)
    chunks = list(client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}
    ))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == ref.outputs[0].finish_reason and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_prompt_as_token_ids(client, offline):
    ids = [(13 * i + 5) % 500 + 5 for i in range(9)]
    ref = expected(offline, {"prompt_token_ids": ids}, 6)
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0)
    assert out.choices[0].text == ref.outputs[0].text and out.usage.prompt_tokens == 9


def test_chat_equals_offline_greedy_text(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a loop."}]
    ref = expected(offline, chat_prompt(offline, messages), 12)
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_streamed_chat_equals_offline_greedy_text(client, offline):
    messages = [{"role": "user", "content": "Count to three."}]
    ref = expected(offline, chat_prompt(offline, messages), 12)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == ref.outputs[0].finish_reason


def test_sse_stream_ends_with_done(server):
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text(client, offline, stream, include):
    full = expected(offline, PROMPT, 16, ignore_eos=True).outputs[0].text
    stop = full[4:6]  # two characters from the middle of the greedy text
    cut = full.find(stop) + (len(stop) if include else 0)
    kwargs = dict(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                  extra_body={"ignore_eos": True, "include_stop_str_in_output": include})  # fmt: skip
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        out = client.completions.create(**kwargs)
        text, finish = out.choices[0].text, out.choices[0].finish_reason
    assert text == full[:cut] and finish == "stop"


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = "class Stack:\n    def __init__(self):\n        self.items = []\n" * 2
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % ENGINE["block_size"] == 0 and cached < second.usage.prompt_tokens


def test_sampling_with_a_seed_is_repeatable(client):
    kwargs = dict(model=NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9, seed=1234,
                  extra_body={"top_k": 50, "min_p": 0.01})  # fmt: skip
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def test_logit_bias_steers_greedy_choice(client, offline):
    token = 300
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(token): 100})
    ref = expected(offline, PROMPT, 3, logit_bias={token: 100.0})
    assert out.choices[0].text == ref.outputs[0].text and ref.outputs[0].token_ids == [token] * 3


# -- errors -------------------------------------------------------------------------------


def _error(status: int, error: openai.APIStatusError, words: str) -> None:
    assert error.status_code == status
    body = error.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status and words in body["error"]["message"]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(max_tokens=-1), "max_tokens must be an int >= 1, got -1"),
        (dict(logit_bias={"600": 5}), "outside the vocabulary [0, 512)"),
        (dict(temperature=-1), "temperature must be a finite number >= 0"),
        (dict(top_p=2), "top_p must be in (0, 1]"),
        (dict(prompt="x " * 300), "more than max_model_len 128"),
        (dict(stop=[""]), "stop strings must be non-empty"),
    ],
)
def test_bad_parameters_get_400(client, kwargs, words):
    kwargs = {"model": NAME, "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kwargs)
    _error(400, info.value, words)


def test_unknown_model_gets_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-nothing", prompt=PROMPT, max_tokens=2)
    _error(404, info.value, "gpt-nothing")


def test_malformed_json_gets_400_in_the_error_shape(server):
    response = httpx.post(server[0] + "/v1/completions", content=b'{"model": "tiny-qwen3", "prompt": ',
                          headers={"content-type": "application/json"})  # fmt: skip
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"


def test_chat_without_template_gets_400(server, client):
    tokenizer = server[2].state.serving.async_llm.tokenizer  # the copy the tokenizer thread renders with
    tokenizer.chat_template = None
    try:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    finally:
        tokenizer.chat_template = CHAT_TEMPLATE
    _error(400, info.value, "has no chat template")
    assert info.value.response.json()["error"]["param"] == "messages"


def test_server_serves_normally_after_errors(client, offline):
    for bad in (dict(max_tokens=-5), dict(logit_bias={"9999": 1})):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=NAME, prompt=PROMPT, **{"max_tokens": 3, **bad})
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0)
    assert out.choices[0].text == expected(offline, PROMPT, 5).outputs[0].text


def test_waiting_bound_gets_503(folder, monkeypatch):
    llm = LLM(folder, max_num_seqs=1, **ENGINE)  # one request runs; the others wait
    slow_steps(monkeypatch, llm, 0.01)  # so the running one outlasts the third's admission on any machine

    async def main(url):
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 100, "temperature": 0, "stream": True,
                "ignore_eos": True}  # fmt: skip
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            first = await http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
            second = asyncio.create_task(http.post("/v1/completions", json=body))  # waits behind the first
            while metrics(url)["vllm:num_requests_waiting"] < 1:
                await asyncio.sleep(0.02)
            third = await http.post("/v1/completions", json=body)
            await first.aclose()
            await second
            return third

    with running_server(llm, NAME, max_waiting_requests=1) as (url, _):
        third = asyncio.run(main(url))
        assert third.status_code == 503
        assert third.json()["error"]["type"] == "ServiceUnavailableError"
        assert "requests are waiting" in third.json()["error"]["message"]
        idle = wait_idle(url)
    assert (idle["vllm:num_requests_running"], idle["vllm:kv_cache_usage_perc"]) == (0, 0)


# -- disconnects, metrics, load -----------------------------------------------------------


def test_client_disconnect_aborts_the_stream(server, monkeypatch):
    url, llm, _ = server
    slow_steps(monkeypatch, llm, 0.1)  # 100 tokens would take 10 s
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 100, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()  # keep a reference: a collected iterator closes the response
        next(lines)
        running = metrics(url)
        assert (running["vllm:num_requests_running"], running["vllm:kv_cache_usage_perc"] > 0) == (1, True)
    start = time.monotonic()
    m = wait_idle(url)
    assert (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"], m["vllm:kv_cache_usage_perc"]) == (0, 0, 0)
    assert time.monotonic() - start < 5.0  # aborted, not run to its end (10 s); a margin for a loaded machine


def test_non_streamed_client_disconnect_aborts_too(server, monkeypatch):
    url, llm, _ = server
    slow_steps(monkeypatch, llm, 0.1)  # 100 tokens would take 10 s
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=0.3)  # the client gives up after 0.3 s
    start = time.monotonic()
    m = wait_idle(url)
    assert (m["vllm:num_requests_running"], m["vllm:kv_cache_usage_perc"]) == (0, 0)
    assert time.monotonic() - start < 5.0  # the server noticed (it polls every 0.2 s), well before the 10 s run


def test_metrics_use_vllm_names(server, client):
    for _ in range(2):  # the second finds the first's prompt blocks in the prefix cache
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    m = metrics(server[0])
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count"):  # fmt: skip
        assert name in m, name
    assert m["vllm:time_to_first_token_seconds_count"] >= 1 and m["vllm:inter_token_latency_seconds_count"] >= 2
    assert 0 < m["vllm:prefix_cache_hits_total"] <= m["vllm:prefix_cache_queries_total"]
    text = httpx.get(server[0] + "/metrics").text
    assert f'vllm:num_requests_running{{model_name="{NAME}"}}' in text


WORDS = "alpha beta gamma delta return yield class def import while for if else lambda".split()


def load_requests(n: int, seed: int = 0) -> list[dict]:
    """``n`` requests: mixed small lengths, a third streamed, a tenth dropped mid-stream."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))
        kind = "drop" if i % 10 == 0 else ("stream" if i % 3 == 0 else "plain")
        out.append({"prompt": prompt, "max_tokens": rng.randint(1, 8), "kind": kind})
    return out


def test_load_32_clients_200_requests(server, offline):
    url = server[0]
    requests = load_requests(200)
    kept = [r for r in requests if r["kind"] != "drop"]
    refs = offline.generate([r["prompt"] for r in kept],
                            [SamplingParams(temperature=0, max_tokens=r["max_tokens"]) for r in kept], use_tqdm=False)  # fmt: skip
    want = {id(r): ref.outputs[0].text for r, ref in zip(kept, refs)}

    async def one(http: httpx.AsyncClient, r: dict):
        body = {"model": NAME, "prompt": r["prompt"], "max_tokens": r["max_tokens"], "temperature": 0}
        if r["kind"] == "plain":
            response = await http.post("/v1/completions", json=body)
            response.raise_for_status()
            return response.json()["choices"][0]["text"]
        body = {**body, "max_tokens": None, "ignore_eos": True} if r["kind"] == "drop" else body  # up to the context
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            response.raise_for_status()
            text = ""
            async for line in response.aiter_lines():
                if r["kind"] == "drop":
                    return None  # leave after the first event: the server must abort the request
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
            return text

    async def main():
        sem = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=32)) as http:
            async def bounded(r):
                async with sem:
                    return await one(http, r)

            return await asyncio.gather(*(bounded(r) for r in requests))

    start = time.monotonic()
    texts = asyncio.run(main())
    assert time.monotonic() - start < 120
    for r, text in zip(requests, texts):
        if r["kind"] != "drop":
            assert text == want[id(r)], r
    m = wait_idle(url)
    assert (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"], m["vllm:kv_cache_usage_perc"]) == (0, 0, 0)
    assert not server[1].engine.has_unfinished_requests()
