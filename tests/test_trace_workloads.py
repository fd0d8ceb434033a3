"""The built-in trace workloads draw the documents' own examples, with the documents' values.

Each workload's snapshots are compared with what its source says: seed 002 §3.2 (as
``tutorials/01_prefix_caching.py`` prints it), seed 004 "Duplication", seed 001 appendix
U2, tutorial 02's table (``docs/generated/02_scheduler.txt``), tutorial 07's dispatch
(padding to a capture size), and seed 003's slot arithmetic. Every trace also passes
``check_trace`` and survives a JSON round trip.
"""

from __future__ import annotations

import re

import pytest
from trace_fixtures import workload_trace

from tinyvllm.trace import check_trace
from tinyvllm.trace.snapshot import BatchMove, Trace
from tinyvllm.trace.svg_parts import tokens_text
from tinyvllm.trace.workloads import WORKLOADS


def _by_label(trace: Trace):
    return {s.label: s for s in trace.steps}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_workload_passes_its_invariants_and_round_trips_through_json(name):
    trace = workload_trace(name)
    assert len(trace.steps) >= 4, f"{name}: only {len(trace.steps)} steps"
    check_trace(trace)
    assert Trace.from_json(trace.to_json()) == trace


@pytest.mark.seed("002:3.2")
def test_seed002_trace_shows_the_documents_figures_step_by_step():
    trace = workload_trace("seed002-prefix-caching")
    steps = _by_label(trace)
    assert list(steps) == ["before step 0", "step 0", "step 3", "step 4", "step 5", "step 5 (cont.)", "step 6"]
    assert (trace.block_size, trace.num_blocks) == (4, 10)
    assert steps["before step 0"].free_queue == tuple(range(10))

    def table(step: str, rid: str) -> tuple[int, ...]:
        return steps[step].request(rid).block_ids

    def cache(step: str) -> dict[str, tuple[int, ...]]:
        s = steps[step]
        return {tokens_text(trace, s.blocks[ids[0]].hash_tokens): ids for _, ids in s.hash_map}

    assert table("step 0", "req0") == (0, 1, 2, 3) and steps["step 0"].free_queue == (4, 5, 6, 7, 8, 9)
    assert cache("step 0") == {"ABCD": (0,), "EFGH": (1,), "IJKL": (2,)}
    assert [(w.position, w.slot) for w in steps["step 0"].slots] == [(p, p) for p in range(15)]
    assert table("step 3", "req0") == (0, 1, 2, 3, 4) and cache("step 3")["MNOP"] == (3,)
    assert [(w.position, w.slot) for w in steps["step 3"].slots] == [(15, 15), (16, 16)]  # P into block 3, Q into 4
    assert table("step 4", "req1") == (0, 1, 5, 6)
    assert [steps["step 4"].blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    assert steps["step 5"].free_queue == (7, 8, 9, 4, 3, 2)
    assert steps["step 5 (cont.)"].free_queue == (7, 8, 9, 4, 3, 2, 6, 5, 1, 0)
    assert table("step 6", "req2") == (0, 1, 2, 7, 8, 9, 4, 3)
    assert steps["step 6"].free_queue == (6, 5)
    assert cache("step 6") == {
        "ABCD": (0,), "EFGH": (1,), "IJKL": (2,), "IJkl": (5,),
        "0 1 2 3": (7,), "4 5 6 7": (8,), "8 9 10 11": (9,), "12 13 14 15": (4,),
    }  # fmt: skip
    # req2 wrote its 17 new tokens, positions 12..28, into blocks 7 8 9 4 3
    assert [w.slot for w in steps["step 6"].slots] == [*range(28, 40), *range(16, 20), 12]


@pytest.mark.seed("004:duplication")
def test_seed004_trace_caches_one_content_in_blocks_3_and_4():
    steps = _by_label(workload_trace("seed004-duplication"))
    assert list(steps) == ["Time 1", "Time 2", "Time 3", "Time 4", "Time 5", "Time 6"]

    def tables(time: str) -> dict[str, tuple[tuple[int, ...], int]]:
        return {r.request_id: (r.block_ids, r.num_computed_tokens) for r in steps[time].requests}

    assert tables("Time 1") == {"req1": ((0, 1, 2, 3), 62)}  # block 3: 14/16
    assert tables("Time 2") == {"req1": ((0, 1, 2, 3), 63), "req2": ((0, 1, 2, 4), 62)}
    admitted = steps["Time 2"].scheduler.scheduled[-1]
    assert (admitted.request_id, admitted.num_hit_tokens, admitted.new_block_ids) == ("req2", 48, (0, 1, 2, 4))
    assert tables("Time 3") == {"req2": ((0, 1, 2, 4), 63)}
    assert steps["Time 3"].scheduler.finished == ("req1",) and steps["Time 3"].free_queue[-1] == 3
    four = steps["Time 4"]
    assert tables("Time 4") == {"req2": ((0, 1, 2, 4), 64)}
    duplicates = [ids for _, ids in four.hash_map if len(ids) > 1]
    assert duplicates == [(3, 4)], four.hash_map
    assert four.blocks[3].block_hash == four.blocks[4].block_hash and four.blocks[3].hash_tokens == four.blocks[4].hash_tokens
    five = steps["Time 5"]
    req3 = next(x for x in five.scheduler.scheduled if x.request_id == "req3")
    assert (req3.num_hit_tokens, five.request("req3").block_ids[:4]) == (64, (0, 1, 2, 3))  # the first: block 3
    assert five.request("req2").block_ids[:4] == (0, 1, 2, 4)
    assert 4 in steps["Time 6"].free_queue and dict(steps["Time 6"].hash_map)[four.blocks[3].block_hash] == (3, 4)


@pytest.mark.seed("001:U2")
def test_seed001_trace_fills_the_lowest_hole_then_condenses():
    trace = workload_trace("seed001-condense")
    batches = [s.batch for s in trace.steps]
    assert batches[0].rows == tuple(f"r{i}" for i in range(8)) and len(batches[0].added) == 8
    one = batches[1]  # U2.2: rows 7, 3, 5 leave; A takes hole 3; condense moves 6 -> 5
    assert one.removed == (7, 5) and one.added == ((3, "A"),)
    assert one.moved == (BatchMove(6, 5, "UNIDIRECTIONAL"),)
    assert one.rows_before_moves() == ("r0", "r1", "r2", "A", "r4", None, "r6", None)
    assert one.rows == ("r0", "r1", "r2", "A", "r4", "r6")
    two = batches[2]
    assert two.removed == (2, 1) and not two.added
    assert two.moved == (BatchMove(5, 1, "UNIDIRECTIONAL"), BatchMove(4, 2, "UNIDIRECTIONAL"))
    assert two.rows == ("r0", "r6", "r4", "A")
    assert batches[3].added == ((4, "B"), (5, "C")) and not batches[3].moved
    assert batches[4].moved == (BatchMove(0, 3, "SWAP"),) and batches[4].rows == ("A", "r6", "r4", "r0", "B", "C")
    assert not batches[5].changed and batches[5].rows == batches[4].rows


@pytest.mark.seed("002:opening")
def test_scheduler_trace_matches_tutorial_02s_table():
    trace = workload_trace("scheduler-preemption")
    rows = []
    for s in trace.steps:
        d = s.scheduler
        tokens = " ".join(f"{x.request_id}:{x.num_tokens}{'*' if x.kind == 'chunk' else ''}" for x in d.scheduled)
        hits = " ".join(f"{x.request_id}:{x.num_hit_tokens}" + (" resumed" if x.admitted == "resumed" else "")
                        for x in d.scheduled if x.admitted)  # fmt: skip
        rows.append((tokens, " ".join(d.running) or "-", " ".join(d.waiting) or "-", s.num_free_blocks, hits or "-",
                     " ".join(d.preempted) or "-", " ".join(d.finished) or "-"))  # fmt: skip
    assert rows == [  # docs/generated/02_scheduler.txt, column by column
        ("A:10*", "A", "B", 7, "A:0", "-", "-"),
        ("A:2 B:8*", "A B", "-", 5, "B:0", "-", "-"),
        ("A:1 B:2 C:3", "A B C", "-", 2, "C:8", "-", "-"),
        ("A:1 B:1 C:1", "A B C", "-", 2, "-", "-", "-"),
        ("A:1 B:1 C:1", "A B C", "-", 1, "-", "-", "-"),
        ("A:1 B:1 C:1", "A B C", "-", 0, "-", "-", "-"),
        ("A:1 B:1", "B", "C", 6, "-", "C", "A"),
        ("B:1 C:3", "C", "-", 6, "C:12 resumed", "-", "B"),
        ("C:1", "-", "-", 10, "-", "-", "C"),
    ]
    assert all(s.scheduler.tokens_used <= 10 for s in trace.steps)
    assert [x.kind for x in trace.steps[2].scheduler.scheduled] == ["decode", "prefill", "prefill"]


def test_priority_trace_shows_the_victim_taken_back_out_of_its_step():
    """scheduler-priority: `low` (priority 5) is scheduled its last chunk in step 2 and then
    preempted for `urgent`; the block that chunk would have filled leaves the prefix cache."""
    trace = workload_trace("scheduler-priority")
    two = trace.steps[2]
    d = two.scheduler
    assert [(x.request_id, x.num_tokens) for x in d.scheduled] == [("urgent", 1)] and d.preempted == ("low",)
    assert d.waiting == ("low",) and d.running == ("urgent",)
    assert {r.request_id: r.priority for r in two.requests} == {"low": 5, "urgent": 0}
    cached = {ids[0] for _, ids in two.hash_map}
    assert cached == {0, 1, 2, 3, 4, 5}  # low's 0-3 (written by steps 0 and 1) and urgent's prompt: not block 6
    assert two.request("urgent").block_ids == (4, 5, 6)  # low's dropped-chunk block, now urgent's
    back = trace.steps[7].scheduler.scheduled[0]
    assert (back.request_id, back.admitted, back.num_hit_tokens) == ("low", "resumed", 12)
    assert trace.steps[-1].scheduler.finished == ("low",)


def test_beam_search_trace_shows_each_step_computing_past_its_parents_full_blocks():
    """beam-search: a 7-token prompt, width 2, block size 4. Each step's beams are new
    one-token requests that finish in the step; each finds its parent's full blocks in the
    prefix cache and computes only the tokens past them."""
    trace = workload_trace("beam-search")
    got = [[(x.request_id, x.num_tokens, x.admitted, x.num_hit_tokens) for x in s.scheduler.scheduled] for s in trace.steps]
    assert got == [
        [("0", 7, "new", 0)],  # the prompt
        [("1", 4, "new", 4), ("2", 4, "new", 4)],  # 8 tokens: block 0 hit, the second block computed
        [("3", 1, "new", 8), ("4", 1, "new", 8)],  # 9: the parent's two full blocks hit
        [("5", 2, "new", 8), ("6", 2, "new", 8)],  # 10: the parent (9 tokens) filled only two
    ]
    assert [s.scheduler.finished for s in trace.steps] == [("0",), ("1", "2"), ("3", "4"), ("5", "6")]
    assert len(trace.steps[1].hash_map) == 3  # block 0, and each beam's own second block


def test_embeddings_trace_shows_a_chunked_prompt_and_a_last_pooling_prefix_hit():
    """embeddings: a pooling engine, LAST, block size 4, budget 8. A (10 tokens) is chunked
    8 + 2 and finishes with the step that ends its prompt; B (11, A's first 8) hits them; C
    (14, nothing shared) is chunked 8 + 6."""
    trace = workload_trace("embeddings")
    got = [[(x.request_id, x.num_tokens, x.admitted, x.num_hit_tokens) for x in s.scheduler.scheduled] for s in trace.steps]
    assert got == [[("A", 8, "new", 0)], [("A", 2, None, 0), ("B", 3, "new", 8)], [("C", 8, "new", 0)], [("C", 6, None, 0)]]
    assert [s.scheduler.finished for s in trace.steps] == [(), ("A", "B"), (), ("C",)]
    # the step that ends a prompt is a prefill that made a vector, though it sampled no token
    assert [x.kind for s in trace.steps for x in s.scheduler.scheduled] == ["chunk", "prefill", "prefill", "chunk", "prefill"]


@pytest.mark.seed("000:dispatcher")
def test_cuda_graphs_trace_pads_prefills_piecewise_and_decodes_full():
    trace = workload_trace("cuda-graphs-padding")
    got = [
        (d.runtime_mode, d.num_tokens, d.num_reqs, d.padded_num_tokens, d.padded_num_reqs, d.num_padding_tokens)
        for d in (s.dispatch for s in trace.steps)
    ]
    assert got == [
        ("PIECEWISE", 8, 1, 8, None, 0),  # A's first chunk
        ("PIECEWISE", 8, 2, 8, None, 0),  # A's last 3 and B's 5
        ("PIECEWISE", 5, 3, 8, None, 3),  # two decodes and C's 3: padded to 8
        ("FULL", 3, 3, 4, 4, 1),  # three decodes: the uniform key (4, 4), one padded request
        ("FULL", 2, 2, 2, 2, 0),
        ("FULL", 2, 2, 2, 2, 0),
    ]
    assert all(s.dispatch.capture_sizes == (1, 2, 4, 8) for s in trace.steps)
    assert trace.steps[4].batch.rows == ("C", "B")  # A left: condense moved C into row 0


@pytest.mark.seed("003:memory")
def test_kv_slots_trace_writes_each_token_at_block_times_size_plus_offset():
    trace = workload_trace("seed003-kv-slots")
    s0, s1, s2 = trace.steps[:3]
    assert {r.request_id: r.block_ids for r in s0.requests} == {"A": (0, 1), "B": (2,)}
    assert [(w.request_id, w.position, w.slot) for w in s0.slots] == [("A", p, p) for p in range(6)] + [("B", 0, 8), ("B", 1, 9)]
    assert sorted((w.request_id, w.slot) for w in s1.slots) == [("A", 6), ("B", 10), ("B", 11), ("B", 12)]
    c = next(x for x in s2.scheduler.scheduled if x.request_id == "C")
    assert (c.admitted, c.num_hit_tokens, s2.request("C").block_ids) == ("new", 4, (0, 4))  # A's block 0 is a hit
    assert [(w.position, w.slot) for w in s2.slots if w.request_id == "C"] == [(4, 16)]  # nothing into the hit block
    assert s2.blocks[0].ref_cnt == 1 and s2.request("C").num_cached_blocks == 1


def test_spec_decode_trace_draws_drafts_kept_and_rejected():
    """Tutorial 10's request: each verification step schedules 1 + 3 tokens and writes 4 KV
    slots; the next step starts where the kept tokens end, so a rejected draft's slot is
    written again; the picture says how many drafts were kept and hatches the rejected slot."""
    from tinyvllm.trace.svg_step import step_svg

    trace = workload_trace("spec-decode-drafts")
    rows = [(x.num_tokens, x.num_draft_tokens, len(x.new_token_ids)) for s in trace.steps for x in s.scheduler.scheduled]
    assert rows[0] == (11, 0, 1) and (4, 3, 4) in rows and (4, 3, 3) in rows  # a prefill; all kept; one rejected
    for before, after in zip(trace.steps, trace.steps[1:]):
        [x] = after.scheduler.scheduled
        assert len(after.slots) == x.num_tokens  # every draft's KV is written, kept or not
        assert x.start == before.request("R").num_computed_tokens  # rejected drafts were taken back
    index = next(i for i, s in enumerate(trace.steps) for x in s.scheduler.scheduled if (x.num_draft_tokens, len(x.new_token_ids)) == (3, 3))
    svg = step_svg(trace, index)
    assert "R verified 3 drafts: kept 2, then 1 token of the target&#x27;s (1 rejected" in svg.replace("'", "&#x27;")
    assert "R: 4 = 1 + 3 drafts" in svg
    r = trace.steps[index].request("R")
    position = r.num_computed_tokens  # the rejected draft's position: the first not computed
    slot = r.block_ids[position // trace.block_size] * trace.block_size + position % trace.block_size
    hatched = {int(m) for m in re.findall(r'<rect [^>]*fill="url\(#[\w-]*hatch\)"[^>]*data-slot="(\d+)"', svg)}
    assert hatched == {slot}, (hatched, slot)


def test_popcount_row_counts_the_set_bits_below_the_vocabulary():
    from tinyvllm.trace.grammar_rows import popcount_row

    assert popcount_row([-1, -1], 64) == 64  # an int32 word of -1: all 32 tokens
    assert popcount_row([-1, -1], 40) == 40  # bits past the vocabulary do not count
    assert popcount_row([0b1011, 1 << 31], 64) == 4  # tokens 0, 1, 3 and 63 (the sign bit)
    assert popcount_row([0, 1 << 5, -1], 38) == 1  # token 37 is past the vocabulary
    assert popcount_row([], 10) == 0


def test_allowed_token_counts_give_each_draft_position_its_row():
    """A request verifying k drafts owns k + 1 rows from its first (manager.py NOTE 3); an
    unconstrained request and a step without a mask have no count."""
    from types import SimpleNamespace

    import numpy as np

    from tinyvllm.trace.grammar_rows import allowed_token_counts

    mask = np.zeros((4, 2), dtype=np.int32)  # rows: A; B after 0, 1 and 2 drafts
    mask[0] = [-1, -1]
    mask[1] = [0b111, 0]
    mask[2] = [0b1, 0]
    mask[3] = [0, 1 << 3]
    out = SimpleNamespace(grammar_bitmask=mask, structured_output_request_ids={"A": 0, "B": 1},
                          scheduled_spec_decode_tokens={"B": [5, 6], "C": [7]})  # fmt: skip
    assert allowed_token_counts(out, 40) == {"A": (40,), "B": (3, 1, 1)}
    assert allowed_token_counts(SimpleNamespace(grammar_bitmask=None), 40) == {}


def test_structured_outputs_trace_counts_what_an_independent_matcher_allows():
    """Tutorial 12's constraints beside a free request: each constrained row's recorded count
    equals the count of an xgrammar matcher of the test's own (built from the tokenizer, fed
    the tokens the trace recorded, its bitmask unpacked by the worker's ``unpack_bitmask``);
    the free request has no count at any step; each constrained request ends on a row that
    allows EOS alone; the picture draws each count once."""
    xgr = pytest.importorskip("xgrammar")
    import json

    from tinyvllm.models.tokenizer import load_tokenizer
    from tinyvllm.stdlib_tiny import STDLIB_TINY
    from tinyvllm.structured_output.backend_xgrammar import choice_as_grammar
    from tinyvllm.structured_output.bitmask import unpack_bitmask
    from tinyvllm.trace.svg_step import step_svg

    trace = workload_trace("structured-outputs")
    tok = load_tokenizer(STDLIB_TINY)
    vocab = len(tok)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id]))
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}  # fmt: skip
    matchers = {
        "choice": xgr.GrammarMatcher(compiler.compile_grammar(choice_as_grammar(["yes", "no", "maybe"]))),
        "year": xgr.GrammarMatcher(compiler.compile_regex(r"(19|20)[0-9]{2}")),
        "json": xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)),
    }
    mask = xgr.allocate_token_bitmask(1, vocab)
    seen: dict[str, list[int]] = {rid: [] for rid in (*matchers, "free")}
    texts: dict[str, list[int]] = {rid: [] for rid in seen}
    for index, step in enumerate(trace.steps):
        for x in step.scheduler.scheduled:
            if x.request_id == "free":
                assert x.num_allowed_tokens is None, f"step {index}: an unconstrained request got a count"
                continue
            matcher = matchers[x.request_id]
            matcher.fill_next_token_bitmask(mask)
            count = int(unpack_bitmask(mask, vocab).sum())
            assert x.num_allowed_tokens == (count,), f"step {index}, {x.request_id}: {x.num_allowed_tokens} != {count}"
            seen[x.request_id].append(count)
            for token in x.new_token_ids:
                assert matcher.accept_token(token), f"step {index}: {x.request_id} sampled {token}, which its grammar refuses"
            texts[x.request_id] += x.new_token_ids
        svg = step_svg(trace, index)
        for x in step.scheduler.scheduled:
            drawn = re.findall(rf'data-role="allowed-tokens" data-request="{x.request_id}" data-allowed="([\d ]*)"', svg)
            assert drawn == ([] if x.num_allowed_tokens is None else [" ".join(map(str, x.num_allowed_tokens))]), index
    assert all(m.is_terminated() for m in matchers.values())
    assert all(seen[rid][-1] == 1 for rid in matchers) and max(seen["json"]) > 1000  # EOS alone; a string is wide
    assert tok.decode(texts["choice"][:-1]) in ("yes", "no", "maybe")
    assert re.fullmatch(r"(19|20)[0-9]{2}", tok.decode(texts["year"][:-1]))
    assert set(json.loads(tok.decode(texts["json"][:-1]))) == {"name", "ok"}


def test_traces_without_constraints_keep_their_json_and_pictures():
    """A trace with no constrained request writes no count (the JSON of the traces before
    structured outputs, snapshot.py NOTE 5) and draws no grammar row."""
    from tinyvllm.trace.svg_step import step_svg

    for name in ("seed002-prefix-caching", "scheduler-preemption", "spec-decode-drafts"):
        trace = workload_trace(name)
        assert "num_allowed_tokens" not in trace.to_json(), name
        assert all(x.num_allowed_tokens is None for s in trace.steps if s.scheduler for x in s.scheduler.scheduled)
        assert not any('data-role="allowed-tokens"' in step_svg(trace, i) for i in range(len(trace.steps))), name
    with_counts = workload_trace("structured-outputs")
    assert Trace.from_json(with_counts.to_json()) == with_counts and '"num_allowed_tokens": [' in with_counts.to_json()


@pytest.mark.slow
def test_the_tiny_model_a_workload_builds_is_removed_when_the_process_exits(tmp_path):
    """``tiny_model_folder`` builds its model in a temporary folder once per process; the
    folder goes with the process (before, every docs build and test worker left one in /tmp)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = "from tinyvllm.trace.workloads import tiny_model_folder; print(tiny_model_folder())"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True)
    folder = Path(out.stdout.strip())
    assert folder.parent.parent == tmp_path and folder.name == "qwen3", folder  # it was built there
    assert folder.parent.exists() is False, f"left behind: {sorted(tmp_path.iterdir())}"  # (torch's own caches may stay)
