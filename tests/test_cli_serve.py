"""``tinyvllm serve``: the engine flags it shares with ``generate``, its own flags, its
one-line errors, and a real start on 127.0.0.1 answered by the ``openai`` client."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

import pytest
from serve_fixtures import free_port, require_serve_extra, wait_until_healthy

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
    assert {"--model", "--host", "--port", "--served-model-name", "--max-waiting-requests", "--chat-template",
            "--api-key", "--allowed-origins", "--max-request-body-bytes"} <= _flags("serve")  # fmt: skip
    for flag in ("--device", "--dtype", "--max-model-len", "--num-gpu-blocks-override", "--attention-backend",
                 "--no-prefix-caching", "--cudagraph-mode", "--enforce-eager"):  # fmt: skip
        assert flag in engine, flag


def test_serve_runner_and_pooler_config_reach_the_engine_args():
    """``--runner pooling --pooler-config JSON``: checked by ``_pooler_args``, then ``EngineArgs``' fields."""
    from tinyvllm.engine.engine_args import EngineArgs

    args = cli.build_parser().parse_args(["serve", "--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN"}'])
    args.pooler = cli._pooler_args(args)
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.runner, engine_args.pooler_config) == ("pooling", {"pooling_type": "MEAN"})
    default = cli.build_parser().parse_args(["serve"])
    default.pooler = cli._pooler_args(default)
    assert (EngineArgs.from_cli_args(default).runner, EngineArgs.from_cli_args(default).pooler_config) == ("auto", None)


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    cli.add_engine_args(parser)
    return parser


def test_serve_refuses_a_missing_folder(tmp_path):
    assert_one_line_error(run_cli("serve", "--model", str(tmp_path / "nope")), "nope")


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--port", "70000"], "--port must be in [0, 65535], got 70000"),
        (["--max-waiting-requests", "0"], "--max-waiting-requests must be >= 1"),
        (["--max-request-body-bytes", "0"], "--max-request-body-bytes must be >= 1, got 0"),
        (["--api-key", ""], "--api-key must not be empty"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout must be a number of seconds >= 0, got -1.0"),
        (["--shutdown-timeout", "nan"], "--shutdown-timeout must be a number of seconds >= 0, got nan"),
        (["--allowed-origins", "[1]"], "--allowed-origins must list strings"),
        (["--allowed-origins", "[oops"], "--allowed-origins is not a JSON list"),
        (["--chat-template", "no_such_template.jinja"], "is neither a file nor a Jinja template"),
        (["--chat-template", "{% for m in messages %}"], "--chat-template: the chat template is not valid Jinja"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice and --tool-call-parser go together"),
        (["--tool-call-parser", "hermes"], "--enable-auto-tool-choice and --tool-call-parser go together"),
        (["--runner", "pooling", "--pooler-config", "{oops"], "--pooler-config must be a JSON object, got '{oops'"),
        (["--pooler-config", '{"pooling_type": "MEAN"}'], "needs runner='pooling': runner='auto' chose 'generate' for Qwen3ForCausalLM"),
        (["--runner", "pooling", "--pooler-config", '{"pooling_type": "SUM"}'], "--pooler-config: pooler_config pooling_type"),
        (["--runner", "pooling", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
         "--runner: runner='pooling' cannot be combined with speculative_config"),
    ],
)
def test_serve_refuses_bad_values(tiny_model_dirs, flags, words):
    assert_one_line_error(run_cli("serve", "--model", str(tiny_model_dirs["qwen3"]), *flags), words)


@pytest.mark.parametrize("shipped", [False, True])
@pytest.mark.slow
def test_serve_starts_and_answers_with_the_model_path_as_name(tiny_model_dirs, tmp_path, shipped):
    """``--served-model-name`` defaults to ``--model``; with no ``--model`` the shipped model
    is served, as ``stdlib_tiny``. Chat answers on both: the shipped model with its own chat
    template, the tiny model (which has none) with ``--chat-template FILE``."""
    model = "stdlib_tiny" if shipped else str(tiny_model_dirs["qwen3"])
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:", encoding="utf-8")
    port = free_port()
    cmd = [sys.executable, "-m", "tinyvllm", "serve", *([] if shipped else ["--model", model, "--chat-template", str(template)]),
           "--port", str(port), "--device", "cpu", "--max-model-len", "64", "--num-gpu-blocks-override", "64"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", lambda: proc.poll() is None, 120, proc.stdout.read)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [model]  # --served-model-name defaults to --model
        out = client.completions.create(model=model, prompt="def f():", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens >= 1
        messages = [{"role": "user", "content": "Write a loop."}]
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0)
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
        rendered = httpx.post(f"http://127.0.0.1:{port}/tokenize", json={"messages": messages, "return_token_strs": True})
        text = "".join(rendered.json()["token_strs"]).replace("Ġ", " ").replace("Ċ", "\n")  # byte-level symbols
        assert text == ("# user: Write a loop.\n# assistant:\n" if shipped else "user: Write a loop.\nassistant:")
    finally:
        proc.send_signal(signal.SIGINT)  # uvicorn shuts down on Ctrl-C
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    output = proc.stdout.read()  # the banner, once the server listens: the name, the address, the context, the KV cache
    assert f"[tinyvllm] serving {model!r} at http://127.0.0.1:{port}/v1\n" in output, output
    assert "[tinyvllm] max_model_len 64; KV cache 64 blocks of 16 tokens (1024 tokens)\n" in output, output
