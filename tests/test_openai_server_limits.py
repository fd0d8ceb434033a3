"""The server at its edges: a request that can never fit the waiting bound, engine messages in
the request's own words, the per-request phase times and the per-step token histogram of
``/metrics``, and a shutdown (SIGTERM) that drains for at most ``shutdown_timeout`` seconds.

Issue 36 item 11: each test here failed before its fix (a 503 "try again later" on an idle
server, ``sampling_params.logprobs`` and "seed 001 ch. 11.4" in a client's error, no
``vllm:request_*_time_seconds`` or ``vllm:iteration_tokens_total``, a SIGTERM that waited
for a chat without ``max_tokens`` to reach the context).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from serve_fixtures import CHAT_TEMPLATE, free_port, require_serve_extra, running_server, slow_steps, wait_until_healthy

require_serve_extra()  # without the serve extra (the GPU machine) this module skips at collection

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.config import SpeculativeConfig  # noqa: E402
from tinyvllm.engine.async_llm import AsyncLLM  # noqa: E402
from tinyvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402

NAME = "tiny-qwen3"
ENGINE = dict(device="cpu", max_model_len=128, block_size=4)
PROMPT = "def main():\n    return"
MESSAGES = [{"role": "user", "content": "Write a loop."}]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folder(tiny_model_dirs):
    return str(tiny_model_dirs["qwen3"])


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


IN_ENGINE = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def samples(url: str) -> dict[str, float]:
    """``/metrics`` as ``{sample name: value}``, histogram buckets left out."""
    text = httpx.get(url + "/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if "le" not in s.labels and "finished_reason" not in s.labels}  # fmt: skip


# -- the waiting bound: a request that can never fit is a 400 -------------------------------------------


@pytest.fixture(scope="module")
def bounded(folder):
    """An idle server that queues at most two sequences."""
    llm = LLM(folder, **ENGINE)
    with running_server(llm, NAME, max_waiting_requests=2, chat_template=CHAT_TEMPLATE) as (url, _):
        yield url, llm


@pytest.mark.parametrize(
    "endpoint, body, param, words",
    [
        ("completions", {"prompt": ["a", "b", "c"]}, "prompt", "3 prompts"),
        ("completions", {"prompt": PROMPT, "n": 3}, "n", "n=3"),
        ("completions", {"prompt": ["a", "b"], "n": 2}, "n", "2 prompts x n=2"),
        ("chat", {"messages": MESSAGES, "n": 3}, "n", "n=3"),
    ],
)
def test_a_request_that_can_never_fit_the_waiting_bound_is_a_400(bounded, endpoint, body, param, words):
    """On an idle server with ``max_waiting_requests=2``: retrying could never succeed, so it
    is not a 503 "try again later" but a 400 naming the field, and nothing is queued."""
    url, llm = bounded
    before = samples(url)["vllm:prompt_tokens_total"]
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    error = error_of(httpx.post(url + path, json={"model": NAME, "max_tokens": 2, **body}), 400)
    assert error["param"] == param and words in error["message"], error
    assert "max_waiting_requests 2" in error["message"], error
    assert samples(url)["vllm:prompt_tokens_total"] == before  # nothing ran
    assert not llm.engine.has_unfinished_requests()


def test_a_request_of_exactly_the_bound_is_served(bounded):
    url = bounded[0]
    fits = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": ["a", "b"], "max_tokens": 2})
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 2
    chat = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": MESSAGES, "max_tokens": 2, "n": 2})
    assert chat.status_code == 200 and len(chat.json()["choices"]) == 2


def test_n_counts_against_the_waiting_bound(folder, monkeypatch):
    """``n`` sequences wait as ``n`` requests: with one of two places taken, ``n=2`` is a 503
    (it could fit later), ``n=1`` is served."""
    llm = LLM(folder, max_num_seqs=1, **ENGINE)  # one sequence runs, the others wait
    # 10 ms a step or more: the running request outlasts the n=2 request's admission by far on
    # any machine (else the waiting one may start first and leave room for n=2, as once in CI)
    slow_steps(monkeypatch, llm, 0.01)

    async def main(url):
        long = {"model": NAME, "prompt": PROMPT, "max_tokens": 110, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            first = await http.send(http.build_request("POST", "/v1/completions", json=long), stream=True)
            second = asyncio.create_task(http.post("/v1/completions", json={**long, "stream": False}))
            while samples(url)["vllm:num_requests_waiting"] < 1:
                await asyncio.sleep(0.02)
            two = await http.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 2, "n": 2})
            await first.aclose()
            await second
            return two

    with running_server(llm, NAME, max_waiting_requests=2) as (url, _):
        two = asyncio.run(main(url))
        error = error_of(two, 503)
        assert error["type"] == "ServiceUnavailableError" and "try again later" in error["message"]


def test_async_llm_refuses_n_past_the_bound_as_a_value_error(folder):
    async def main():
        engine = AsyncLLM(LLM(folder, **ENGINE).engine, max_waiting_requests=2)
        try:
            with pytest.raises(ValueError, match=r"n=3 .*max_waiting_requests 2"):
                async for _ in engine.generate(PROMPT, SamplingParams(n=3, max_tokens=2), "r"):
                    pass
            return engine.engine.has_unfinished_requests()
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) is False


# -- engine messages in the request's words ------------------------------------------------------------


@pytest.fixture(scope="module")
def server(folder):
    with running_server(LLM(folder, **ENGINE), NAME, chat_template=CHAT_TEMPLATE) as (url, app):
        yield url, app


@pytest.mark.parametrize(
    "endpoint, body, param, words",
    [
        ("chat", {"logprobs": True, "top_logprobs": 50}, "top_logprobs", "top_logprobs=50, more than"),
        ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "top_logprobs=-1 (the whole vocabulary"),
        ("chat", {"max_completion_tokens": 4, "min_tokens": 9}, "min_tokens", "[0, max_completion_tokens=4]"),
        ("completions", {"logprobs": 50}, "logprobs", "logprobs=50, more than"),
        ("completions", {"prompt_logprobs": 50}, "prompt_logprobs", "prompt_logprobs=50, more than"),
        ("completions", {"logit_bias": {"9999": 1}}, "logit_bias", "logit_bias has token id 9999"),
        ("completions", {"allowed_token_ids": [9999]}, "allowed_token_ids", "allowed_token_ids has token id 9999"),
    ],
)
def test_engine_messages_name_the_request_field(server, endpoint, body, param, words):
    """The ``SamplingParams`` field behind the engine's message is renamed to the request field
    the client sent (chat's ``top_logprobs`` is ``SamplingParams.logprobs``), in ``param`` and
    in the message, and no internal name (``sampling_params``) is left."""
    base = {"model": NAME, "prompt": PROMPT} if endpoint == "completions" else {"model": NAME, "messages": MESSAGES}
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    error = error_of(httpx.post(server[0] + path, json={**base, "max_tokens": 4, **body}), 400)
    assert error["param"] == param and words in error["message"], error
    assert "sampling_params" not in error["message"], error


def test_speculative_refusals_name_the_field_and_no_source_document(folder):
    llm = LLM(folder, speculative_config=SpeculativeConfig(2), **ENGINE)
    with running_server(llm, NAME) as (url, _):
        for field, value in (("min_p", 0.1), ("logit_bias", {"5": 1.0})):
            body = {"model": NAME, "prompt": PROMPT, "max_tokens": 2, field: value}
            error = error_of(httpx.post(url + "/v1/completions", json=body), 400)
            assert error["param"] == field, error
            assert error["message"].startswith(f"{field} cannot be used with speculative decoding"), error
            assert "seed" not in error["message"] and "sampling_params" not in error["message"], error
    with pytest.raises(ValueError, match=r"^sampling_params: min_p cannot be used with speculative decoding"):
        llm.generate(PROMPT, SamplingParams(min_p=0.1, max_tokens=2), use_tqdm=False)  # offline: the params' name


# -- /metrics: the phases of a request and the tokens of a step --------------------------------------------


def test_phase_histograms_and_iteration_tokens_are_scraped(server):
    """One request of 5 tokens on an idle engine takes 5 steps: its prompt, then 4 decoding
    steps of one token; the decode time is its engine's first token to its end."""
    url = server[0]
    text = httpx.get(url + "/metrics").text
    for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:iteration_tokens_total"):  # fmt: skip
        assert f"# TYPE {name} histogram" in text, name
    before = samples(url)
    prompt = "class Unique:\n    value = 7\n"  # no block of it is cached yet
    body = {"model": NAME, "prompt": prompt, "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    out = httpx.post(url + "/v1/completions", json=body).json()
    after = samples(url)

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("vllm:iteration_tokens_total_count") == 5
    assert delta("vllm:iteration_tokens_total_sum") == out["usage"]["prompt_tokens"] + 4
    assert delta("vllm:request_decode_time_seconds_count") == 1
    assert delta("vllm:request_queue_time_seconds_count") == 1  # the engine records the first scheduling
    assert delta("vllm:request_prefill_time_seconds_count") == 1
    assert 0 < delta("vllm:request_prefill_time_seconds_sum") <= delta("vllm:time_to_first_token_seconds_sum")
    assert 0 < delta("vllm:request_decode_time_seconds_sum") < delta("vllm:e2e_request_latency_seconds_sum")


def test_a_served_engine_can_be_traced_while_its_steps_are_counted(folder):
    """The server's metrics and a trace observe the same engine side by side: ``record`` of the
    server's ``AsyncLLM`` (built, added and removed in the engine's thread, between two steps)
    records every step while ``vllm:iteration_tokens_total`` counts them all.
    Once the server stops its metrics leave the engine, so a second server on the same engine
    counts its steps (the first server's observer held the engine's one hook for good)."""
    from tinyvllm.trace import check_trace, record

    llm = LLM(folder, **ENGINE)
    body = {"model": NAME, "prompt": "class Traced:\n", "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    threads = []  # where the recorder was added and removed: the engine's thread, between two steps
    add, remove = llm.engine.add_observer, llm.engine.remove_observer
    llm.engine.add_observer = lambda o: (threads.append(threading.current_thread().name), add(o))[1]
    llm.engine.remove_observer = lambda o: (threads.append(threading.current_thread().name), remove(o))[1]
    with running_server(llm, NAME) as (url, app):
        metrics = app.state.serving.metrics
        assert llm.engine.observers == (metrics,)
        before = samples(url)
        with record(app.state.serving.async_llm, title="served") as t:
            out = httpx.post(url + "/v1/completions", json=body).json()
        after = samples(url)
        assert llm.engine.observers == (metrics,), "the trace's block must remove only the recorder"
    assert len(threads) == 4 and all(name.startswith("tinyvllm-engine") for name in threads[1:3]), threads
    assert after["vllm:iteration_tokens_total_count"] - before["vllm:iteration_tokens_total_count"] == 3
    assert len(t.trace.steps) == 3 and t.error is None
    recorded = sum(x.num_tokens for s in t.trace.steps for x in s.scheduler.scheduled)
    counted = after["vllm:iteration_tokens_total_sum"] - before["vllm:iteration_tokens_total_sum"]
    assert recorded == counted == out["usage"]["prompt_tokens"] + 2
    check_trace(t.trace)
    assert llm.engine.observers == (), "a stopped server's metrics must leave the engine"
    with running_server(llm, NAME) as (url, app):
        before = samples(url)
        httpx.post(url + "/v1/completions", json=body)
        assert samples(url)["vllm:iteration_tokens_total_count"] - before["vllm:iteration_tokens_total_count"] == 3


def test_phase_times_come_from_the_engine_timestamps(server):
    """Queue = scheduled - arrival, prefill = first token - scheduled, decode = finished - first
    token (vLLM's definitions), read from the finished output's ``RequestMetrics``."""
    from tinyvllm.entrypoints.metrics import RequestTracker

    metrics = server[1].state.serving.metrics
    names = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds")

    def sums() -> list[float]:
        families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
        return [next(s.value for s in families[n].samples if s.name.endswith("_sum")) for n in names]

    before = sums()
    tracker = RequestTracker(metrics, 1, arrival=time.perf_counter())
    done = CompletionOutput(0, "x", [5], "length")
    timing = RequestMetrics(arrival_time=10.0, first_token_time=10.75, finished_time=12.0, scheduled_time=10.25)
    tracker.output(RequestOutput("r", None, [1, 2], [done], True, 0, timing))
    assert [round(b - a, 6) for a, b in zip(before, sums())] == [0.25, 0.5, 1.25]


# -- shutdown: drain for at most shutdown_timeout, then abort -----------------------------------------------

SERVER_SCRIPT = """
import sys, time
from tinyvllm import LLM
from tinyvllm.entrypoints.openai_server import run_server
llm = LLM(sys.argv[1], device="cpu", max_model_len=256, block_size=4)
runner = llm.engine.model_runner
execute = runner.execute_model
def slow(scheduler_output):  # a step of 0.05 s: a chat to the end of the context takes over 10 s
    time.sleep(0.05)
    return execute(scheduler_output)
runner.execute_model = slow
llm.get_tokenizer().chat_template = {template!r}
run_server(llm, "tiny", "127.0.0.1", int(sys.argv[2]), shutdown_timeout=float(sys.argv[3]))
"""


@pytest.mark.slow  # a server process of its own: about 6 s on two cores
def test_sigterm_drains_for_at_most_the_shutdown_timeout(folder):
    """A chat without ``max_tokens`` would run to the context (over 10 s); after SIGTERM a short
    request still finishes ("length"), and at the 1 s deadline the chat is aborted: its stream
    ends with ``finish_reason: "abort"`` and ``[DONE]``, and the process ends (by the signal).
    The banner names the model, ``max_model_len`` and the KV cache before the first request."""
    port = free_port()
    script = SERVER_SCRIPT.format(template=CHAT_TEMPLATE)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-c", script, folder, str(port), "1"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, lambda: proc.poll() is None, 120, proc.stdout.read)
        chunks, short = [], {}
        body = {"model": "tiny", "messages": MESSAGES, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    chunks.append(line[6:])
                    break
            thread = threading.Thread(target=lambda: short.update(httpx.post(url + "/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}).json()))  # fmt: skip
            thread.start()
            # The short request is in the engine before the signal: polled, not a fixed sleep,
            # which a busy machine outlasted (the request then met a closed port). Its 8 tokens
            # may also all come between two polls: then its answer is in, and it counts too.
            deadline = time.monotonic() + 30
            while not short and sum(v for k, v in samples(url).items() if k in IN_ENGINE) < 2:
                assert time.monotonic() < deadline, "the short request never reached the engine"
                time.sleep(0.02)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            chunks.extend(line[6:] for line in lines if line.startswith("data: "))
            ended = time.monotonic() - sent
        thread.join(30)
        assert proc.wait(timeout=30) == -signal.SIGTERM  # uvicorn raises the signal again once it is done
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = proc.stdout.read()
    assert short["choices"][0]["finish_reason"] == "length" and short["usage"]["completion_tokens"] == 8
    assert chunks[-1] == "[DONE]"
    reasons = [json.loads(c)["choices"][0]["finish_reason"] for c in chunks[:-1] if json.loads(c)["choices"]]
    assert reasons[-1] == "abort" and reasons.count(None) == len(reasons) - 1
    assert 0.9 < ended < 8, ended  # the deadline, not the context's end
    banner = [line for line in output.splitlines() if line.startswith("[tinyvllm]")]
    assert any("'tiny'" in line and f"http://127.0.0.1:{port}/v1" in line for line in banner), output
    assert any("max_model_len 256" in line and "blocks of 4 tokens" in line for line in banner), output
    assert any("shutdown_timeout 1 s" in line for line in banner), output
    assert "aborted 1 request" in output, output
