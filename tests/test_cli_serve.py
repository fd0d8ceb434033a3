"""``tinyvllm serve``: the engine flags it shares with ``generate``, its own flags, its
one-line errors, and a real start on 127.0.0.1 answered by the ``openai`` client."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

import pytest
from serve_fixtures import free_port, require_serve_extra

require_serve_extra()  # without the serve extra (the GPU machine) this module skips at collection

import httpx  # noqa: E402
import openai  # noqa: E402
from test_cli import ENV, assert_one_line_error, run_cli  # noqa: E402

from tinyvllm import cli  # noqa: E402


def _flags(command: str) -> set[str]:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    {"generate": cli._add_generate, "serve": cli._add_serve}[command](sub)
    return {opt for action in sub.choices[command]._actions for opt in action.option_strings}


def test_serve_takes_every_engine_flag_of_generate():
    engine = {opt for action in _engine_parser()._actions for opt in action.option_strings} - {"-h", "--help"}
    assert engine and engine <= _flags("serve") and engine <= _flags("generate")
    assert {"--model", "--host", "--port", "--served-model-name", "--max-waiting-requests"} <= _flags("serve")
    for flag in ("--device", "--dtype", "--max-model-len", "--num-gpu-blocks-override", "--attention-backend",
                 "--no-prefix-caching", "--cudagraph-mode", "--enforce-eager"):  # fmt: skip
        assert flag in engine, flag


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    cli.add_engine_args(parser)
    return parser


def test_serve_refuses_a_missing_folder(tmp_path):
    assert_one_line_error(run_cli("serve", "--model", str(tmp_path / "nope")), "nope")


@pytest.mark.parametrize("flags, words", [(["--port", "70000"], "--port must be in [0, 65535], got 70000"),
                                          (["--max-waiting-requests", "0"], "--max-waiting-requests must be >= 1")])  # fmt: skip
def test_serve_refuses_bad_numbers(tiny_model_dirs, flags, words):
    assert_one_line_error(run_cli("serve", "--model", str(tiny_model_dirs["qwen3"]), *flags), words)


@pytest.mark.parametrize("shipped", [False, True])
def test_serve_starts_and_answers_with_the_model_path_as_name(tiny_model_dirs, shipped):
    """``--served-model-name`` defaults to ``--model``; with no ``--model`` the shipped model
    is served, as ``stdlib_tiny``."""
    model = "stdlib_tiny" if shipped else str(tiny_model_dirs["qwen3"])
    port = free_port()
    cmd = [sys.executable, "-m", "tinyvllm", "serve", *([] if shipped else ["--model", model]), "--port", str(port),
           "--device", "cpu", "--max-model-len", "64", "--num-gpu-blocks-override", "64"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not start in 120 s"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [model]  # --served-model-name defaults to --model
        out = client.completions.create(model=model, prompt="def f():", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGINT)  # uvicorn shuts down on Ctrl-C
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
