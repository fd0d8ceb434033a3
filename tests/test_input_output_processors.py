"""The input and output processors on their own (``engine/input_processor.py``,
``engine/output_processor.py``): a request is checked once, by the input processor, into a
frozen ``EngineCoreRequest``; the output processor turns core outputs into ``RequestOutput``s
and hands a stop string back to the engine instead of touching the scheduler."""

from __future__ import annotations

import dataclasses

import pytest

from tinyvllm.engine.input_processor import EngineCoreRequest, InputProcessor
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.models.tokenizer import load_tokenizer
from tinyvllm.outputs import EngineCoreOutput
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams


def test_llm_takes_exactly_the_engine_args_with_their_defaults():
    """``LLM(...)``'s parameters are ``EngineArgs``' fields, same names, same defaults, so that
    ``LLM``, ``AsyncLLM.from_engine_args`` and the CLI cannot drift apart."""
    import inspect

    from tinyvllm import LLM
    from tinyvllm.engine.engine_args import EngineArgs

    params = {name: p.default for name, p in inspect.signature(LLM.__init__).parameters.items() if name != "self"}
    fields = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    assert params == fields


def _processor(**kw) -> InputProcessor:
    return InputProcessor(None, 0, vocab_size=512, max_model_len=10, **kw)


def test_the_input_processor_refuses_empty_and_too_long_prompts_with_the_messages_the_scheduler_gave():
    processor = _processor()
    with pytest.raises(ValueError, match=r"request 'long': prompt of 11 tokens is longer than max_model_len 10"):
        processor.process_token_ids("long", range(11), SamplingParams())
    with pytest.raises(ValueError, match=r"request 'empty': the prompt is empty \(prompt_token_ids=\[\]\)"):
        processor.process_token_ids("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        processor.process_inputs("r", {"prompt_token_ids": []}, SamplingParams())
    with pytest.raises(ValueError, match="prompt 2 has 11 tokens, more than max_model_len 10"):
        processor.process_inputs("r", {"prompt_token_ids": list(range(11))}, SamplingParams(), index=2)


def test_the_input_processor_returns_a_frozen_request_with_the_models_extra_eos_as_stop_tokens():
    processor = _processor(extra_stop_token_ids=(7,))
    request = processor.process_inputs("r", {"prompt_token_ids": [1, 2, 3], "cache_salt": "s"}, SamplingParams(stop_token_ids=[5]))
    assert isinstance(request, EngineCoreRequest)
    assert (request.request_id, request.prompt, request.prompt_token_ids, request.cache_salt) == ("r", None, (1, 2, 3), "s")
    assert request.sampling_params.stop_token_ids == (5, 7)
    assert request.bad_words_token_ids == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.prompt_token_ids = (4,)
    ignoring = processor.process_inputs("r", {"prompt_token_ids": [1]}, SamplingParams(stop_token_ids=[5], ignore_eos=True))
    assert ignoring.sampling_params.stop_token_ids == (5,)


def test_a_request_for_n_completions_is_checked_once_and_named_by_its_first_child():
    processor = _processor()
    with pytest.raises(ValueError, match=r"request '0_x': bad_words=.*'a'.* needs a tokenizer"):
        processor.process_token_ids("x", [1], SamplingParams(n=2, bad_words=["a"]))
    with pytest.raises(TypeError, match="request_id must be a non-empty str, got 5"):
        processor.process_token_ids(5, [1], SamplingParams())


def test_the_output_processor_checks_that_each_linked_child_has_a_state():
    from tinyvllm.engine.parallel_sampling import ParentRequest

    processor = OutputProcessor(None)
    parent = ParentRequest("x", SamplingParams(n=2))
    children = [parent.child_id(0), parent.child_id(1)]
    for index, child in enumerate(children):
        processor.add_request(child, None, [1], parent.child_params(index))
    processor.add_parent(parent, children)
    processor.check_invariants()
    assert processor.unfinished_request_ids() == {"x"} and processor.sequences("x") == children
    del processor.request_states["1_x"]  # behind its back
    with pytest.raises(AssertionError, match="'1_x' of 'x' is linked but has no state"):
        processor.check_invariants()


def test_the_output_processor_returns_a_stop_string_for_the_engine_to_finish(tiny_model_dirs):
    tokenizer = load_tokenizer(tiny_model_dirs["qwen3"])
    processor = OutputProcessor(tokenizer)
    ids = tokenizer.encode("ab cd ef", add_special_tokens=False)
    stop = tokenizer.decode(ids[1:2])
    params = SamplingParams(stop=[stop], output_kind=RequestOutputKind.DELTA)
    processor.add_request("r", None, [1, 2], params)
    outputs, stopped = processor.process_outputs([EngineCoreOutput("r", ids[:1])])
    assert stopped == [] and [o.finished for o in outputs] == [False]
    outputs, stopped = processor.process_outputs([EngineCoreOutput("r", ids[1:2])])
    assert stopped == ["r"], "a stop string is the engine's to finish in the scheduler"
    [output] = outputs
    assert output.finished and output.outputs[0].finish_reason == "stop" and output.outputs[0].stop_reason == stop
    assert processor.request_states == {} and processor.unfinished_request_ids() == set()
