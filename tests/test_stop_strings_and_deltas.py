"""Stop strings, ``include_stop_str_in_output`` and the DELTA / CUMULATIVE outputs of
``LLMEngine.step()`` on a tiny random model (greedy, so every run writes the same text)."""

from __future__ import annotations

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.sampling_params import RequestOutputKind

ENGINE = dict(device="cpu", max_model_len=96, block_size=4)
PROMPT = "def main():\n    return"
MAX_TOKENS = 16


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(str(tiny_model_dirs["qwen3"]), **ENGINE)


@pytest.fixture(scope="module")
def reference(llm):
    """The prompt's greedy output with no stop string: its text and token ids."""
    [out] = llm.generate(PROMPT, greedy(), use_tqdm=False)
    return out.outputs[0]


def split_stop(llm, completion) -> tuple[str, int]:
    """A 2-character stop string that straddles two tokens, and the token that completes it.

    Picks the first token boundary with clean text on both sides whose 2 characters do not
    occur earlier in the text, so the first occurrence is the one across the boundary."""
    tok = llm.get_tokenizer()
    ids, text = completion.token_ids, completion.text
    for k in range(1, len(ids)):
        head = tok.decode(ids[:k], skip_special_tokens=True)
        b = len(head)
        if not (text.startswith(head) and 0 < b < len(text)):
            continue
        stop = text[b - 1 : b + 1]
        if "\ufffd" in stop or text.find(stop) != b - 1 or len(tok.decode(ids[k : k + 1])) < 1:
            continue
        tail = tok.decode(ids[: k + 1], skip_special_tokens=True)
        if len(tail) > b:  # token k adds the second character
            return stop, k + 1
    raise AssertionError(f"the greedy text {text!r} has no clean boundary between two tokens")


def test_stop_string_split_across_tokens_cuts_the_text(llm, reference):
    stop, num_tokens = split_stop(llm, reference)
    [out] = llm.generate(PROMPT, greedy(stop=[stop]), use_tqdm=False)
    completion = out.outputs[0]
    index = reference.text.find(stop)
    assert completion.text == reference.text[:index]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert completion.token_ids == reference.token_ids[:num_tokens]  # stopped at the token that completed it


def test_include_stop_str_in_output_keeps_the_stop_string(llm, reference):
    stop, _ = split_stop(llm, reference)
    [out] = llm.generate(PROMPT, greedy(stop=stop, include_stop_str_in_output=True), use_tqdm=False)
    index = reference.text.find(stop)
    assert out.outputs[0].text == reference.text[: index + len(stop)]
    assert out.outputs[0].stop_reason == stop


def test_a_stop_string_that_never_appears_changes_nothing(llm, reference):
    absent = "\x00never\x00"
    [out] = llm.generate(PROMPT, greedy(stop=[absent]), use_tqdm=False)
    assert out.outputs[0].text == reference.text
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("length", None)


@pytest.mark.parametrize("after", [0, 1], ids=["min-tokens-ends-at-the-stop", "min-tokens-ends-after-it"])
def test_stop_strings_wait_for_min_tokens(llm, reference, after):
    """As vLLM: a stop string counts only if it ends in the text of an output token after
    the first ``min_tokens``; one that the ``min_tokens``-th token completes does not."""
    stop, num_tokens = split_stop(llm, reference)
    [out] = llm.generate(PROMPT, greedy(stop=[stop], min_tokens=num_tokens + after), use_tqdm=False)
    first_end = reference.text.find(stop) + len(stop)
    assert out.outputs[0].text.startswith(reference.text[:first_end])  # the first occurrence was not searched
    assert len(out.outputs[0].token_ids) > num_tokens
    if reference.text.count(stop) == 1:
        assert out.outputs[0].text == reference.text and out.outputs[0].finish_reason == "length"


# -- a stop token's text (vLLM's detokenizer: ``update(..., stop_terminated)``) ----------------


def stop_token(reference) -> tuple[int, int]:
    """A token of the greedy output, after its first, whose first occurrence is where it
    stops; and how many tokens the output then has."""
    ids = reference.token_ids
    token = next(t for t in ids[2:] if t != ids[0] and t != ids[1])
    return token, ids.index(token) + 1


def text_of(llm, token_ids) -> str:
    from tinyvllm.engine.detokenizer import decode_text

    return decode_text(llm.get_tokenizer(), token_ids, True)


@pytest.mark.parametrize("stream", [False, True], ids=["decoded-at-the-end", "incremental"])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_keeps_its_id_but_not_its_text(llm, reference, stream, include):
    """As vLLM: a request stopped by one of its ``stop_token_ids`` reports the token's id,
    but its text leaves the token out unless ``include_stop_str_in_output``. Both ways the
    engine detokenises: once at the end, and every step (stop strings, streaming)."""
    token, num_tokens = stop_token(reference)
    extra = dict(stop=["\x00never\x00"]) if stream else {}
    [out] = llm.generate(PROMPT, greedy(stop_token_ids=[token], include_stop_str_in_output=include, **extra),
                         use_tqdm=False)
    completion = out.outputs[0]
    ids = reference.token_ids[:num_tokens]
    assert completion.token_ids == ids
    assert (completion.finish_reason, completion.stop_reason) == ("stop", token)
    assert completion.text == text_of(llm, ids if include else ids[:-1])
    assert text_of(llm, ids) != text_of(llm, ids[:-1])  # the token has text to leave out


def test_streamed_deltas_never_send_a_stop_tokens_text(llm, reference):
    token, num_tokens = stop_token(reference)
    outputs = _run_engine(llm, greedy(stop_token_ids=[token], output_kind=RequestOutputKind.DELTA), "delta-stop-token")
    ids = reference.token_ids[:num_tokens]
    assert "".join(o.outputs[0].text for o in outputs) == text_of(llm, ids[:-1])
    assert [t for o in outputs for t in o.outputs[0].token_ids] == ids


def test_eos_text_is_left_out_even_with_special_tokens_shown(llm):
    """``skip_special_tokens=False`` shows special tokens in the text, but not the EOS that
    ended the request (vLLM's ``stop_terminated``); with ``ignore_eos`` it is an ordinary token."""
    tok = llm.get_tokenizer()
    eos = llm.engine.eos_token_id
    forced = dict(temperature=0, max_tokens=3, logit_bias={eos: 100.0}, skip_special_tokens=False)
    [stopped] = llm.generate(PROMPT, SamplingParams(**forced), use_tqdm=False)
    assert (stopped.outputs[0].token_ids, stopped.outputs[0].finish_reason) == ([eos], "stop")
    assert stopped.outputs[0].text == ""
    [kept] = llm.generate(PROMPT, SamplingParams(**forced, ignore_eos=True), use_tqdm=False)
    assert kept.outputs[0].text == tok.decode([eos] * 3, skip_special_tokens=False) != ""


def test_a_short_stop_string_inside_the_min_tokens_text_is_not_found(llm, reference):
    """Each stop string looks back ``len(stop) - 1`` characters into text already searched
    (or held back by ``min_tokens``), not the longest stop string's: a short one that lies
    wholly in the first ``min_tokens`` tokens' text is not found when a long one is given too."""
    from tinyvllm.engine.detokenizer import decode_text

    tok, ids, text = llm.get_tokenizer(), reference.token_ids, reference.text
    long_stop = "\x00" * 12  # never in the text; it only lengthens the look-back
    for m in range(2, len(ids) - 1):
        head = decode_text(tok, ids[:m], True)
        short = head[-3:-1]  # ends one character before the min_tokens text does
        if len(short) == 2 and "\ufffd" not in head and text.startswith(head) and text.rfind(short) + 2 < len(head):
            break
    else:
        raise AssertionError(f"the greedy text {text!r} has no short string to test with")
    [out] = llm.generate(PROMPT, greedy(stop=[short, long_stop], min_tokens=m), use_tqdm=False)
    assert (out.outputs[0].text, out.outputs[0].finish_reason) == (text, "length")


# -- detokenize=False (vLLM's SamplingParams.detokenize) -----------------------------------


@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA])
def test_detokenize_false_returns_the_tokens_and_no_text(llm, reference, monkeypatch, kind):
    """As vLLM: the same token ids, an empty text, logprobs without their tokens' text, and
    no call to the tokenizer's decode at all (what a throughput benchmark wants)."""
    engine = llm.engine
    monkeypatch.setattr(engine.tokenizer, "decode", lambda *a, **k: pytest.fail("decode was called"))
    engine.add_request(f"no-text-{kind.name}", llm.get_tokenizer()(PROMPT).input_ids,
                       greedy(detokenize=False, logprobs=1, output_kind=kind))  # fmt: skip
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [t for o in outputs for t in o.outputs[0].token_ids] == reference.token_ids
    assert all(o.outputs[0].text == "" for o in outputs)
    entries = [lp for o in outputs for lp in o.outputs[0].logprobs]
    assert len(entries) == MAX_TOKENS and all(x.decoded_token is None for e in entries for x in e.values())


def test_detokenize_false_refuses_stop_strings():
    with pytest.raises(ValueError, match=r"stop=\('x',\) needs detokenize=True"):
        SamplingParams(stop="x", detokenize=False)
    with pytest.raises(TypeError, match="detokenize must be a bool, got 0"):
        SamplingParams(detokenize=0)


def test_stopped_request_frees_its_blocks(llm, reference):
    stop, _ = split_stop(llm, reference)
    llm.generate(PROMPT, greedy(stop=[stop]), use_tqdm=False)
    scheduler = llm.engine.scheduler
    assert not scheduler.has_unfinished_requests()
    held = [b for b in scheduler.kv_cache_manager.block_pool.blocks if b.ref_cnt > 0]
    assert held == []


def _run_engine(llm, params: SamplingParams, request_id: str):
    llm.engine.add_request(request_id, llm.get_tokenizer()(PROMPT).input_ids, params, prompt=PROMPT)
    outputs = []
    while llm.engine.has_unfinished_requests():
        outputs += [o for o in llm.engine.step() if o.request_id == request_id]
    return outputs


def test_delta_outputs_join_to_the_final_output(llm, reference):
    outputs = _run_engine(llm, greedy(output_kind=RequestOutputKind.DELTA), "delta-1")
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert len(outputs) == MAX_TOKENS  # one output per decoded token: one token per step
    assert "".join(o.outputs[0].text for o in outputs) == reference.text
    assert [t for o in outputs for t in o.outputs[0].token_ids] == reference.token_ids
    assert outputs[-1].outputs[0].finish_reason == "length"


def test_cumulative_outputs_grow_to_the_final_output(llm, reference):
    outputs = _run_engine(llm, greedy(output_kind=RequestOutputKind.CUMULATIVE), "cumulative-1")
    texts = [o.outputs[0].text for o in outputs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, MAX_TOKENS + 1))
    assert texts[-1] == reference.text and outputs[-1].finished


def test_delta_with_stop_string_never_sends_the_stop_string(llm, reference):
    stop, _ = split_stop(llm, reference)
    outputs = _run_engine(llm, greedy(stop=[stop], output_kind=RequestOutputKind.DELTA), "delta-stop")
    sent = ""
    for o in outputs:
        sent += o.outputs[0].text
        assert stop not in sent and reference.text.startswith(sent)
    assert sent == reference.text[: reference.text.find(stop)]
    assert (outputs[-1].outputs[0].finish_reason, outputs[-1].outputs[0].stop_reason) == ("stop", stop)


def test_default_step_reports_only_finished_requests(llm):
    outputs = _run_engine(llm, greedy(), "final-1")
    assert len(outputs) == 1 and outputs[0].finished


def test_generate_returns_final_outputs_even_for_delta_params(llm, reference):
    [out] = llm.generate(PROMPT, greedy(output_kind=RequestOutputKind.DELTA), use_tqdm=False)
    assert out.finished and out.outputs[0].text == reference.text


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(stop=5), TypeError, "stop must be a str"),
        (dict(stop=["ok", 3]), TypeError, "stop must hold strs, got 3"),
        (dict(stop=[""]), ValueError, "non-empty, got ['']"),
        (dict(include_stop_str_in_output=1), TypeError, "include_stop_str_in_output must be a bool, got 1"),
        (dict(output_kind=1), TypeError, "output_kind must be a RequestOutputKind, got 1"),
    ],
)
def test_new_fields_are_validated(kwargs, error, words):
    with pytest.raises(error) as info:
        SamplingParams(**kwargs)
    assert words in str(info.value)


def test_a_single_stop_string_becomes_a_tuple():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=None).stop == ()


def test_stop_strings_need_a_tokenizer(llm):
    from tinyvllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(llm.engine.scheduler, llm.engine.model_executor, tokenizer=None)
    with pytest.raises(ValueError, match="needs text"):
        engine.add_request("no-tok", [5, 6, 7], greedy(stop=["a"]))
    assert not llm.engine.scheduler.has_unfinished_requests()  # nothing was queued


# -- issue 23: streamed text with a Llama-2-style tokenizer (SentencePiece, Strip decoder) -----


@pytest.fixture(scope="module")
def spm_llm(tmp_path_factory):
    from tinyvllm.models.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp("llama2_tok"), "llama", tokenizer="llama2")
    return LLM(str(folder), **ENGINE)


@pytest.mark.parametrize("prompt", ["def main():\n    return", "import os\nclass Parser:", "x = 1\n"])
def test_streamed_text_keeps_its_spaces_with_a_sentencepiece_tokenizer(spm_llm, prompt):
    from tinyvllm.engine.detokenizer import decode_text

    tok = spm_llm.get_tokenizer()  # favour words that start with a space ("▁def"): the case to get right
    words = [i for t, i in sorted(tok.get_vocab().items()) if t.startswith("▁") and len(t) > 2][:40]
    params = dict(temperature=0, max_tokens=24, ignore_eos=True, logit_bias=dict.fromkeys(words, 8.0))
    [final] = spm_llm.generate(prompt, SamplingParams(**params), use_tqdm=False)
    text, token_ids = final.outputs[0].text, final.outputs[0].token_ids
    assert text == decode_text(tok, token_ids)
    assert " " in text, f"the greedy text {text!r} has no space to lose"
    engine = spm_llm.engine
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        engine.add_request(kind.name, engine.tokenizer.encode(prompt), SamplingParams(**params, output_kind=kind))
    streamed = {"DELTA": "", "CUMULATIVE": ""}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "DELTA":
                streamed["DELTA"] += out.outputs[0].text
            else:
                streamed["CUMULATIVE"] = out.outputs[0].text
    assert streamed == {"DELTA": text, "CUMULATIVE": text}


@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA])
def test_skip_special_tokens_false_keeps_special_tokens_in_the_text(llm, kind):
    """``<|endoftext|>`` (id 0) is a special token: skipped by default, kept on request."""
    tok = llm.get_tokenizer()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    texts = {}
    for skip in (True, False):
        params = greedy(logit_bias={eos: 100.0}, skip_special_tokens=skip, output_kind=kind)
        engine = llm.engine
        engine.add_request(f"s{skip}{kind.name}", tok.encode(PROMPT), params)
        text = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = text + out.outputs[0].text if kind == RequestOutputKind.DELTA else out.outputs[0].text
        texts[skip] = text
    assert "<|endoftext|>" not in texts[True] and texts[False].count("<|endoftext|>") == MAX_TOKENS
