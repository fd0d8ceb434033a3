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
from tinyvllm.trace.in_flight import LAUNCHED_NOTE, NO_LAUNCH_NOTE, UNSEEN_LAUNCH_NOTE
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
    # step 0's launch, then 1 prefill + 3 decodes read back, then the empty step launched while
    # the last decode ran
    assert len(sync_trace.steps) == 4 and len(async_trace.steps) == 6
    assert [s.label for s in async_trace.steps] == ["step 0: launched", "step 0", "step 1", "step 2", "step 3", "step 4"]
    assert [s.launched for s in async_trace.steps] == [True, False, False, False, False, False]
    assert [s.in_flight is not None for s in async_trace.steps] == [True, True, True, True, True, False]
    assert async_trace.steps[4].in_flight == () and async_trace.steps[4].scheduler.finished == ("0", "1")
    assert [s.note for s in async_trace.steps] == [LAUNCHED_NOTE, "", "", "", "", NO_LAUNCH_NOTE]
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


def test_step_0s_launch_has_a_picture_of_its_own(traces):
    """The first step after idle is read back only with the next call, whose launch replaces its
    runner parts: the recorder pictures it at its launch (in_flight.py NOTE 3)."""
    step = traces[0].steps[0]
    assert step.scheduler.scheduled == () and step.scheduler.running == ("0", "1") and step.scheduler.finished == ()
    assert [(x.request_id, x.start, x.num_tokens, x.kind, x.admitted) for x in step.in_flight] == [
        ("0", 0, 2, "prefill", "new"), ("1", 0, 5, "prefill", "new"),
    ]  # fmt: skip
    # computed = step 0's end; the placeholder is step 0's sampled token, on the device only
    assert [(r.request_id, r.num_computed_tokens, r.num_output_placeholders) for r in step.requests] == [("0", 2, 1), ("1", 5, 1)]
    # the runner's parts are step 0's own: its two rows added, its 7 tokens, a slot per prompt token
    assert step.batch.previous_rows == () and step.batch.rows == ("0", "1") and step.batch.added == ((0, "0"), (1, "1"))
    assert (step.dispatch.num_tokens, step.dispatch.num_reqs) == (7, 2)
    assert [(w.request_id, w.position) for w in step.slots] == [("0", 0), ("0", 1), *(("1", p) for p in range(5))]
    # the next picture, step 0's read-back, takes the runner's own BatchUpdate from these rows
    assert traces[0].steps[1].batch.previous_rows == ("0", "1") and traces[0].steps[1].note == ""


def test_step_0_names_step_1_in_flight(traces):
    step = traces[0].steps[1]
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
    assert "in_flight" not in text and "num_output_placeholders" not in text and "launched" not in text  # snapshot.py NOTE 4
    assert Trace.from_json(traces[0].to_json()) == traces[0] and traces[0].to_json().count('"launched": true') == 1


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
    step = trace.steps[1]  # step 0's read-back, step 1 in flight
    check_snapshot(step, trace.block_size, trace.num_blocks)  # the record itself passes
    with pytest.raises(AssertionError, match=message):
        check_snapshot(corrupt(step), trace.block_size, trace.num_blocks)


def test_the_picture_draws_the_step_in_flight_and_the_placeholders(traces):
    async_trace, sync_trace = traces
    svg = step_svg(async_trace, 1)
    assert svg.count('data-role="in-flight-segment"') == 2
    assert svg.count("computed +1 placeholder") == 2
    # step 1 keeps step 0's rows (the BatchUpdate that added them is in step 0's launch picture)
    assert "step 1, in flight: no change" in svg and "step 1, in flight: runtime mode NONE" in svg
    assert "step 1, in flight: bold = its writes; one layer" in svg
    launch = step_svg(async_trace, 0)
    assert "step 0, in flight: BatchUpdate" in launch and "step 0 just launched, nothing read back yet" in launch
    assert "an empty step: nothing scheduled" in step_svg(async_trace, 4)
    assert "in-flight" not in step_svg(sync_trace, 0) and "placeholder" not in step_svg(sync_trace, 0)
    # a snapshot's dispatch is its step in flight's: the padding timeline names that step,
    # step 0's from its launch picture (in_flight.py NOTE 3)
    assert re.findall(r">(step \d+)</text>", padding_timeline_svg(async_trace)) == ["step 0", "step 1", "step 2", "step 3"]
    assert re.findall(r">(step \d+)</text>", padding_timeline_svg(sync_trace)) == ["step 0", "step 1", "step 2", "step 3"]


def test_each_launch_after_idle_is_pictured_and_a_recording_begun_mid_flight_says_what_it_missed():
    """Two ``generate`` calls in one recording: the engine is idle between them, so each first
    launch gets its picture and no snapshot falls back to the net change. A recording begun
    while a step is in flight never saw that launch: its first picture says so (NOTE 3)."""
    from tinyvllm import LLM, SamplingParams
    from tinyvllm.trace import record
    from tinyvllm.trace.workloads import tiny_model_folder

    llm = LLM(tiny_model_folder(), device="cpu", max_model_len=32, block_size=4, num_gpu_blocks_override=16,
              async_scheduling=True)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with record(llm) as t:
        first = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0].token_ids
        second = llm.generate({"prompt_token_ids": [9, 10]}, params, use_tqdm=False)[0].outputs[0].token_ids
    check_trace(t.trace)
    labels = [s.label for s in t.trace.steps]
    assert labels.count("step 0: launched") == 1 and sum(label.endswith(": launched") for label in labels) == 2
    assert UNSEEN_LAUNCH_NOTE not in [s.note for s in t.trace.steps]
    recorded = [x.new_token_ids for s in t.trace.steps for x in s.scheduler.scheduled if x.new_token_ids]
    assert [tok for ids in recorded for tok in ids] == [*first, *second]

    engine = llm.engine
    engine.add_request("late", [11, 12, 13], params)
    assert engine.step() == [] and len(engine.steps_in_flight()) == 1  # launched before the recording
    with record(llm) as late:
        while engine.has_unfinished_requests():
            engine.step()
    check_trace(late.trace)
    assert late.trace.steps[0].note == UNSEEN_LAUNCH_NOTE and not any(s.launched for s in late.trace.steps)


@pytest.mark.slow
def test_async_speculation_is_recorded_with_its_placeholder_drafts(tiny_model_dirs):
    """``recorder.py`` NOTE 8, ``invariants.py`` NOTE 4: under async scheduling with n-gram
    drafts, preemptions, chunked prefill, prefix hits and a grammar, every snapshot passes the
    invariants, the tokens are the synchronous trace's, the runner says how many drafts each
    row ran (fewer than its placeholders where the n-gram search found fewer), and the
    pictures call the drafts placeholders and say how many the runner proposed."""
    from tinyvllm import LLM, SamplingParams
    from tinyvllm.sampling_params import StructuredOutputsParams
    from tinyvllm.trace import record

    loop = [5, 6, 7, 8, 9, 10] * 3
    prompts = [loop, list(range(20, 40)) * 2, [7, 300, 12, 44, 7, 300], loop[:9] + [99, 98, 97], list(range(3, 35))]
    grammar = StructuredOutputsParams(regex="[a-c]{3}(-[0-9]{2})+")
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, structured_outputs=grammar if i == 1 else None)
              for i in range(len(prompts))]  # fmt: skip
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    traces, tokens = {}, {}
    for async_scheduling in (False, True):
        llm = LLM(str(tiny_model_dirs["qwen3"]), device="cpu", max_model_len=64, block_size=4, max_num_batched_tokens=16,
                  max_num_seqs=4, num_gpu_blocks_override=24, speculative_config=spec, async_scheduling=async_scheduling)  # fmt: skip
        llm.engine.structured_output_manager.compile(grammar).result(timeout=60)
        with record(llm, title="async speculation") as rec:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert rec.error is None, rec.error
        check_trace(rec.trace)
        traces[async_scheduling], tokens[async_scheduling] = rec.trace, [o.outputs[0].token_ids for o in outs]
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert tokens[True] == tokens[False]
    trace = traces[True]
    assert Trace.from_json(trace.to_json()) == trace and '"drafts_run"' not in traces[False].to_json()
    placeholders = {(s.index, x.request_id): x.num_draft_tokens for s in trace.steps for x in s.in_flight or ()}
    ran = {(s.index, rid): k for s in trace.steps for rid, k in s.drafts_run}
    assert ran and ran.keys() == {key for key, k in placeholders.items() if k and key[0] in {i for i, _ in ran}}
    assert any(k < placeholders[key] for key, k in ran.items()) and any(k == placeholders[key] for key, k in ran.items())
    pictures = "".join(step_svg(trace, i) for i in range(len(trace.steps)))
    assert "placeholder drafts" in pictures and "runs its own drafts in place of the placeholders" in pictures
    assert re.search(r"placeholder drafts, and the runner verified the \d it proposed: kept \d", pictures)
    assert "placeholder" not in "".join(step_svg(traces[False], i) for i in range(len(traces[False].steps)))

    # The runner's count checked, and two faults the bounds of the previous version let through
    # (a dispatch between the tokens run and those scheduled, a row written at its scheduled
    # start instead of where step N's kept tokens end): the checks are exact now.
    def fails(step, match: str, **changes) -> None:
        with pytest.raises(AssertionError, match=match):
            check_snapshot(dataclasses.replace(step, **changes), trace.block_size, trace.num_blocks, trace.steps[step.index - 1])

    step = next(st for st in trace.steps if st.dispatch and st.scheduler and any(k < placeholders[st.index, rid]
                                                                                  for rid, k in st.drafts_run))  # fmt: skip
    rid = next(rid for rid, k in step.drafts_run if k < placeholders[step.index, rid])
    d = dataclasses.replace(step.dispatch, num_tokens=step.dispatch.num_tokens + 1, padded_num_tokens=step.dispatch.num_tokens + 1)
    fails(step, "dispatch of", dispatch=d, slots=())  # a token more than the runner ran, fewer than scheduled
    fails(step, "dispatch of", drafts_run=tuple((r, n + 1 if r == rid else n) for r, n in step.drafts_run))  # one it never ran
    past = placeholders[step.index, rid] + 1  # more than its placeholders
    fails(step, "drafts run", drafts_run=tuple((r, past if r == rid else n) for r, n in step.drafts_run))
    fails(step, "the runner ran drafts", drafts_run=tuple((r, n) for r, n in step.drafts_run if r != rid))  # a row unsaid

    def rejected(st, request_id):  # step N's drafts not kept, of a request that runs on
        y = next((y for y in st.scheduler.scheduled if y.request_id == request_id), None)
        return 0 if y is None or not y.num_draft_tokens else y.num_draft_tokens - len(y.new_token_ids) + 1

    # a row written where it was scheduled, not where step N's kept tokens end (its slots as the table says)
    step, x = next((st, x) for st in trace.steps if st.slots and st.in_flight for x in st.in_flight
                   if st.request(x.request_id) and rejected(st, x.request_id))  # fmt: skip
    table, bs = step.request(x.request_id).block_ids, trace.block_size
    late = [dataclasses.replace(w, position=w.position + rejected(step, x.request_id)) for w in step.slots if w.request_id == x.request_id]
    late = [dataclasses.replace(w, slot=table[w.position // bs] * bs + w.position % bs) for w in late]
    fails(step, "wrote positions", slots=(*(w for w in step.slots if w.request_id != x.request_id), *late))


@pytest.mark.slow
def test_a_request_preempted_while_its_last_token_is_in_flight_may_have_left_when_the_step_is_read_back(tiny_model_dirs):
    """Step 3 is scheduled before step 2 is read back, and preempts ``4``, whose only token
    (``max_tokens`` 1) step 2 computes; step 2's read-back then finishes ``4``. So when step 3
    is read back, the request it preempted has left the engine (found by random traces)."""
    from tinyvllm import LLM, SamplingParams
    from tinyvllm.sampling_params import StructuredOutputsParams
    from tinyvllm.trace import record

    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 31, 85], [5, 6, 7, 8, 5, 6, 7, 131, 199, 283, 57], [5, 6, 115, 213, 148, 98, 204, 86],
               [5, 6, 7, 8, 232, 69, 72, 5, 7], [5, 6, 7, 8, 5, 90, 153], [20, 21, 22, 23, 24, 109, 98, 105, 201, 157]]  # fmt: skip
    grammar = StructuredOutputsParams(regex="[a-c]{3}(-[0-9]{2})+")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, structured_outputs=grammar if i in (2, 5) else None)
              for i, n in enumerate([1, 6, 9, 10, 1, 11])]  # fmt: skip
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(str(tiny_model_dirs["qwen3"]), device="cpu", max_model_len=48, block_size=4, max_num_batched_tokens=64,
              max_num_seqs=4, num_gpu_blocks_override=16, enable_prefix_caching=False, speculative_config=spec,
              async_scheduling=True)  # fmt: skip
    llm.engine.structured_output_manager.compile(grammar).result(timeout=60)
    with record(llm, title="preempted, then finished") as rec:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert rec.error is None, rec.error
    check_trace(rec.trace)
    left = [(s.index, rid) for s in rec.trace.steps if s.scheduler for rid in s.scheduler.preempted if s.request(rid) is None]
    assert left, "no request was preempted after its last token was scheduled"

