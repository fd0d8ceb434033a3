"""Beam search served: ``AsyncLLM.beam_search`` against ``LLM.beam_search``, bad input
refused before the first step, a search whose consumer goes away, and the OpenAI server's
``use_beam_search`` through the ``openai`` client (the beams' texts in order, the usage, the
logprobs, a stream, every field the search cannot honour refused by name).

The tiny random Qwen3 rarely ends on its own EOS, so the module makes the likeliest
candidate token of a probe search an extra EOS (as ``test_beam_search.py`` does): beams
then finish with ``"stop"`` and finished beams of different lengths are ranked together.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter

import pytest

from serve_fixtures import CHAT_TEMPLATE, require_serve_extra, running_server, slow_steps
from tinyvllm import LLM
from tinyvllm.beam_search import BeamSearchParams
from tinyvllm.engine.async_llm import AsyncLLM

NAME = "tiny-beams"
TEXT = "def main():\n    return"
IDS = [(37 * i + 11) % 500 + 5 for i in range(9)]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a loop."}]


def make_llm(folder: str, **kw) -> LLM:
    return LLM(folder, **{"device": "cpu", "max_model_len": 64, "block_size": 4, **kw})


@pytest.fixture(scope="module")
def folder(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["qwen3"])


@pytest.fixture(scope="module")
def eos_extra(folder) -> int:
    """The likeliest candidate token of a probe search: made an EOS, beams end on it."""
    probe = make_llm(folder)
    found = probe.beam_search([TEXT, {"prompt_token_ids": IDS}], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
    seen = Counter(t for out in found for s in out.sequences for position in s.logprobs for t in position)
    return seen.most_common(1)[0][0]


def with_eos(llm: LLM, token: int) -> LLM:
    llm.engine.input_processor.extra_stop_token_ids = (token,)
    return llm


@pytest.fixture(scope="module")
def llm(folder, eos_extra) -> LLM:
    return with_eos(make_llm(folder), eos_extra)


async def collect(stream) -> list:
    return [out async for out in stream]


# -- AsyncLLM.beam_search ----------------------------------------------------------------------


def test_async_beam_search_returns_the_beams_of_llm_beam_search(llm, eos_extra):
    """Two searches at once on one AsyncLLM (a text prompt and salted token ids) give what
    ``LLM.beam_search`` gives for them: one finished output each, one completion per beam,
    best first, with its tokens (a final EOS kept), sum, logprobs, text and finish."""
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    prompts = [TEXT, {"prompt_token_ids": IDS, "cache_salt": "s1"}]
    expected = llm.beam_search(prompts, params)

    async def main():
        async_llm = AsyncLLM(llm.engine)
        try:
            return await asyncio.gather(*(collect(async_llm.beam_search(p, f"r{i}", params)) for i, p in enumerate(prompts)))
        finally:
            await async_llm.shutdown()

    got = asyncio.run(main())
    stops = 0
    for i, (want, outs) in enumerate(zip(expected, got)):
        (out,) = outs
        assert (out.request_id, out.finished, out.num_cached_tokens) == (f"r{i}", True, 0)
        prompt_ids = list(want.sequences[0].tokens[: want.sequences[0].num_prompt_tokens])
        assert out.prompt_token_ids == prompt_ids and out.prompt == (TEXT if i == 0 else None)
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert [c.token_ids for c in out.outputs] == [list(s.output_token_ids) for s in want.sequences]
        assert [c.cumulative_logprob for c in out.outputs] == pytest.approx([s.cum_logprob for s in want.sequences], abs=1e-5)
        assert [c.text for c in out.outputs] == [s.text for s in want.sequences]
        assert [(c.finish_reason, c.stop_reason) for c in out.outputs] == [(s.finish_reason, s.stop_reason) for s in want.sequences]
        for c, s in zip(out.outputs, want.sequences):
            assert [sorted(p) for p in c.logprobs] == [sorted(p) for p in s.logprobs]
            assert sum(p[t].logprob for p, t in zip(c.logprobs, c.token_ids)) == pytest.approx(c.cumulative_logprob)
            if c.finish_reason == "stop":
                stops += 1
                assert c.token_ids[-1] == c.stop_reason == eos_extra
        assert out.metrics.arrival_time <= out.metrics.first_token_time <= out.metrics.finished_time
    assert stops > 0, "no beam ended on the EOS: a weak test"
    assert not llm.engine.has_unfinished_requests()


def test_bad_input_is_refused_before_the_first_step(llm, monkeypatch):
    async def main():
        async_llm = AsyncLLM(llm.engine)
        calls = []
        monkeypatch.setattr(async_llm, "generate", lambda *a, **k: calls.append(a))
        cases = [
            (BeamSearchParams(beam_width=11, max_tokens=2), {"prompt_token_ids": IDS}, ValueError,
             "beam_width=11 needs 22 logprobs a step, more than the engine's max_logprobs 20"),
            (BeamSearchParams(beam_width=2, max_tokens=2), {"prompt_token_ids": list(range(5, 69))}, ValueError,
             "prompt 0 has 64 tokens: beam search needs room for one more within max_model_len 64"),
            (BeamSearchParams(beam_width=2, max_tokens=2), {"prompt_token_ids": []}, ValueError, "prompt 0 is empty"),
            (BeamSearchParams(beam_width=2, max_tokens=2), {"prompt_token_ids": [10**9]}, ValueError, "outside the vocabulary"),
            ({"beam_width": 2}, TEXT, TypeError, "params must be BeamSearchParams"),
        ]  # fmt: skip
        try:
            for params, prompt, error, match in cases:
                with pytest.raises(error, match=match):
                    await anext(async_llm.beam_search(prompt, "bad", params))
        finally:
            await async_llm.shutdown()
        return calls

    assert asyncio.run(main()) == []
    assert not llm.engine.has_unfinished_requests()


def test_a_search_cancelled_mid_way_leaves_no_request_in_the_engine(folder, monkeypatch):
    """One request runs at a time (``max_num_seqs=1``), so step 2's three requests
    (``c-beam-2-0`` to ``-2``) take turns and wait in the engine. The consumer is cancelled
    while two of them wait: those the step in flight does not finish are aborted, no later
    step adds a request, and the id can be used again at once."""
    llm = make_llm(folder, max_num_seqs=1)
    engine = llm.engine
    slow_steps(monkeypatch, llm, 0.01)
    added, aborted = [], []
    add, abort = engine.add_core_request, engine.abort_request
    monkeypatch.setattr(engine, "add_core_request", lambda request: added.append(request.request_id) or add(request))
    monkeypatch.setattr(engine, "abort_request", lambda ids: aborted.extend([ids] if isinstance(ids, str) else ids) or abort(ids))

    async def main():
        async_llm = AsyncLLM(engine)
        ids = lambda: async_llm.run_in_engine_thread(engine.unfinished_request_ids)  # noqa: E731
        try:
            params = BeamSearchParams(beam_width=3, max_tokens=40, ignore_eos=True)
            task = asyncio.ensure_future(anext(async_llm.beam_search({"prompt_token_ids": IDS}, "c", params)))
            seen = await ids()
            while len([r for r in seen if r.startswith("c-beam-2-")]) < 2:
                assert not task.done()
                await asyncio.sleep(0.002)
                seen = await ids()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            left = await ids()
            await asyncio.sleep(0.1)
            later = await ids()
            again = await collect(async_llm.beam_search({"prompt_token_ids": IDS}, "c", dataclasses.replace(params, max_tokens=2)))
            return seen, left, later, again
        finally:
            await async_llm.shutdown()

    seen, left, later, again = asyncio.run(main())
    waiting = {r for r in seen if r.startswith("c-beam-2-")}
    # at most one of those waiting ran in the step in flight at the cancel; the others were aborted
    assert len(waiting & set(aborted)) >= len(waiting) - 1 >= 1, (waiting, aborted)
    assert left == set() and later == set()
    assert not any(r.startswith("c-beam-3-") for r in added)
    assert len(again) == 1 and [len(c.token_ids) for c in again[0].outputs] == [2, 2, 2]
    engine.check_invariants()


# -- the OpenAI server ---------------------------------------------------------------------------


@dataclasses.dataclass
class Served:
    client: object
    url: str
    llm: LLM  # the served engine's
    app: object


@pytest.fixture(scope="module")
def served(folder, eos_extra):
    require_serve_extra()
    import openai

    llm = with_eos(make_llm(folder), eos_extra)
    with running_server(llm, NAME, chat_template=CHAT_TEMPLATE) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield Served(client, url, llm, app)


def chat_ids(llm: LLM, messages=MESSAGES) -> list[int]:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def test_completions_return_the_beams_of_llm_beam_search(served, llm):
    """Two prompts, width 3: six choices, each prompt's beams best first, with their finish
    reasons and logprobs (whose chosen tokens sum to the beam's sum); the usage counts each
    prompt once and every returned beam's tokens."""
    prompts = [TEXT, "class A:"]
    expected = [s for out in llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=6)) for s in out.sequences]
    out = served.client.completions.create(model=NAME, prompt=prompts, n=3, max_tokens=6, temperature=0, logprobs=3,
                                           extra_body={"use_beam_search": True})  # fmt: skip
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.text for c in out.choices] == [s.text for s in expected]
    assert [(c.finish_reason, c.model_extra["stop_reason"]) for c in out.choices] == [(s.finish_reason, s.stop_reason) for s in expected]
    assert {c.finish_reason for c in out.choices} == {"stop", "length"}, "a weak test: every beam ended alike"
    for c, s in zip(out.choices, expected):
        assert len(c.logprobs.tokens) == len(s.output_token_ids)
        assert sum(c.logprobs.token_logprobs) == pytest.approx(s.cum_logprob, abs=1e-4)
        assert all(2 <= len(top) <= 4 for top in c.logprobs.top_logprobs)
    prompt_tokens = sum(s.num_prompt_tokens for s in expected[::3])
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, sum(len(s.output_token_ids) for s in expected))


def test_chat_returns_the_beams_of_llm_beam_search(served, llm):
    ids = chat_ids(llm)
    (want,) = llm.beam_search({"prompt_token_ids": ids}, BeamSearchParams(beam_width=2, max_tokens=5))
    out = served.client.chat.completions.create(model=NAME, messages=MESSAGES, n=2, max_completion_tokens=5, temperature=0,
                                                logprobs=True, top_logprobs=2, extra_body={"use_beam_search": True})  # fmt: skip
    assert [c.message.content for c in out.choices] == [s.text for s in want.sequences]
    assert [c.finish_reason for c in out.choices] == [s.finish_reason for s in want.sequences]
    for c, s in zip(out.choices, want.sequences):
        assert len(c.logprobs.content) == len(s.output_token_ids)
        assert sum(item.logprob for item in c.logprobs.content) == pytest.approx(s.cum_logprob, abs=1e-4)
        assert all(len(item.top_logprobs) == 2 for item in c.logprobs.content)
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == sum(len(s.output_token_ids) for s in want.sequences)


def test_a_streamed_search_sends_the_beams_at_the_end(served, llm):
    (want,) = llm.beam_search(TEXT, BeamSearchParams(beam_width=2, max_tokens=4))
    chunks = list(served.client.completions.create(model=NAME, prompt=TEXT, n=2, max_tokens=4, temperature=0, stream=True,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"use_beam_search": True}))  # fmt: skip
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(2)]
    assert texts == [s.text for s in want.sequences]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [s.finish_reason for s in want.sequences]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(len(s.output_token_ids) for s in want.sequences)


def test_length_penalty_reaches_the_search(served, llm):
    """The plain sum (0) favours the short beams that ended on the EOS, a penalty of 2 the
    long ones: the two rank differently, and each answer is ``LLM.beam_search``'s."""
    texts = {}
    for penalty in (0.0, 2.0):
        (want,) = llm.beam_search(TEXT, BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=penalty))
        out = served.client.completions.create(model=NAME, prompt=TEXT, n=3, max_tokens=6, temperature=0,
                                               extra_body={"use_beam_search": True, "length_penalty": penalty})  # fmt: skip
        texts[penalty] = [c.text for c in out.choices]
        assert texts[penalty] == [s.text for s in want.sequences]
    assert texts[0.0] != texts[2.0], "length_penalty changed nothing on this prompt: a weak test"


def test_unset_fields_take_vllms_defaults(served, monkeypatch):
    """vLLM's ``to_beam_search_params``: an unset ``n`` is width 1, an unset temperature the
    model's default (the server's sampling defaults), an unset ``max_completion_tokens`` what
    the context leaves; ``ignore_eos`` and ``include_stop_str_in_output`` reach the params."""
    async_llm = served.app.state.serving.async_llm
    seen = []
    search = async_llm.beam_search
    monkeypatch.setattr(async_llm, "beam_search", lambda prompt, rid, params: seen.append((prompt, params)) or search(prompt, rid, dataclasses.replace(params, max_tokens=2)))
    served.client.chat.completions.create(model=NAME, messages=MESSAGES, extra_body={"use_beam_search": True, "ignore_eos": True,
                                                                                     "include_stop_str_in_output": True})  # fmt: skip
    [(prompt, params)] = seen
    default_temperature = served.app.state.serving.default_params.temperature
    room = 64 - len(prompt["prompt_token_ids"])
    assert params == BeamSearchParams(beam_width=1, max_tokens=room, ignore_eos=True, temperature=default_temperature,
                                      length_penalty=1.0, include_stop_str_in_output=True)  # fmt: skip


def test_values_that_ask_for_nothing_pass(served, llm):
    """Every refused field at the value that asks for nothing: the answer is the plain search's."""
    from tinyvllm.entrypoints.protocol import BEAM_SEARCH_REFUSED

    passing = {name: values[1] for name, values in BEAM_SEARCH_REFUSED.items() if len(values) > 1 and name != "tool_choice"}
    passing["response_format"] = {"type": "text"}
    (want,) = llm.beam_search(TEXT, BeamSearchParams(beam_width=2, max_tokens=3))
    out = served.client.completions.create(model=NAME, prompt=TEXT, n=2, max_tokens=3, temperature=0,
                                           extra_body={"use_beam_search": True, **passing})  # fmt: skip
    assert [c.text for c in out.choices] == [s.text for s in want.sequences]


# A value that asks for something, for every field beam search refuses (protocol.BEAM_SEARCH_REFUSED).
ASKS = {
    "top_p": 0.5, "top_k": 5, "min_p": 0.1, "seed": 1, "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "repetition_penalty": 1.2, "logit_bias": {"5": 1.0}, "stop": ["x"], "stop_token_ids": [5], "min_tokens": 2,
    "bad_words": ["x"], "allowed_token_ids": [5, 6], "prompt_logprobs": 1, "thinking_token_budget": 4, "echo": True,
    "skip_special_tokens": False, "vllm_xargs": {"k": 1}, "structured_outputs": {"regex": "a+"},
    "response_format": {"type": "json_object"}, "priority": 1, "tool_choice": "required",
}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
BAD = [
    *[(api, {field: value, **({"tools": TOOLS} if field == "tool_choice" else {})}, field, f"`{field}` is not supported with `use_beam_search`")
      for field, value in ASKS.items() for api in ("completions", "chat")
      if field not in ("tool_choice",) or api == "chat"],
    ("chat", {"tools": TOOLS}, "tool_choice", "`tool_choice` is not supported with `use_beam_search`"),
    ("completions", {"use_beam_search": False, "length_penalty": 0.5}, "length_penalty", "`length_penalty` needs `use_beam_search: true`"),
    ("chat", {"use_beam_search": None, "length_penalty": 2.0}, "length_penalty", "`length_penalty` needs `use_beam_search: true`"),
    ("completions", {"n": 11}, "n", "n=11 needs 22 logprobs a step, more than the engine's max_logprobs 20"),
    ("completions", {"n": 0}, "n", "n must be an int in [1, 16384], got 0"),
    ("completions", {"logprobs": 5}, "logprobs", "`logprobs` 5 is more than the 4 candidates"),
    ("chat", {"logprobs": True, "top_logprobs": 5}, "top_logprobs", "`top_logprobs` 5 is more than the 4 candidates"),
    ("completions", {"max_tokens": 0}, "max_tokens", "max_tokens"),
    ("completions", {"prompt": list(range(5, 69)), "max_tokens": None}, "prompt", "prompt 0 has 64 tokens: beam search needs room"),
]  # fmt: skip


@pytest.mark.parametrize("api, extra, param, message", BAD, ids=lambda v: v if isinstance(v, str) else None)
def test_what_beam_search_cannot_honour_is_a_400_naming_the_field(served, api, extra, param, message):
    import openai

    body = {"max_tokens": 3, "n": 2, "use_beam_search": True, **extra}
    if api == "completions":
        create = lambda: served.client.completions.create(model=NAME, prompt=body.pop("prompt", TEXT), extra_body=body)  # noqa: E731
    else:
        create = lambda: served.client.chat.completions.create(model=NAME, messages=MESSAGES, extra_body=body)  # noqa: E731
    with pytest.raises(openai.BadRequestError) as info:
        create()
    error = info.value.response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert not served.llm.engine.has_unfinished_requests()


def test_every_field_has_a_fate_under_beam_search():
    """A field beam search reads, one it refuses (``BEAM_SEARCH_REFUSED``, each with a value
    that asks for something in ``ASKS``), one refused anyway, or one about the prompt or
    the answer's form, which applies as to any request."""
    from tinyvllm.entrypoints.protocol import BEAM_SEARCH_REFUSED, INFORMATIONAL, REFUSED, ChatCompletionRequest, CompletionRequest

    assert set(ASKS) == set(BEAM_SEARCH_REFUSED)
    searched = {"use_beam_search", "n", "best_of", "max_tokens", "max_completion_tokens", "temperature", "ignore_eos",
                "length_penalty", "include_stop_str_in_output", "logprobs", "top_logprobs", "return_tokens_as_token_ids"}  # fmt: skip
    as_any = {"model", "prompt", "messages", "stream", "stream_options", "add_special_tokens", "truncate_prompt_tokens",
              "request_id", "cache_salt", "add_generation_prompt", "continue_final_message", "chat_template",
              "chat_template_kwargs", "documents", "tools", "parallel_tool_calls", "include_reasoning"}  # fmt: skip
    fates = [searched, as_any, set(BEAM_SEARCH_REFUSED), set(REFUSED), set(INFORMATIONAL)]
    assert sum(map(len, fates)) == len(set().union(*fates)), "a field with two fates"
    assert set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) == set().union(*fates)


def test_a_client_that_leaves_mid_search_leaves_no_request_in_the_engine(served, monkeypatch):
    """Steps of 20 ms, 40 tokens of width 3 asked, the client gone after 0.5 s: the server
    cancels the search and aborts its requests; no step runs afterwards."""
    import httpx

    steps = []
    runner = served.llm.engine.model_runner
    execute = runner.execute_model
    monkeypatch.setattr(runner, "execute_model", lambda out: steps.append(out) or time.sleep(0.02) or execute(out))
    body = {"model": NAME, "prompt": TEXT, "n": 3, "max_tokens": 40, "ignore_eos": True, "use_beam_search": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", json=body, timeout=0.5)
    deadline, ran = time.monotonic() + 5, -1
    while ran != len(steps) and time.monotonic() < deadline:  # until no step has run for 0.5 s
        ran = len(steps)
        time.sleep(0.5)
    assert not served.app.state.serving.async_llm.call_in_engine_thread(served.llm.engine.unfinished_request_ids)
    assert 3 < ran == len(steps) < 40  # the whole search takes at least 40
