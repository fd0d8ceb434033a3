"""``tinyvllm trace --prompts``: the step cap that keeps the viewer a file a browser opens.

A 150-step run of the shipped model on its default pool made a 30 MB viewer; ``--max-steps``
(default 100) records the first steps only, lets the run finish, and says so in one
``tinyvllm: warning:`` line. A bad cap is a ``ValueError`` naming the value, before any
engine is built. Driven through ``command.run`` with ``cli.py``'s own parser and engine.
"""

from __future__ import annotations

import json

import pytest

from tinyvllm import cli
from tinyvllm.trace import command


def _args(tmp_path, *extra: str):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\n", encoding="utf-8")
    argv = ["trace", "--prompts", str(prompts), "--max-tokens", "5", "--device", "cpu", "--max-model-len", "64",
            "--num-gpu-blocks-override", "16", "--out", str(tmp_path / "t.html"), "--json", str(tmp_path / "t.json"),
            *extra]  # fmt: skip
    return cli.build_parser().parse_args(argv)


def test_max_steps_caps_the_recording_and_warns_in_one_line(tmp_path, capsys):
    args = _args(tmp_path, "--max-steps", "2")
    assert command.run(args, cli._check_engine_args, cli.llm_from_args) == 0
    trace = json.loads((tmp_path / "t.json").read_text(encoding="utf-8"))
    assert len(trace["steps"]) == 2  # of the 5 steps a 5-token greedy request takes
    out, err = capsys.readouterr()
    assert out.startswith("[tinyvllm] 2 steps of ")
    assert err.strip().splitlines() == ["tinyvllm: warning: recorded the first 2 of 5 steps (--max-steps 2); the viewer shows those"]
    assert command.DEFAULT_MAX_STEPS == _args(tmp_path).max_steps == 100


def test_a_bad_max_steps_is_a_value_error_naming_it(tmp_path):
    args = _args(tmp_path, "--max-steps", "0")
    with pytest.raises(ValueError, match="--max-steps must be >= 1, got 0"):
        command.run(args, cli._check_engine_args, lambda a: pytest.fail("the engine was built"))
    assert not (tmp_path / "t.html").exists()


def test_async_scheduling_with_speculation_is_recorded_with_its_placeholder_drafts(tmp_path):
    """The runner runs the drafts it proposes in place of the scheduler's placeholders
    (``recorder.py`` NOTE 8): the command records the pair, every snapshot passes
    ``check_trace``, and a step in flight carries placeholder drafts."""
    from tinyvllm.trace import check_trace
    from tinyvllm.trace.snapshot import Trace

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\nimport sys\nimport os\nimport sys\n", encoding="utf-8")
    args = _args(tmp_path, "--async-scheduling", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                 "--max-tokens", "12")  # fmt: skip
    args.prompts = str(prompts)
    assert command.run(args, cli._check_engine_args, cli.llm_from_args) == 0
    trace = Trace.from_json((tmp_path / "t.json").read_text(encoding="utf-8"))
    check_trace(trace)
    assert any(x.num_draft_tokens for step in trace.steps for x in step.in_flight or ()), "no placeholder drafts in flight"
    assert (tmp_path / "t.html").exists()
