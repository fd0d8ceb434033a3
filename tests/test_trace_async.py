"""``tinyvllm trace --async-scheduling``: the step recorder when the next step is in flight.

Under async scheduling step N is read back after step N+1 was scheduled and launched, so its
snapshot holds N+1's advance (``trace/in_flight.py``). These tests run two prompts of the
shipped model through ``tinyvllm trace`` both ways and check that:

- every step is recorded and passes ``check_trace`` (before ``in_flight.py`` the recorder
  stopped at step 0: ``3 computed after a step of 2 from 0``);
- step 0's record names step 1 in flight, with the values worked out by hand below;
- the tokens are the synchronous run's, and its JSON carries none of the new fields;
- the step-in-flight invariants fail on a corrupted record, one fault at a time;
- the picture draws the step in flight and the placeholders, the synchronous one does not.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from tinyvllm import cli
from tinyvllm.trace import check_snapshot, check_trace
from tinyvllm.trace.command import run
from tinyvllm.trace.in_flight import NO_LAUNCH_NOTE, UNSEEN_LAUNCH_NOTE
from tinyvllm.trace.snapshot import Trace
from tinyvllm.trace.svg_runs import padding_timeline_svg
from tinyvllm.trace.svg_step import step_svg

PROMPTS = "import os\nThe cat sat\n"  # 2 and 5 tokens for the shipped model's tokenizer


def _trace(folder, *extra: str) -> Trace:
    folder.mkdir()
    (folder / "prompts.txt").write_text(PROMPTS, encoding="utf-8")
    argv = ["trace", "--prompts", str(folder / "prompts.txt"), "--max-tokens", "4", "--device", "cpu",
            "--max-model-len", "64", "--num-gpu-blocks-override", "16", "--block-size", "4",
            "--out", str(folder / "t.html"), "--json", str(folder / "t.json"), *extra]  # fmt: skip
    assert run(cli.build_parser().parse_args(argv), cli._check_engine_args, cli.llm_from_args) == 0
    return Trace.from_json((folder / "t.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    base = tmp_path_factory.mktemp("trace-async")
    return _trace(base / "async", "--async-scheduling"), _trace(base / "sync")


def _tokens(trace: Trace) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for step in trace.steps:
        for x in step.scheduler.scheduled:
            tokens.setdefault(x.request_id, []).extend(x.new_token_ids)
    return tokens


def test_async_trace_records_every_step_with_the_invariants_checked(traces, capsys):
    async_trace, sync_trace = traces
    assert "warning" not in capsys.readouterr().err
    check_trace(async_trace)
    # 1 prefill + 3 decodes, then the empty step launched while the last decode ran
    assert len(sync_trace.steps) == 4 and len(async_trace.steps) == 5
    assert [s.in_flight is not None for s in async_trace.steps] == [True, True, True, True, False]
    assert async_trace.steps[3].in_flight == () and async_trace.steps[3].scheduler.finished == ("0", "1")
    assert [s.note for s in async_trace.steps] == [UNSEEN_LAUNCH_NOTE, "", "", "", NO_LAUNCH_NOTE]
    assert _tokens(async_trace) == _tokens(sync_trace)
    assert [len(t) for t in _tokens(async_trace).values()] == [4, 4]


@pytest.mark.slow
def test_the_structured_outputs_workload_under_async_scheduling_equals_sync_step_by_step(tmp_path):
    """A constrained step launched while another is in flight has its sampling deferred
    (``structured_output/manager.py`` NOTE 7): the recorder still passes ``check_trace`` at
    every step, and each step's scheduled requests, tokens and allowed-token counts are the
    synchronous trace's."""
    pytest.importorskip("xgrammar")

    def trace(name: str, *extra: str) -> Trace:
        argv = ["trace", "--workload", "structured-outputs", "--json", str(tmp_path / f"{name}.json"),
                "--out", str(tmp_path / f"{name}.html"), *extra]  # fmt: skip
        assert run(cli.build_parser().parse_args(argv), cli._check_engine_args, cli.llm_from_args) == 0
        return Trace.from_json((tmp_path / f"{name}.json").read_text(encoding="utf-8"))

    def rows(t: Trace) -> list:
        return [[(x.request_id, x.num_tokens, x.new_token_ids, x.num_allowed_tokens, x.finish_reason)
                 for x in step.scheduler.scheduled] for step in t.steps]  # fmt: skip

    async_trace, sync_trace = trace("async", "--async-scheduling"), trace("sync")
    check_trace(async_trace)
    assert rows(async_trace) == rows(sync_trace)
    assert any(x.num_allowed_tokens for step in async_trace.steps for x in step.scheduler.scheduled)


def test_step_0_names_step_1_in_flight(traces):
    step = traces[0].steps[0]
    assert [(x.request_id, x.start, x.num_tokens, x.kind) for x in step.scheduler.scheduled] == [
        ("0", 0, 2, "prefill"), ("1", 0, 5, "prefill"),
    ]  # fmt: skip
    # step 1 computes the token step 0 sampled (position 2 and 5) and samples the next one
    assert [(x.request_id, x.start, x.num_tokens, x.kind, x.admitted) for x in step.in_flight] == [
        ("0", 2, 1, "decode", None), ("1", 5, 1, "decode", None),
    ]  # fmt: skip
    # computed = step 0's end + step 1's token; the placeholder is step 1's token, on the device only
    assert [(r.request_id, r.num_computed_tokens, r.num_tokens, r.num_output_placeholders) for r in step.requests] == [
        ("0", 3, 3, 1), ("1", 6, 6, 1),
    ]  # fmt: skip
    # the runner's parts are step 1's: two rows, two tokens, a slot per request at its step-1 position
    assert step.batch.rows == ("0", "1") and (step.dispatch.num_tokens, step.dispatch.num_reqs) == (2, 2)
    assert [(w.request_id, w.position, w.slot) for w in step.slots] == [("0", 2, 2), ("1", 5, 9)]  # blocks 0 and 2


def test_a_synchronous_trace_carries_no_step_in_flight(traces):
    sync_trace = traces[1]
    assert all(s.in_flight is None and all(r.num_output_placeholders == 0 for r in s.requests) for s in sync_trace.steps)
    text = sync_trace.to_json()
    assert "in_flight" not in text and "num_output_placeholders" not in text  # snapshot.py NOTE 4


def _corrupt_request(step, request_id, **changes):
    requests = tuple(dataclasses.replace(r, **changes) if r.request_id == request_id else r for r in step.requests)
    return dataclasses.replace(step, requests=requests)


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda s: _corrupt_request(s, "0", num_output_placeholders=0), r"request '0'.*0 placeholders, 3 of 3 computed"),
        (lambda s: _corrupt_request(s, "1", num_computed_tokens=5), r"request '1'.*5 computed, the step in flight ends at 6"),
        (lambda s: dataclasses.replace(s, in_flight=s.in_flight[:1]), r"scheduled '1': 6 computed after a step of 5 from 0"),
        (lambda s: dataclasses.replace(s, in_flight=None), r"scheduled '0': 3 computed after a step of 2 from 0"),  # the old error
        (lambda s: dataclasses.replace(s, in_flight=(dataclasses.replace(s.in_flight[0], start=3), s.in_flight[1])),
         r"scheduled '0': ends at 2, step N\+1 starts at 3"),
    ],
    ids=["placeholder-lost", "computed-short", "in-flight-request-lost", "in-flight-step-lost", "in-flight-start-off"],
)
def test_the_step_in_flight_invariants_fail_on_a_corrupted_record(traces, corrupt, message):
    trace = traces[0]
    step = trace.steps[0]
    check_snapshot(step, trace.block_size, trace.num_blocks)  # the record itself passes
    with pytest.raises(AssertionError, match=message):
        check_snapshot(corrupt(step), trace.block_size, trace.num_blocks)


def test_the_picture_draws_the_step_in_flight_and_the_placeholders(traces):
    async_trace, sync_trace = traces
    svg = step_svg(async_trace, 0)
    assert svg.count('data-role="in-flight-segment"') == 2
    assert svg.count("computed +1 placeholder") == 2
    assert "step 1, in flight: BatchUpdate" in svg and "step 1, in flight: runtime mode NONE" in svg
    assert "step 1, in flight: bold = its writes; one layer" in svg
    assert "an empty step: nothing scheduled" in step_svg(async_trace, 3)
    assert "in-flight" not in step_svg(sync_trace, 0) and "placeholder" not in step_svg(sync_trace, 0)
    # a snapshot's dispatch is its step in flight's: the padding timeline names that step
    # (step 0's own dispatch reached no snapshot: in_flight.py NOTE 3)
    assert re.findall(r">(step \d+)</text>", padding_timeline_svg(async_trace)) == ["step 1", "step 2", "step 3"]
    assert re.findall(r">(step \d+)</text>", padding_timeline_svg(sync_trace)) == ["step 0", "step 1", "step 2", "step 3"]
