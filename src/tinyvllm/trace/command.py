"""``tinyvllm trace``: record a run and write its viewer (and, if asked, stills and JSON).

    tinyvllm trace --workload seed002-prefix-caching --out trace.html
    tinyvllm trace --prompts prompts.txt --max-tokens 8 --block-size 16 \\
        --max-num-batched-tokens 32 --num-gpu-blocks-override 24 --out trace.html

``--workload NAME`` replays a built-in example (``workloads.py``; ``--list`` prints them).
``--prompts FILE`` runs any prompts, one per line (blank lines skipped), through an engine
built from the same flags as ``tinyvllm generate`` (``--model``, ``--cudagraph-mode``, ...)
and three that shape the picture: ``--block-size``, ``--max-num-seqs`` and
``--max-num-batched-tokens``; ``--max-tokens`` (default 16), ``--temperature`` (default 0,
greedy) and ``--seed`` set the sampling. ``--out`` (default ``trace.html``) is the viewer;
``--svg-dir DIR`` also writes every step's still (``step-NN.svg``) and the whole-run
pictures that apply (``budget.svg``, ``tables.svg``, ``padding.svg``); ``--json PATH`` the
trace itself. ``--max-steps`` (default 100) caps the steps ``--prompts`` records: a step's
picture is about 200 KB on a real pool, so the viewer stays a file a browser opens; the
run goes on to the end, and one warning line says how many steps were left out.
``--tensor-parallel-size N`` records an engine of N ranks: the same steps as one rank, and a
line per rank (weights, KV heads, cache) under the title (``recorder.py`` NOTE 7).

Errors follow ``tinyvllm/cli.py``: a bad value is one line on stderr and exit status 2; a
warning is one line, ``tinyvllm: warning: ...``, on stderr (the cap, or a recorder that
stopped on an error of its own: ``recorder.py`` NOTE 5).
Torch is imported only for the workloads and runs that need it.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from tinyvllm.trace.workloads import WORKLOADS

DEFAULT_MAX_STEPS = 100  # about 20 MB of viewer with the shipped model's default pool
DESCRIPTION = "record every engine step of a run and write a self-contained HTML viewer (inline SVG, no network)"


def add_arguments(p: argparse.ArgumentParser, add_model_arg, add_engine_args) -> None:
    """The ``trace`` subcommand's flags; the model and engine flags are ``generate``'s own."""
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--workload", choices=sorted(WORKLOADS), help="a built-in example (see --list)")
    what.add_argument("--prompts", metavar="FILE", help="a text file of prompts, one per line")
    what.add_argument("--list", action="store_true", help="list the built-in workloads and exit")
    p.add_argument("--out", default="trace.html", help="the viewer to write (default: trace.html)")
    p.add_argument("--svg-dir", default=None, metavar="DIR", help="also write every step's SVG into DIR")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the trace as JSON")
    p.add_argument("--title", default=None, help="the viewer's title (--prompts)")
    p.add_argument("--max-steps", type=int, default=DEFAULT_MAX_STEPS,
                   help=f"record at most this many steps of --prompts (default: {DEFAULT_MAX_STEPS}); the run goes on")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate per prompt (default: 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="the most requests in a step (default: 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="the token budget of a step")
    add_model_arg(p)
    add_engine_args(p)


def read_prompts(path: str) -> list[str]:
    """The non-blank lines of ``path`` (ValueError when there is none)."""
    lines = [line.rstrip("\r") for line in Path(path).read_text(encoding="utf-8").split("\n")]
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {path}: the file holds no prompt (one per line)")
    return prompts


def record_prompts(args, llm_from_args):
    """Run ``--prompts`` through the engine the flags describe, recording every step."""
    from tinyvllm.sampling_params import SamplingParams
    from tinyvllm.trace.recorder import record

    prompts = read_prompts(args.prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    llm = llm_from_args(args)
    title = args.title or f"{len(prompts)} prompts on {Path(args.model).name}, block size {args.block_size}"
    description = f"tinyvllm trace --prompts {args.prompts}: max_tokens {args.max_tokens}, temperature {args.temperature}"
    try:
        with warnings.catch_warnings():  # the recorder's own warnings become one line each, below
            warnings.filterwarnings("ignore", message="tinyvllm.trace: ", category=RuntimeWarning)
            with record(llm, title=title, description=description, max_steps=args.max_steps) as recorder:
                llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()  # with --tensor-parallel-size > 1 the worker processes end here
    if recorder.num_unrecorded:
        total = len(recorder.steps) + recorder.num_unrecorded
        print(f"tinyvllm: warning: recorded the first {len(recorder.steps)} of {total} steps (--max-steps "
              f"{args.max_steps}); the viewer shows those", file=sys.stderr)  # fmt: skip
    if recorder.error is not None:
        print(f"tinyvllm: warning: recording stopped at step {len(recorder.steps)}: the recorder raised "
              f"{type(recorder.error).__name__}: {recorder.error}", file=sys.stderr)  # fmt: skip
    if not recorder.steps:
        raise ValueError("nothing was recorded, so there is no viewer to write")
    return recorder.trace


def write_outputs(trace, args) -> list[Path]:
    from tinyvllm.trace.svg_runs import RUN_FIGURES
    from tinyvllm.trace.viewer import write_html, write_svgs

    written = [write_html(trace, args.out)]
    if args.svg_dir:
        written += write_svgs(trace, args.svg_dir)
        for name, draw in RUN_FIGURES.items():
            try:
                svg = draw(trace)
            except ValueError:  # nothing of that kind in this trace
                continue
            path = Path(args.svg_dir) / f"{name}.svg"
            path.write_text(svg, encoding="utf-8")
            written.append(path)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(trace.to_json(), encoding="utf-8")
        written.append(path)
    return written


def run(args, check_engine_args, llm_from_args) -> int:
    """``tinyvllm trace``; the two functions are ``cli.py``'s (checks without torch, the engine)."""
    if args.list:
        for name, workload in WORKLOADS.items():
            print(f"{name:24} {workload.title}")
        return 0
    for flag, value in (("--max-tokens", args.max_tokens), ("--block-size", args.block_size), ("--max-num-seqs", args.max_num_seqs)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.max_steps < 1:
        raise ValueError(f"--max-steps must be >= 1, got {args.max_steps}")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        raise ValueError(f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}")
    if args.workload:
        from tinyvllm.trace.workloads import run_workload

        trace = run_workload(args.workload)
    else:
        read_prompts(args.prompts)  # a missing or empty file fails before torch is imported
        check_engine_args(args)
        trace = record_prompts(args, llm_from_args)
    written = write_outputs(trace, args)
    print(f"[tinyvllm] {len(trace.steps)} steps of {trace.title!r}: wrote {', '.join(map(str, written[:3]))}"
          + (f" and {len(written) - 3} more files" if len(written) > 3 else ""))  # fmt: skip
    return 0
