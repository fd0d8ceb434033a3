"""Tutorial 10: one request's drafts, step by step (speculative decoding, n-gram prompt lookup).

The shipped model continues a list of imports, greedily, with
``speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}``.
Before each step we print the drafts the n-gram proposer found in the request's own tokens;
after it, which drafts the target model kept, the token it added (its own at the first
disagreement, or the bonus after the last kept draft), and where ``num_computed_tokens``
ended (advanced past every draft by the scheduler, then taken back for the rejected ones).
At the end: the same tokens as a run without speculation, in fewer steps; then the same
request under ``async_scheduling=True``, where the drafts are scheduled as placeholders.

Run it from the repository root: ``python tutorials/10_spec_decode.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.stdlib_tiny import STDLIB_TINY  # noqa: E402

torch.set_num_threads(1)
SPEC = {"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
PROMPT = "import os\nimport sys\nimport re\nimport "
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def show(tokenizer, ids) -> str:
    return "|".join(tokenizer.decode([t]).replace("\n", "\\n") for t in ids) or "-"


def main() -> None:
    common = dict(device="cpu", max_model_len=256, enable_prefix_caching=False, seed=0)
    llm = LLM(STDLIB_TINY, speculative_config=SPEC, **common)
    tok = llm.get_tokenizer()
    engine, scheduler = llm.engine, llm.engine.scheduler
    prompt_ids = tok(PROMPT).input_ids
    engine.add_request("r", prompt_ids, PARAMS)
    request = scheduler.requests["r"]
    print(f"prompt ({len(prompt_ids)} tokens): {PROMPT!r}")
    print(f"speculative_config: {SPEC}\n")
    print("step | drafts proposed       | kept           | added  | computed before -> after")
    print("-----+-----------------------+----------------+--------+-------------------------")
    step = 0
    while engine.has_unfinished_requests():
        drafts = list(request.spec_token_ids)
        before_outputs, before_computed = len(request.output_token_ids), request.num_computed_tokens
        engine.step()
        step += 1
        new = request.output_token_ids[before_outputs:]
        kept = new[:-1] if drafts else []
        added = new[-1:] if new else []
        after = request.num_computed_tokens
        print(f"{step:4d} | {show(tok, drafts):21s} | {show(tok, kept):14s} | {show(tok, added):6s} | "
              f"{before_computed} -> {after}")  # fmt: skip
    stats = scheduler.spec_stats
    spec_tokens = request.output_token_ids
    plain = LLM(STDLIB_TINY, **common).generate({"prompt_token_ids": prompt_ids}, PARAMS, use_tqdm=False)[0]
    print(f"\ntext: {tok.decode(spec_tokens)!r}")
    print(f"{len(spec_tokens)} tokens in {step} steps (one step for the prompt, then up to 1 + 3 tokens a step)")
    print(f"drafts verified {stats.num_draft_tokens}, kept {stats.num_accepted_tokens} "
          f"(acceptance {stats.acceptance_rate:.0%}), kept by position {stats.num_accepted_tokens_per_pos}")  # fmt: skip
    print(f"same tokens as without speculation: {'yes' if plain.outputs[0].token_ids == spec_tokens else 'NO'}")
    show_async(prompt_ids, spec_tokens, stats, common)


def show_async(prompt_ids: list[int], expected: list[int], expected_stats, common: dict) -> None:
    """The same request with ``async_scheduling=True``: each call of ``step()`` schedules the next
    step before the last one's tokens are back, so its drafts are placeholders (``?``) that the
    runner fills when it launches the step; the tokens arrive one call later."""
    llm = LLM(STDLIB_TINY, speculative_config=SPEC, async_scheduling=True, **common)
    engine, scheduler = llm.engine, llm.engine.scheduler
    schedule, scheduled = scheduler.schedule, []
    scheduler.schedule = lambda: scheduled.append(out := schedule()) or out  # what each call scheduled
    engine.add_request("r", prompt_ids, PARAMS)
    request = scheduler.requests["r"]
    print("\nasync_scheduling=True (drafts scheduled as placeholders ?, proposed by the runner at launch)")
    print("call | scheduled   | tokens back (the step before's)")
    print("-----+-------------+--------------------------------")
    calls = 0
    while engine.has_unfinished_requests():
        seen, had = len(request.output_token_ids), len(scheduled)
        engine.step()
        calls += 1
        cell = "-"
        for out in scheduled[had:]:
            n, drafts = out.num_scheduled_tokens.get("r"), out.scheduled_spec_decode_tokens.get("r", ())
            if n is not None:
                cell = f"1 + {'|'.join('?' for _ in drafts)}" if drafts else f"{n} tokens"
        print(f"{calls:4d} | {cell:11s} | {len(request.output_token_ids) - seen}")
    stats = scheduler.spec_stats
    same = request.output_token_ids == expected and stats == expected_stats
    print(f"{len(request.output_token_ids)} tokens in {calls} calls; the same tokens and drafts as above: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
