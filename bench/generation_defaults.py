"""Measurement: the shipped model's sampling defaults (its ``generation_config.json``).

What it measures: for each candidate setting (greedy, and every combination of
``--temperatures`` x ``--top-ps`` x ``--top-ks`` x ``--min-ps`` x
``--repetition-penalties``), one completion of ``--max-tokens`` (64, the command line's
default) for each prompt cut from held-out Python: the modules of
``tinyvllm.stdlib_tiny.train.HELD_OUT_MODULES``, which neither the model nor its tokenizer
was trained on.
A prompt is a top-level ``def`` or ``class`` of one of those modules with the whole lines
after it that fit in ``--prompt-tokens`` (32), ending on code. By default every such
prompt with 64 tokens after it is used (97 on Python 3.11): with 20 (``--num-prompts 20``
draws 20 with ``random.Random(seed)``) the choice changed from one seed to the next, the
syntax share of one setting moving by up to 0.2. Completion ``i`` of every setting has the
request seed ``seed + i``. On every completion:

(a) **repetition**: the share of repeated 4-grams of its token ids, ``1 - distinct / all``
    (0 when no 4 tokens repeat; a completion stuck in a loop scores near 1);
(b) **the reference**: the same statistic on the text that really follows each prompt in
    its module, cut to the same number of tokens: what real Python scores;
(c) **syntax**: the share of the completion's whole lines that come before the first
    syntax error of ``prompt + completion`` (``codeop.compile_command``, which tells an
    error from input that is only unfinished, as the interactive interpreter does; a
    last, cut-off line is not judged). Gibberish breaks brackets, indentation and
    statements, and scores low; the reference scores (about) 1.

Why syntax for (c): it is judged by Python, not by the model. The model's own likelihood
of its completions rewards low temperature and loops (a loop is very likely to the model
that wrote it), and distinct-n rewards randomness, the very thing (c) must penalise.

The choice: among the settings whose mean (a) is within ``--tolerance`` (0.05) of the
reference's, the best mean (c); ties go to the closer (a). If none is within the
tolerance, the closest (a). ``--write-config`` writes the chosen setting into the shipped
model's ``generation_config.json``: its temperature, the other fields that are not at
their neutral value, and ``do_sample`` (so that transformers' ``generate`` samples with
the file too; vLLM and tinyvllm ignore it); its other keys are kept.

Also recorded: each setting's mean tokens per completion, the share that ended at the
end-of-text token, the highest (a) of one completion, and the README's command,
``tinyvllm generate --prompt "def fibonacci(n):"``, as a fresh engine (start-up seed 0)
runs it with the chosen setting and greedily.

``--repetition-penalties 1.0,1.1,1.2`` adds the penalty to the grid once the engine
honours it (until then a value other than 1 is refused: ``validation._NOT_YET_HONOURED``).

Run: ``python bench/generation_defaults.py`` (49 settings, about three minutes on one
thread) writes ``bench/results/generation_defaults.json``; add ``--write-config`` to
update the model. ``--quick`` runs 2 settings on 2 prompts of 8 tokens (the test suite runs it; its
figures mean nothing). The run is deterministic: the prompts, the seeds and one thread.
"""

from __future__ import annotations

import argparse
import codeop
import itertools
import json
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, run_header, set_threads, write_json  # noqa: E402  (it puts src/ on the path)
from tinyvllm import LLM, SamplingParams, validation  # noqa: E402
from tinyvllm.stdlib_tiny import STDLIB_TINY  # noqa: E402
from tinyvllm.stdlib_tiny.train import HELD_OUT_MODULES, stdlib_sources  # noqa: E402

README_PROMPT = "def fibonacci(n):"
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
CONFIG_ORDER = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


# -- the statistics ----------------------------------------------------------------------------


# --8<-- [start:statistics]
def repeated_ngram_share(token_ids: list[int], n: int = 4) -> float:
    """``1 - distinct n-grams / n-grams`` of one sequence (0.0 when it has no n-gram)."""
    grams = [tuple(token_ids[i : i + n]) for i in range(len(token_ids) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def _syntax_ok(source: str) -> bool:
    """Valid Python, or the valid beginning of it (an open block, bracket or string)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences and the like
        try:
            codeop.compile_command(source, "<completion>", "exec")  # None: unfinished, not wrong
            return True
        except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError):
            return False


def syntax_lines(prompt: str, completion: str, finished: bool) -> tuple[int, int]:
    """(lines of ``completion`` before the first syntax error of prompt + completion, lines).
    Blank lines are not counted (they cannot be wrong); a last line cut off by the token
    limit is not judged, one that ended the text (``finished``: end-of-text) is."""
    if not finished:
        completion = completion[: completion.rfind("\n") + 1]  # whole lines only ("" if none)
    good = total = start = 0
    while start < len(completion):
        end = completion.find("\n", start)
        end = len(completion) if end < 0 else end
        if completion[start:end].strip():
            total += 1
            if good == total - 1 and _syntax_ok(prompt + completion[:end]):
                good += 1  # still no error up to the end of this line
        start = end + 1
    return good, total
# --8<-- [end:statistics]


# -- the prompts ---------------------------------------------------------------------------------


def held_out_prompts(tokenizer, num: int | None, prompt_tokens: int, max_tokens: int, seed: int) -> list[dict]:
    """Prompts from the held-out modules: each a top-level def or class and the whole lines
    after it within ``prompt_tokens`` tokens (ending on code), with the token ids of the
    ``max_tokens`` that really follow it. ``num`` None: every one that has ``max_tokens``
    after it; else ``num`` of them drawn with ``random.Random(seed)``."""
    sources = stdlib_sources()
    candidates = []
    for module in HELD_OUT_MODULES:
        lines = sources[module].split("\n")
        for i, line in enumerate(lines):
            if line.startswith(("def ", "class ")):
                candidates.append((module, i, lines))
    if num is not None:  # a sample; every usable prompt otherwise, in module order
        candidates = random.Random(seed).sample(candidates, len(candidates))
    chosen = []
    for module, i, lines in candidates:
        j = i + 1
        while j < len(lines) and len(tokenizer("\n".join(lines[i : j + 1])).input_ids) <= prompt_tokens:
            j += 1
        while j > i + 1 and not lines[j - 1].strip():
            j -= 1  # a prompt ends on code, not on a blank line
        prompt = "\n".join(lines[i:j])
        follow = tokenizer("\n" + "\n".join(lines[j : j + 60])).input_ids[:max_tokens]
        if len(follow) < max_tokens:
            continue  # too near the end of the module
        chosen.append({"module": module, "line": i + 1, "prompt": prompt, "reference_ids": follow})
        if len(chosen) == num:
            break
    if num is not None and len(chosen) < num:
        raise ValueError(f"the held-out modules give only {len(chosen)} prompts, {num} asked for")
    return chosen


# -- the grid ---------------------------------------------------------------------------------------


def settings(args) -> list[dict]:
    """Greedy, then every sampled combination, as ``SamplingParams`` keyword arguments."""
    grid = [{"temperature": 0.0}]
    for t, p, k, m, r in itertools.product(
        args.temperatures, args.top_ps, args.top_ks, args.min_ps, args.repetition_penalties
    ):
        grid.append({"temperature": t, "top_p": p, "top_k": k, "min_p": m, "repetition_penalty": r})
    return grid


def setting_name(fields: dict) -> str:
    if fields["temperature"] == 0:
        return "greedy"
    name = f"T={fields['temperature']:g} top_p={fields['top_p']:g} top_k={fields['top_k']} min_p={fields['min_p']:g}"
    return name + (f" rep={fields['repetition_penalty']:g}" if fields["repetition_penalty"] != 1 else "")


def config_fields(fields: dict) -> dict:
    """The generation_config.json sampling fields of a setting: the temperature, and the
    others that are away from their neutral value."""
    if fields["temperature"] == 0:
        return {"temperature": 0.0}
    return {k: fields[k] for k in CONFIG_ORDER if k == "temperature" or fields.get(k, NEUTRAL[k]) != NEUTRAL[k]}


def run_setting(llm: LLM, prompts: list[dict], fields: dict, max_tokens: int, seed: int) -> dict:
    params = [SamplingParams(**fields, max_tokens=max_tokens, seed=seed + i) for i in range(len(prompts))]
    start = time.perf_counter()
    outs = llm.generate([p["prompt"] for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    reps, lines, texts = [], [], []
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        reps.append(repeated_ngram_share(list(completion.token_ids)))
        lines.append(syntax_lines(prompt["prompt"], completion.text, completion.finish_reason == "stop"))
        texts.append(completion.text)
    good, total = sum(g for g, _ in lines), sum(n for _, n in lines)
    return {
        "name": setting_name(fields),
        "params": fields,
        "repeated_4gram_share": statistics.fmean(reps),
        "repeated_4gram_share_max": max(reps),
        "syntax_line_share": good / total if total else 0.0,
        "syntax_clean_share": sum(g == n for g, n in lines) / len(outs),
        "mean_tokens": statistics.fmean(len(o.outputs[0].token_ids) for o in outs),
        "eos_share": sum(o.outputs[0].finish_reason == "stop" for o in outs) / len(outs),
        "seconds": seconds,
        "per_completion_repeated_4gram_share": reps,
        "per_completion_syntax_lines": lines,  # (good, whole lines) of each completion
        "first_completion": texts[0],
    }


def reference_figures(tokenizer, prompts: list[dict]) -> dict:
    reps, good, total = [], 0, 0
    for p in prompts:
        reps.append(repeated_ngram_share(p["reference_ids"]))
        g, n = syntax_lines(p["prompt"], tokenizer.decode(p["reference_ids"]), finished=False)
        good, total = good + g, total + n
    return {
        "repeated_4gram_share": statistics.fmean(reps),
        "repeated_4gram_share_max": max(reps),
        "syntax_line_share": good / total if total else 0.0,
        "per_prompt_repeated_4gram_share": reps,
    }


# --8<-- [start:choose]
def choose(results: list[dict], reference: float, tolerance: float) -> tuple[dict, str]:
    """The setting within ``tolerance`` of the reference's repetition with the best syntax
    share (ties: the closer repetition); with none within it, the closest repetition."""
    gap = {id(r): abs(r["repeated_4gram_share"] - reference) for r in results}
    near = [r for r in results if gap[id(r)] <= tolerance]
    if near:
        best = max(near, key=lambda r: (round(r["syntax_line_share"], 9), -gap[id(r)]))
        why = f"best syntax_line_share of the {len(near)} settings within {tolerance} of the reference's repetition"
        return best, why
    return min(results, key=lambda r: gap[id(r)]), f"no setting within {tolerance}: the closest repetition"
# --8<-- [end:choose]


def readme_command(fields: dict, max_tokens: int) -> dict:
    """What ``tinyvllm generate --prompt "def fibonacci(n):"`` prints with these fields: a
    fresh engine (start-up seed 0, no request seed), as the command builds it."""
    llm = LLM(device="cpu", generation_config="vllm")
    [out] = llm.generate(README_PROMPT, SamplingParams(**fields, max_tokens=max_tokens), use_tqdm=False)
    ids = list(out.outputs[0].token_ids)
    return {"text": out.outputs[0].text, "repeated_4gram_share": repeated_ngram_share(ids), "tokens": len(ids)}


def write_config(fields: dict, folder: Path) -> Path:
    """The chosen fields into ``folder/generation_config.json``, its other keys kept."""
    path = folder / "generation_config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in (*CONFIG_ORDER, "do_sample")}
    keep = {k: config.pop(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    sampling = {"do_sample": fields["temperature"] > 0}  # read by transformers' generate; vLLM and tinyvllm ignore it
    path.write_text(json.dumps(keep | sampling | config_fields(fields) | config, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--temperatures", type=_floats, default=[0.5, 0.7, 0.8, 1.0])
    parser.add_argument("--top-ps", type=_floats, default=[0.9, 0.95, 1.0])
    parser.add_argument("--top-ks", type=_ints, default=[0, 40])
    parser.add_argument("--min-ps", type=_floats, default=[0.0, 0.05])
    parser.add_argument("--repetition-penalties", type=_floats, default=[1.0])
    parser.add_argument("--num-prompts", type=int, default=None, help="default: every usable prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=STDLIB_TINY)
    parser.add_argument("--write-config", action="store_true", help="write the chosen setting into the model folder")
    parser.add_argument("--quick", action="store_true", help="2 settings, 2 prompts, 8 tokens: checks the script runs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "generation_defaults.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.temperatures, args.top_ps, args.top_ks, args.min_ps = [0.7], [0.95], [0], [0.05]
        args.num_prompts, args.max_tokens = 2, 8
        if args.write_config:
            parser.error("--quick never writes the model's generation_config.json")
    if any(r != 1.0 for r in args.repetition_penalties) and "repetition_penalty" in validation._NOT_YET_HONOURED:
        parser.error("--repetition-penalties: the engine does not honour repetition_penalty yet (only 1.0 runs)")
    threads = set_threads(args.threads)
    started = time.perf_counter()
    llm = LLM(args.model, device="cpu", generation_config="vllm")  # every field of every setting is explicit
    prompts = held_out_prompts(llm.get_tokenizer(), args.num_prompts, args.prompt_tokens, args.max_tokens, args.seed)
    reference = reference_figures(llm.get_tokenizer(), prompts)
    ref_rep, ref_syntax = reference["repeated_4gram_share"], reference["syntax_line_share"]
    print(f"reference: repeated 4-grams {ref_rep:.3f}, syntax {ref_syntax:.3f}")
    results = []
    for fields in settings(args):
        result = run_setting(llm, prompts, fields, args.max_tokens, args.seed)
        results.append(result)
        print(
            f"{result['name']:42s} repeated 4-grams {result['repeated_4gram_share']:.3f} "
            f"(max {result['repeated_4gram_share_max']:.2f}), syntax {result['syntax_line_share']:.3f}, "
            f"{result['mean_tokens']:.1f} tokens, {result['seconds']:.2f} s"
        )
    chosen, why = choose(results, reference["repeated_4gram_share"], args.tolerance)
    print(f"chosen: {chosen['name']} ({why})")
    readme = {
        "prompt": README_PROMPT,
        "greedy": readme_command({"temperature": 0.0}, args.max_tokens),
        "chosen": readme_command(chosen["params"], args.max_tokens),
    }
    record = {
        "benchmark": "generation_defaults",
        "quick": args.quick,
        **run_header("generation_defaults.py", argv),
        "threads": threads,
        "model": Path(args.model).name,
        "workload": {
            "num_prompts": len(prompts), "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
            "seed": args.seed, "held_out_modules": list(HELD_OUT_MODULES),
            "prompts": [{k: p[k] for k in ("module", "line", "prompt")} for p in prompts],
        },  # fmt: skip
        "reference": reference,
        "settings": results,
        "rule": {"tolerance": args.tolerance, "why": why},
        "chosen": {
            "name": chosen["name"], "params": chosen["params"], "generation_config": config_fields(chosen["params"]),
        },  # fmt: skip
        "readme_command": readme,
        "seconds": time.perf_counter() - started,
    }
    write_json(args.out, record)
    if args.write_config:
        write_config(chosen["params"], Path(args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
