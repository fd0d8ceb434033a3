"""Tutorial 12: structured outputs, step by step: a choice, a regex and a small JSON schema.

The shipped model answers three prompts greedily, each under one constraint
(``SamplingParams(structured_outputs=StructuredOutputsParams(...))``). Each step we read the
step's grammar bitmask where the worker reads it, in the ``SchedulerOutput`` (an observer on
the engine, ``LLMEngine.add_observer``), and print for the request's row how many tokens the
grammar allows (the row's set bits), the few it allows when they are few, the token the model
chose among them, and the text so far. At the end of each part: the output checked against its
constraint, and what the model writes from the same prompt with no constraint.

Part 4 adds speculative decoding (tutorial 10's n-gram drafts, k 3) under a regex of import
lines: a step verifying k drafts has k + 1 bitmask rows, row i being what the grammar allows
after drafts 0 .. i-1; we print the drafts, each row's allowed count, and the tokens kept.

Part 5 runs part 4's request under async scheduling. There the runner proposes the drafts when
it launches a step, so no grammar trims them: the engine takes them back before it makes the
mask, and the mask stops at the first draft the grammar refuses, whose row refuses it. We print
the drafts the runner ran, how many the grammar refused, the rows up to the refused one, and
the tokens kept.

Run it from the repository root: ``python tutorials/12_structured_outputs.py``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.sampling_params import StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
PARTS = [  # (title, prompt, constraint, max_tokens)
    ("a choice", "Is the sky blue? Answer:", StructuredOutputsParams(choice=["yes", "no", "maybe"]), 8),
    ("a regex", "The year Python was released:", StructuredOutputsParams(regex=r"(19|20)[0-9]{2}"), 8),
    ("a JSON schema", "config = ", StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), 40),
]
SHOW_ALLOWED = 8  # list the allowed tokens when there are at most this many
SPEC = {"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}  # tutorial 10's
IMPORTS = ("import os\nimport sys\nimport re\n", StructuredOutputsParams(regex=r"(import (os|sys|re)\n){4}"), 24)


def popcount(words) -> int:
    """Set bits of one bitmask row: the tokens it allows (32 per int32 word)."""
    return sum(bin(int(w) & 0xFFFFFFFF).count("1") for w in words)


def allowed_ids(words) -> list[int]:
    return [32 * i + b for i, w in enumerate(words) for b in range(32) if (int(w) >> b) & 1]


class DraftRows:
    """A step observer (``LLMEngine.add_observer``): each step's drafts and every bitmask row of one request."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.steps: list[tuple[list[int], list[list[int]]]] = []
        self.refused: list[int] = []  # drafts not verified (async scheduling: refused or not proposed)

    def on_step(self, engine, scheduler_output, core_outputs, error) -> None:
        drafts = list(scheduler_output.scheduled_spec_decode_tokens.get(self.rid, ()))
        first = scheduler_output.structured_output_request_ids.get(self.rid)
        mask = scheduler_output.grammar_bitmask
        rows = [] if first is None else [mask[r].tolist() for r in range(first, first + 1 + len(drafts))]
        self.steps.append((drafts, rows))
        self.refused.append(scheduler_output.num_invalid_spec_tokens.get(self.rid, 0))  # part 5


class BitmaskRows:
    """A step observer (``LLMEngine.add_observer``): keeps each step's bitmask row of every constrained request."""

    def __init__(self) -> None:
        self.rows: list[dict[str, list[int]]] = []

    def on_step(self, engine, scheduler_output, core_outputs, error) -> None:
        mask = scheduler_output.grammar_bitmask  # numpy int32 [G, ceil(V / 32)], or None
        firsts = scheduler_output.structured_output_request_ids  # request id -> its first row
        self.rows.append({rid: mask[row].tolist() for rid, row in firsts.items()} if mask is not None else {})


def show(tokenizer, token_id: int) -> str:
    return repr(tokenizer.decode([token_id]))


def check(text: str, constraint: StructuredOutputsParams) -> str:
    if constraint.choice is not None:
        return f"one of {list(constraint.choice)}: {'yes' if text in constraint.choice else 'NO'}"
    if constraint.regex is not None:
        return f"re.fullmatch({constraint.regex!r}): {'yes' if re.fullmatch(constraint.regex, text) else 'NO'}"
    value = json.loads(text)
    fits = (set(value) == {"name", "ok"} and isinstance(value["name"], str) and len(value["name"]) <= 8
            and isinstance(value["ok"], bool))  # fmt: skip
    return f"json.loads: {value}; fits the schema: {'yes' if fits else 'NO'}"


def main() -> None:
    llm = LLM(device="cpu", torch_threads=1, max_model_len=256, enable_prefix_caching=False)
    engine, tok = llm.engine, llm.get_tokenizer()
    manager = engine.structured_output_manager
    words = -(-manager.vocab_size // 32)
    print(f"vocabulary {manager.vocab_size} tokens: a bitmask row is {words} int32 words ({4 * words} bytes)")
    print(f"eos: {show(tok, engine.input_processor.eos_token_id)}")
    for number, (title, prompt, constraint, max_tokens) in enumerate(PARTS, 1):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint)
        manager.compile(constraint).result()  # compiled now, so the first step schedules the request
        rid = f"part{number}"
        observer = BitmaskRows()
        engine.add_observer(observer)
        engine.add_request(rid, tok(prompt).input_ids, params)
        status = engine.scheduler.requests[rid].status.name
        print(f"\n== part {number}: {title}: {constraint.kind} = {getattr(constraint, constraint.kind)!r}")
        print(f"prompt {prompt!r}; status after add_request: {status} (its compile is in the cache: ready)")
        print("step | allowed | chosen          | text so far")
        print("-----+---------+-----------------+------------")
        request = engine.scheduler.requests[rid]
        text_ids: list[int] = []
        finish = None
        step = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                finish = out.outputs[0].finish_reason
            row = observer.rows[-1].get(rid)
            new = request.output_token_ids[len(text_ids):]
            step += 1
            if row is None or not new:
                print(f"{step:4d} | {'-':>7s} | (no token)")
                continue
            count, token = popcount(row), new[0]
            listed = f"  {{{', '.join(show(tok, t) for t in allowed_ids(row))}}}" if count <= SHOW_ALLOWED else ""
            text_ids.extend(new)
            so_far = tok.decode([t for t in text_ids if t != engine.input_processor.eos_token_id])
            print(f"{step:4d} | {count:7d} | {show(tok, token):15s} | {so_far!r}{listed}")
        engine.remove_observer(observer)
        text = tok.decode([t for t in text_ids if t != engine.input_processor.eos_token_id])
        print(f"output {text!r}, finish_reason {finish!r}; {check(text, constraint)}")
        free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
        print(f"without the constraint: {free.outputs[0].text!r}")
    print(f"\ncompiled grammars in the manager's cache: {manager.num_cached_grammars()}")
    sync = with_drafts()
    with_drafts_async(sync)


def with_drafts() -> tuple[list[int], tuple[int, int]]:
    """Part 4: a mask row per draft position (``structured_output/manager.py`` NOTE 3)."""
    llm = LLM(device="cpu", torch_threads=1, max_model_len=256, enable_prefix_caching=False, speculative_config=SPEC)
    engine, tok = llm.engine, llm.get_tokenizer()
    prompt, constraint, max_tokens = IMPORTS
    engine.structured_output_manager.compile(constraint).result()
    observer = DraftRows("part4")
    engine.add_observer(observer)
    manager, proposals = engine.structured_output_manager, []
    trim = manager.trim_drafts  # wrapped, to see what the n-gram proposer offered before the grammar trimmed it

    def trim_and_keep(request, drafts):
        proposals.append(list(drafts))
        return trim(request, drafts)

    manager.trim_drafts = trim_and_keep
    engine.add_request("part4", tok(prompt).input_ids, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                        structured_outputs=constraint))  # fmt: skip
    request = engine.scheduler.requests["part4"]
    print(f"\n== part 4: drafts under a regex: regex = {constraint.regex!r}, speculative_config {SPEC}")
    print(f"prompt {prompt!r}")
    print("step | proposed                  | verified                  | allowed per row | tokens kept")
    print("-----+---------------------------+---------------------------+-----------------+------------")
    done, finish = 0, None
    while engine.has_unfinished_requests():
        proposed = proposals.pop() if proposals else []
        for out in engine.step():
            finish = out.outputs[0].finish_reason
        drafts, rows = observer.steps[-1]
        kept = request.output_token_ids[done:]
        done = len(request.output_token_ids)
        offered, shown = (" ".join(show(tok, t) for t in ids) or "-" for ids in (proposed, drafts))
        counts = " / ".join(str(popcount(row)) for row in rows)
        print(f"{len(observer.steps):4d} | {offered:25s} | {shown:25s} | {counts:15s} | {' '.join(show(tok, t) for t in kept)}")
    engine.remove_observer(observer)
    stats = engine.scheduler.spec_stats
    text = tok.decode([t for t in request.output_token_ids if t != engine.input_processor.eos_token_id])
    print(f"output {text!r}, finish_reason {finish!r}; re.fullmatch: {'yes' if re.fullmatch(constraint.regex, text) else 'NO'}")
    print(f"drafts verified {stats.num_draft_tokens}, kept {stats.num_accepted_tokens}")
    plain = LLM(device="cpu", torch_threads=1, max_model_len=256, enable_prefix_caching=False)
    same = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint),
                          use_tqdm=False)[0].outputs[0].token_ids == request.output_token_ids  # fmt: skip
    print(f"same tokens as without speculation: {'yes' if same else 'NO'}")
    return list(request.output_token_ids), (stats.num_draft_tokens, stats.num_accepted_tokens)


def with_drafts_async(sync: tuple[list[int], tuple[int, int]]) -> None:
    """Part 5: part 4 under async scheduling (``structured_output/manager.py`` NOTE 8)."""
    llm = LLM(device="cpu", torch_threads=1, max_model_len=256, enable_prefix_caching=False, speculative_config=SPEC,
              async_scheduling=True)  # fmt: skip
    engine, tok = llm.engine, llm.get_tokenizer()
    prompt, constraint, max_tokens = IMPORTS
    engine.structured_output_manager.compile(constraint).result()
    observer = DraftRows("part5")  # called when a step is read back, with the engine's copy of the step
    engine.add_observer(observer)
    engine.add_request("part5", tok(prompt).input_ids, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                        structured_outputs=constraint))  # fmt: skip
    request = engine.scheduler.requests["part5"]
    print("\n== part 5: the same, under async scheduling: the runner proposes, the mask rejects what the grammar refuses")
    print("step | drafts the runner ran      | refused | allowed per row | tokens kept")
    print("-----+----------------------------+---------+-----------------+------------")
    done, finish = 0, None
    while engine.has_unfinished_requests():
        before = len(observer.steps)
        for out in engine.step():
            finish = out.outputs[0].finish_reason
        if len(observer.steps) == before:
            continue  # a call that only launched: nothing read back yet
        drafts, rows = observer.steps[-1]
        if finish is not None and not rows:  # scheduled before the stop was read back (tutorial 10)
            print(f"{len(observer.steps):4d} | (scheduled before step {len(observer.steps) - 1} was read back: thrown away)")
            continue
        ran = [t for t in drafts if t >= 0]  # the rest: placeholders the runner left unproposed
        refused = observer.refused[-1] - (len(drafts) - len(ran))
        kept = request.output_token_ids[done:]
        done = len(request.output_token_ids)
        shown = " ".join(show(tok, t) for t in ran) or "-"
        counts = " / ".join(str(popcount(row)) for row in rows[: 1 + len(ran) - refused])  # the rows read
        print(f"{len(observer.steps):4d} | {shown:26s} | {refused:7d} | {counts:15s} | {' '.join(show(tok, t) for t in kept)}")
    engine.remove_observer(observer)
    stats = engine.scheduler.spec_stats
    text = tok.decode([t for t in request.output_token_ids if t != engine.input_processor.eos_token_id])
    same = list(request.output_token_ids) == sync[0]
    print(f"output {text!r}, finish_reason {finish!r}; same tokens as part 4: {'yes' if same else 'NO'}")
    counts = (stats.num_draft_tokens, stats.num_accepted_tokens)
    print(f"drafts verified {counts[0]}, kept {counts[1]}; the same as part 4: {'yes' if counts == sync[1] else 'NO'}")


if __name__ == "__main__":
    main()
