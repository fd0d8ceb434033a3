"""The built-in workloads: the documents' worked examples, recorded step by step.

Concept: each workload replays one figure of the source documents (or of a tutorial) and
returns its ``Trace``; ``tinyvllm trace --workload NAME`` and the docs hook draw them.

- ``seed002-prefix-caching``: seed 002 §3.2 (block size 4, ten blocks, steps 0-6), the
  ``KVCacheManager`` driven by hand as in ``tutorials/01_prefix_caching.py``;
- ``seed004-duplication``: seed 004 "Duplication" (Time 1-4): two identical greedy
  requests cache the same content in blocks 3 and 4; at Time 5 a third request hits block 3;
- ``seed001-condense``: seed 001 appendix U2: an ``InputBatch`` whose rows leave (holes),
  get filled lowest first, are condensed (UNIDIRECTIONAL moves), swapped (SWAP), or
  unchanged;
- ``scheduler-preemption``: ``tutorials/02_scheduler.py``'s workload (token budget 10, ten
  blocks of 4): chunked prefill, a prefix hit at admission, preemption and the re-hit;
- ``cuda-graphs-padding``: the engine on a tiny random model with emulated CUDA graphs
  (FULL_AND_PIECEWISE, capture sizes 1, 2, 4, 8): prefills run PIECEWISE padded to a
  capture size, decodes FULL with padded requests;
- ``seed003-kv-slots``: seed 003's KV tensor: the engine (block size 4) writes each step's
  keys and values into slots ``block_id * 4 + offset``; a prefix hit writes none;
- ``beam-search``: ``LLM.beam_search`` on the tiny random Qwen3 (width 2, block size 4):
  each step's beams are new one-token requests, hitting their parents' full blocks;
- ``spec-decode-drafts``: tutorial 10's request (the shipped model continues a list of
  imports, n-gram drafts, k 3): each step's drafts, how many the target kept, and the
  KV slots the verification writes, rejected drafts' included;
- ``structured-outputs``: tutorial 12's three constraints (a choice, a regex, a JSON schema)
  on the shipped model, beside an unconstrained request: each step, how many tokens each
  constrained row of the grammar bitmask allows;
- ``embeddings``: a pooling engine (``runner="pooling"``, LAST) on the tiny random Qwen3: a
  prompt chunked over two steps, one sharing its two full blocks (found in the prefix cache), a third.

Follows: the sections named above. Mirrors: nothing in vLLM.

Invariants: a workload is deterministic (no clock, no randomness beyond seeded weights):
the same code draws the same pictures, which is what lets the docs hook cache them.

NOTE 1 (no model where none is needed): the first four use no model. Where the scheduler
runs, a fake model makes each next token a fixed function of the request's whole token
sequence (as in tutorial 02), so identical prompts give identical outputs (seed 004's
"same prompt with greedy sampling") whatever the batching. ``cuda-graphs-padding``,
``seed003-kv-slots``, ``beam-search`` and ``embeddings`` build a tiny random Qwen3 (one layer) once per
process and need torch; ``spec-decode-drafts`` runs the shipped model, whose text repeats itself as a random model's
does not; ``structured-outputs`` runs it too, for a tokenizer whose tokens read as text.
NOTE 2 (compiled first): ``structured-outputs`` compiles its grammars before adding the
requests, so each is ready at its first ``schedule()``; otherwise how many steps a request
waits as ``WAITING_FOR_FSM`` would depend on the machine, and the trace would not be fixed.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinyvllm.config import CacheConfig, SchedulerConfig
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.outputs import ModelRunnerOutput
from tinyvllm.request import Request
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.trace.recorder import Recorder, record
from tinyvllm.trace.snapshot import Trace

NUMBER_BASE = 1000  # seed 002 §3.2: req2's numbers n are token ids 1000 + n (tutorial 01)


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    needs_torch: bool
    run: Callable[[], Trace]


# -- seed 002 §3.2 ----------------------------------------------------------------------


def letters(text: str) -> list[int]:
    return [ord(ch) for ch in text]


def letter_label(token_id: int) -> str:
    return str(token_id - NUMBER_BASE) if token_id >= NUMBER_BASE else chr(token_id)


# --8<-- [start:seed002]
def seed002_prefix_caching() -> Trace:
    manager = KVCacheManager(block_size=4, num_gpu_blocks=10, max_model_len=64)
    rec = Recorder(manager, title="Seed 002 §3.2: prefix caching, block size 4, ten blocks", label_token=letter_label,
                   description="The KV cache manager driven by hand, as tutorial 01 does; the step numbers are the "
                   "document's figure labels.")  # fmt: skip
    params = SamplingParams(max_tokens=8)
    req0 = Request("req0", letters("ABCDEFGHIJKLMNO"), params)
    req1 = Request("req1", letters("ABCDEFGHIJklmn"), params)
    req2 = Request("req2", letters("ABCDEFGHIJKL") + [NUMBER_BASE + n for n in range(17)], params)
    rec.capture("before step 0", "Ten free blocks, ids 0-9 (no reserved null block), in id order in the free queue.")

    def admit(req: Request) -> int:
        hits, num_hit_tokens = manager.get_computed_blocks(req)
        assert manager.allocate_slots(req, req.num_tokens - num_hit_tokens, hits) is not None
        req.num_computed_tokens = req.num_tokens
        return req.num_tokens - num_hit_tokens

    n = admit(req0)
    rec.capture("step 0", "req0 = ABCD|EFGH|IJKL|MNO arrives; all 15 prompt tokens are scheduled: blocks 0-3, "
                "the three full ones cached at once.", requests=[req0], scheduled={"req0": n})  # fmt: skip
    for token in "PQ":  # the model "samples" P, then Q; each decode computes the last token
        req0.append_output_token_ids(letters(token))
        assert manager.allocate_slots(req0, 1) is not None
        req0.num_computed_tokens += 1
    rec.capture("step 3", "Two decodes later (P, then Q): P filled block 3 (MNOP, cached at once); Q needed a "
                "fifth block, 4.", requests=[req0], scheduled={"req0": 2})  # fmt: skip
    n = admit(req1)
    rec.capture("step 4", "req1 = ABCD|EFGH|IJkl|mn arrives: its first two blocks hit req0's (ref_cnt 2); "
                "IJkl and mn need new blocks 5 and 6.", requests=[req0, req1], scheduled={"req1": n})  # fmt: skip
    manager.free(req0)
    manager.free_block_hashes(req0)
    rec.capture("step 5", "req0 finishes; its blocks are freed tail first: 4, 3, 2 reach the free queue (0 and 1 "
                "are still held by req1) and stay cached.", requests=[req1])  # fmt: skip
    manager.free(req1)
    manager.free_block_hashes(req1)
    rec.capture("step 5 (cont.)", "req1 finishes; its blocks are freed tail first: 6, 5, 1, 0.")
    n = admit(req2)
    rec.capture("step 6", "req2 = ABCD|EFGH|IJKL|0-3|4-7|8-11|12-15|16 arrives: blocks 0, 1, 2 are hits taken back "
                "from the free queue; the five new blocks come from its head: 7 8 9 4 3, and 3 loses MNOP.",
                requests=[req2], scheduled={"req2": n})  # fmt: skip
    return rec.trace
# --8<-- [end:seed002]


# -- the scheduler with a fake model (NOTE 1) ------------------------------------------------


def fake_next_token(token_ids: list[int]) -> int:
    """The next token: a fixed function of all tokens so far (``tutorials/02_scheduler.py``)."""
    h = 17
    for t in token_ids:
        h = (h * 31 + t) % 1_000_003
    return h % 1000


def fake_samples(requests: Mapping[str, Any], request_ids: Iterable[str]) -> list[list[int]]:
    """What the fake model samples for each request a step ran: its next token when the step
    reached the end of the request's tokens, else nothing (a partial prefill)."""
    return [[fake_next_token(list(r.all_token_ids))] if (r := requests[rid]).num_computed_tokens == r.num_tokens else []
            for rid in request_ids]  # fmt: skip


def run_scheduler(
    rec: Recorder, scheduler: Scheduler, arrivals: dict[int, list[Request]], labels: dict[int, tuple[str, str]] | None = None
) -> Trace:
    """Step ``scheduler`` with the fake model until nothing is left, one snapshot a step."""
    step = 0
    while step <= max(arrivals) or scheduler.has_unfinished_requests():
        for request in arrivals.get(step, []):
            scheduler.add_request(request)
        out = scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = fake_samples(scheduler.requests, ids)
        core = scheduler.update_from_output(out, ModelRunnerOutput(ids, {rid: i for i, rid in enumerate(ids)}, sampled))
        label, note = (labels or {}).get(step, (f"step {step}", ""))
        rec.capture(label, note, scheduler_output=out, core_outputs=core)
        step += 1
    return rec.trace


def seed004_duplication() -> Trace:
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=128, max_model_len=128), CacheConfig(block_size=16, num_gpu_blocks=10)
    )
    rec = Recorder(scheduler, title="Seed 004 \"Duplication\": append-only block tables cache one content twice",
                   panels=("scheduler", "block_tables", "block_pool", "free_queue", "prefix_cache"),
                   description="Two identical greedy requests (block size 16, a prompt of 62 tokens) arriving at "
                   "different times; a third one with the same 64 tokens arrives at Time 5.")  # fmt: skip
    prompt = list(range(100, 162))
    req1 = Request("req1", prompt, SamplingParams(max_tokens=3))
    req2 = Request("req2", prompt, SamplingParams(max_tokens=5))
    same64 = prompt + [fake_next_token(prompt), fake_next_token(prompt + [fake_next_token(prompt)])]
    req3 = Request("req3", same64 + [7, 8], SamplingParams(max_tokens=2))
    labels = {
        0: ("Time 1", "req1: [0, 1, 2, 3 (partial, 14/16)]."),
        1: ("Time 2", "req1: block 3 15/16. req2 arrives with the same prompt: blocks 0-2 are hits, but a partial "
            "block cannot be shared, so req2 gets a new block 4 (14/16)."),
        2: ("Time 3", "req1's block 3 is full and cached (\"block 3 is now sharable\"); req1 finishes with its third "
            "token and frees it, still cached. req2: block 4 15/16."),
        3: ("Time 4", "req2's block 4 is full: the same content as block 3, but block tables are append-only, so the "
            "cache keeps both: block_3_hash: [block3, block4]."),
        4: ("Time 5", "req3 holds the same 64 tokens: the lookup returns the first block under the hash, block 3, "
            "taken back from the free queue (\"we always allocate block 3\"); req2 keeps its block 4."),
        5: ("Time 6", "req2 and req3 finish: block 4 goes back to the free queue (\"Block 4 will be free once req2 "
            "is done\"), still cached beside block 3."),
    }  # fmt: skip
    return run_scheduler(rec, scheduler, {0: [req1], 1: [req2], 4: [req3]}, labels)


def scheduler_preemption() -> Trace:
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=10, max_model_len=64), CacheConfig(block_size=4, num_gpu_blocks=10)
    )
    rec = Recorder(scheduler, title="The scheduler: token budget 10, ten blocks of 4 (tutorial 02)",
                   description="A and B arrive at step 0, C (sharing A's 8-token system prompt) at step 2; every "
                   "request asks for 6 tokens. Chunked prefill, a prefix hit at admission, preemption of the last "
                   "running request when decodes run the pool dry, and its re-hit when it is admitted again.")  # fmt: skip
    system = list(range(1, 9))
    params = SamplingParams(max_tokens=6)
    arrivals = {
        0: [Request("A", system + [11, 12, 13, 14], params), Request("B", list(range(21, 31)), params)],
        2: [Request("C", system + [41, 42, 43], params)],
    }
    return run_scheduler(rec, scheduler, arrivals)


def scheduler_priority() -> Trace:
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=16, max_model_len=64, long_prefill_token_threshold=8, policy="priority"),
        CacheConfig(block_size=4, num_gpu_blocks=7),
    )
    rec = Recorder(scheduler, title="Priorities: a victim scheduled earlier in its step (seven blocks of 4)",
                   description="`low` (priority 5) prefills a 20-token prompt in chunks of 8; `urgent` (priority 0) "
                   "arrives at step 1. In step 2 `low` is scheduled its last chunk first, then `urgent` needs a block and "
                   "none is free: the victim is `low`, already in the step. It gives its tokens back, and its block "
                   "for positions 16-19, cached when the chunk was scheduled, leaves the prefix cache.")  # fmt: skip
    labels = {2: ("step 2", "low was scheduled 4 tokens, then preempted for urgent: only urgent's token runs. Low's "
                  "blocks 0-3 (positions 0-15, written by steps 0 and 1) stay cached; block 6, of its dropped chunk, "
                  "left the prefix cache and went to urgent")}  # fmt: skip
    arrivals = {
        0: [Request("low", list(range(100, 120)), SamplingParams(max_tokens=4), priority=5)],
        1: [Request("urgent", list(range(1, 9)), SamplingParams(max_tokens=6), priority=0)],
    }
    return run_scheduler(rec, scheduler, arrivals, labels)


# -- seed 001 appendix U2 -----------------------------------------------------------------


def seed001_condense() -> Trace:
    from tinyvllm.worker.input_batch import InputBatch

    batch = InputBatch(max_num_reqs=8, device="cpu")
    rec = Recorder(batch, title="Seed 001 appendix U2: holes filled lowest first, then condense()",
                   description="The persistent batch driven by hand: requests leave (their rows become holes), "
                   "newcomers take the lowest hole (pop_removed), condense() moves the highest rows down.")  # fmt: skip
    outputs: dict[str, list[int]] = {}

    def add(rid: str) -> None:
        outputs[rid] = []  # each request's own live output list
        batch.add_request(rid, SamplingParams(), [1, 2, 3], outputs[rid])

    def step(label: str, note: str, leave: list[str], arrive: list[str], swap: tuple[int, int] | None = None) -> None:
        for rid in leave:
            batch.remove_request(rid)
        for rid in arrive:
            add(rid)
        batch.condense()
        if swap is not None:
            batch.swap_states(*swap)
        batch.refresh()
        rec.capture(label, note)

    step("step 0", "Eight requests arrive: rows 0-7.", [], [f"r{i}" for i in range(8)])
    step("step 1", "U2.2's example: rows 7, 3 and 5 leave (removed, kept highest first: [7, 5, 3]); A arrives and "
         "takes the lowest hole, 3 (pop_removed); condense() moves row 6 into hole 5.", ["r7", "r3", "r5"], ["A"])
    step("step 2", "r1 and r2 leave; nobody arrives: condense() moves the highest rows into the holes, 5 -> 1 "
         "and 4 -> 2 (UNIDIRECTIONAL: the source row is left empty).", ["r1", "r2"], [])
    step("step 3", "B and C arrive; there is no hole, so they take new rows at the end.", [], ["B", "C"])
    step("step 4", "swap_states(0, 3): two live rows exchange places (SWAP: nothing is lost).", [], [], (0, 3))
    step("step 5", "Nothing changes: refresh() hands out no BatchUpdate (None).", [], [])
    return rec.trace


# -- the engine on a tiny model (NOTE 1) -----------------------------------------------------


@functools.lru_cache(maxsize=1)
def tiny_model_folder() -> str:
    """A one-layer tiny random Qwen3, built once per process in a temporary folder that is
    removed when the process exits."""
    from tinyvllm.models.tiny import build_tiny_model

    folder = tempfile.mkdtemp(prefix="tinyvllm-trace-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return str(build_tiny_model(Path(folder) / "qwen3", "qwen3", num_hidden_layers=1))


# --8<-- [start:engine_trace]
def _engine_trace(llm, rec_options: dict, arrivals: dict[int, list[tuple[str, list[int], Any]]]) -> Trace:
    """Add each request at its step, step the engine to the end, inside ``record``. A request's
    third field is its ``max_tokens`` (greedy, EOS ignored) or its params (``PoolingParams``)."""
    engine = llm.engine
    with record(llm, **rec_options) as rec:
        step = 0
        while step <= max(arrivals) or engine.has_unfinished_requests():
            for rid, prompt, params in arrivals.get(step, []):
                if isinstance(params, int):
                    params = SamplingParams(temperature=0.0, max_tokens=params, ignore_eos=True)
                engine.add_request(rid, prompt, params)
            engine.step()
            step += 1
    return rec.trace
# --8<-- [end:engine_trace]


def cuda_graphs_padding() -> Trace:
    if "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels on CPU tensors (tutorial 07)
    from tinyvllm import LLM

    llm = LLM(
        tiny_model_folder(), device="cpu", attention_backend="triton", max_model_len=64, block_size=16,
        max_num_batched_tokens=8, max_num_seqs=4, num_gpu_blocks_override=16,
        compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8]},
    )  # fmt: skip
    options = dict(
        title="CUDA graphs: padding to a capture size (FULL_AND_PIECEWISE, emulated on the CPU)",
        description="Capture sizes 1, 2, 4, 8; a budget of 8 tokens; at most 4 requests. Prefill and mixed steps "
        "run PIECEWISE graphs, padded to the next capture size; pure decode steps run FULL graphs whose key also "
        "names the (padded) request count.",
        panels=("scheduler", "dispatch", "batch", "block_tables", "kv_cache"),
    )
    arrivals = {0: [("A", list(range(100, 111)), 3), ("B", list(range(200, 205)), 5)], 2: [("C", [300, 301, 302], 4)]}
    return _engine_trace(llm, options, arrivals)


def _tiny_llm(**overrides):
    """The one-layer tiny Qwen3 on the CPU, eager, torch attention, block size 4 (NOTE 1)."""
    from tinyvllm import LLM

    return LLM(tiny_model_folder(), device="cpu", attention_backend="torch", max_model_len=32, block_size=4,
               enforce_eager=True, **overrides)  # fmt: skip


def seed003_kv_slots() -> Trace:
    llm = _tiny_llm(max_num_batched_tokens=8, max_num_seqs=4, num_gpu_blocks_override=12)
    options = dict(
        title="Seed 003: the KV cache tensor and the slots each step writes (block size 4, twelve blocks)",
        description="Each scheduled token's key and value go to slot block_id * 4 + offset of its request's block "
        "table (the slot mapping). C shares A's first four tokens: that block is a prefix hit, and C's first step "
        "writes nothing into it.",
        panels=("scheduler", "block_tables", "kv_cache"),
    )
    ids = llm.tokenizer.convert_tokens_to_ids  # one token per letter: the blocks read as text
    a, b, c = ([ids(ch) for ch in text] for text in ("abcdef", "uvwxy", "abcdz"))
    arrivals = {0: [("A", a, 3), ("B", b, 3)], 2: [("C", c, 2)]}
    return _engine_trace(llm, options, arrivals)


def beam_search_steps() -> Trace:
    from tinyvllm import BeamSearchParams

    llm = _tiny_llm(max_num_batched_tokens=16, num_gpu_blocks_override=16)
    options = dict(
        title="Beam search: each step's beams are one-token requests (width 2, block size 4)",
        description="LLM.beam_search on a 7-token prompt, width 2, 4 steps. Each engine step runs the live beams "
        "as new requests of one token. A beam's prompt is its parent's plus one token, so it finds its parent's "
        "full blocks in the prefix cache and computes only the tokens past them.",
        panels=("scheduler", "prefix_cache", "kv_cache"),
    )
    ids = llm.tokenizer.convert_tokens_to_ids  # one token per letter: the blocks read as text
    with record(llm, **options) as rec:
        llm.beam_search({"prompt_token_ids": [ids(ch) for ch in "abcdefg"]}, BeamSearchParams(beam_width=2, max_tokens=4))
    return rec.trace


def embeddings_steps() -> Trace:
    from tinyvllm import PoolingParams

    llm = _tiny_llm(max_num_batched_tokens=8, num_gpu_blocks_override=12, runner="pooling")
    options = dict(
        title="Embeddings: a pooling engine's steps (LAST pooling, block size 4, a budget of 8)",
        description="A's 10 tokens take two steps (chunked prefill); its vector is made in the step that ends its "
        "prompt, and it finishes there, with no token. B shares A's first 8 tokens: LAST pooling reads the prefix "
        "cache, so B computes only its last 3, beside A's last 2. C (14 tokens, nothing shared) takes two steps.",
        panels=("scheduler", "prefix_cache", "kv_cache"),
    )
    ids = llm.tokenizer.convert_tokens_to_ids  # one token per letter: the blocks read as text
    arrivals = {step: [(rid, [ids(ch) for ch in text], PoolingParams())]
                for step, rid, text in ((0, "A", "abcdefghij"), (1, "B", "abcdefghxyz"), (2, "C", "qrstuvwxyzabcd"))}  # fmt: skip
    return _engine_trace(llm, options, arrivals)


def spec_decode_drafts() -> Trace:
    from tinyvllm import LLM
    from tinyvllm.stdlib_tiny import STDLIB_TINY

    spec = {"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = LLM(STDLIB_TINY, device="cpu", max_model_len=64, max_num_batched_tokens=16, enable_prefix_caching=False,
              seed=0, speculative_config=spec)  # fmt: skip
    options = dict(
        title="Speculative decoding: one request's drafts, kept and rejected (tutorial 10)",
        description="The shipped model continues 'import os / import sys / import re / import ', greedily, with "
        "n-gram drafts (k 3, lookup 2-4). A decode step computes the last real token and every draft; the target "
        "keeps the drafts it agrees with and adds one token. The KV slots of rejected drafts are written, then "
        "written again by the next step.",
        panels=("scheduler", "block_tables", "kv_cache"),
    )
    prompt = llm.get_tokenizer()("import os\nimport sys\nimport re\nimport ").input_ids
    return _engine_trace(llm, options, {0: [("R", prompt, 16)]})


def structured_outputs() -> Trace:
    from tinyvllm import LLM
    from tinyvllm.sampling_params import StructuredOutputsParams as Constraint
    from tinyvllm.stdlib_tiny import STDLIB_TINY

    llm = LLM(STDLIB_TINY, device="cpu", max_model_len=128, max_num_batched_tokens=32, enable_prefix_caching=False,
              seed=0)  # fmt: skip
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}  # fmt: skip
    requests = [  # (id, prompt, constraint or None, max_tokens, arrival step): tutorial 12's three, and one free
        ("choice", "Is the sky blue? Answer:", Constraint(choice=["yes", "no", "maybe"]), 8, 0),
        ("free", "def fibonacci(n):\n", None, 6, 0),
        ("year", "The year Python was released:", Constraint(regex=r"(19|20)[0-9]{2}"), 8, 1),
        ("json", "config = ", Constraint(json=schema, disable_any_whitespace=True), 40, 2),
    ]
    options = dict(
        title="Structured outputs: the tokens each constrained row allows (tutorial 12)",
        description="Three requests under a grammar (a choice of yes / no / maybe, the regex (19|20)[0-9]{2}, a JSON "
        "schema) and one without, greedy on the shipped model. After schedule(), the engine fills one bitmask row "
        "per constrained request; the grammar row of each picture counts its set bits: the tokens the sampler may "
        "pick from. A count of 1 is the grammar deciding alone; the last row of a request allows only EOS.",
        panels=("scheduler", "block_tables", "batch"),
    )
    engine, tok = llm.engine, llm.get_tokenizer()
    for _, _, constraint, _, _ in requests:
        if constraint is not None:
            engine.structured_output_manager.compile(constraint).result()  # NOTE 2
    with record(llm, **options) as rec:
        step = 0
        while step <= max(r[4] for r in requests) or engine.has_unfinished_requests():
            for rid, prompt, constraint, max_tokens, arrival in requests:
                if arrival == step:
                    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=constraint)
                    engine.add_request(rid, tok(prompt).input_ids, params)
            engine.step()
            step += 1
    return rec.trace


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("seed002-prefix-caching", "seed 002 §3.2: prefix caching, block size 4, ten blocks", False, seed002_prefix_caching),
        Workload("seed004-duplication", "seed 004 \"Duplication\": Time 1-4", False, seed004_duplication),
        Workload("seed001-condense", "seed 001 appendix U2: holes and condense()", True, seed001_condense),
        Workload("scheduler-preemption", "tutorial 02: chunked prefill, preemption and the re-hit", False, scheduler_preemption),
        Workload("scheduler-priority", "priorities: the victim is taken back out of its step", False, scheduler_priority),
        Workload("cuda-graphs-padding", "CUDA graphs: padding to capture sizes (emulated)", True, cuda_graphs_padding),
        Workload("seed003-kv-slots", "seed 003: the KV cache tensor and its slots", True, seed003_kv_slots),
        Workload("beam-search", "beam search: each step's beams as one-token requests", True, beam_search_steps),
        Workload("embeddings", "embeddings: a pooling engine's chunked prompt and prefix hit", True, embeddings_steps),
        Workload("spec-decode-drafts", "speculative decoding: drafts kept and rejected", True, spec_decode_drafts),
        Workload("structured-outputs", "structured outputs: the tokens each constrained row allows", True, structured_outputs),
    )
}  # fmt: skip


def run_workload(name: str) -> Trace:
    """The trace of built-in workload ``name`` (ValueError naming the choices otherwise)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    return WORKLOADS[name].run()
