"""Every ``tinyvllm`` subcommand, driven through ``cli.main`` with real arguments.

Contract (``tinyvllm/cli.py``): ``generate``, ``serve``, ``tiny-model``, ``train-tiny`` and
``trace`` (``--list``, ``--workload``, ``--prompts``) each run to the end and return 0 with
what they print or write; the cheap checks (an empty ``--prompt``, a port in use,
``--threads``) fail in a fraction of a second, before torch or the model loads, as one line
and status 2. The engine runs on the shipped model (``stdlib_tiny``) on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from serve_fixtures import free_port, require_serve_extra, wait_until_healthy

from tinyvllm import cli

ROOT = Path(__file__).resolve().parents[1]


def test_trace_list_prints_every_workload(capsys):
    from tinyvllm.trace.workloads import WORKLOADS

    assert cli.main(["trace", "--list"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == list(WORKLOADS)
    assert "seed002-prefix-caching" in out


def test_trace_workload_writes_the_viewer(tmp_path, capsys):
    out_html = tmp_path / "trace.html"
    assert cli.main(["trace", "--workload", "seed002-prefix-caching", "--out", str(out_html)]) == 0
    html = out_html.read_text(encoding="utf-8")
    assert html.startswith("<!doctype html>") and html.count("<svg") >= 7  # a still per step
    printed = capsys.readouterr().out
    assert printed.startswith("[tinyvllm] 7 steps of ") and str(out_html) in printed  # steps 0-6 of seed 002 §3.2


def test_trace_prompts_runs_the_shipped_model(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\n\ndef main():\n", encoding="utf-8")
    out_html, out_json = tmp_path / "t.html", tmp_path / "t.json"
    argv = ["trace", "--prompts", str(prompts), "--max-tokens", "3", "--device", "cpu", "--max-model-len", "64",
            "--num-gpu-blocks-override", "16", "--out", str(out_html), "--json", str(out_json)]  # fmt: skip
    assert cli.main(argv) == 0
    import json

    trace = json.loads(out_json.read_text(encoding="utf-8"))
    assert trace["title"] == "2 prompts on stdlib_tiny, block size 16"
    assert len(trace["steps"]) >= 3  # the prefill step, then at least two decode steps of 3 tokens each
    assert out_html.stat().st_size > 0
    assert capsys.readouterr().out.startswith(f"[tinyvllm] {len(trace['steps'])} steps of ")


# -- generate, tiny-model, train-tiny ----------------------------------------------------------


@pytest.fixture
def torch_threads(monkeypatch):
    """torch's thread count, restored after the test (the engine sets it for the process);
    ``OMP_NUM_THREADS`` unset, so the rule of ``cpu_threads.py`` applies."""
    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield torch
    torch.set_num_threads(before)


def test_generate_runs_the_shipped_model_on_one_thread(torch_threads, capsys):
    """No ``--model``: the shipped 5.7M model, small enough for one thread (cpu_threads.py NOTE 2)."""
    torch_threads.set_num_threads(2)
    argv = ["generate", "--prompt", "def fibonacci(n):", "--max-tokens", "4", "--temperature", "0", "--device", "cpu"]
    assert cli.main(argv) == 0
    completion, figures = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    assert completion.strip()
    assert figures.startswith("[tinyvllm] prompt ") and "generated 4 tokens" in figures, figures
    assert figures.endswith(", torch threads 1"), figures
    assert torch_threads.get_num_threads() == 1


@pytest.mark.parametrize("flags, want", [(["--threads", "2"], 2), (["--threads", "1"], 1)])
def test_generate_threads_flag_overrides_the_rule(torch_threads, capsys, flags, want):
    torch_threads.set_num_threads(3 - want)  # the other count, so the flag has something to change
    argv = ["generate", "--prompt", "import os", "--max-tokens", "2", "--device", "cpu", *flags]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.rstrip("\n").endswith(f", torch threads {want}")
    assert torch_threads.get_num_threads() == want


def test_omp_num_threads_in_the_environment_is_kept(torch_threads, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch_threads.set_num_threads(2)  # what torch read from the variable at import
    assert cli.main(["generate", "--prompt", "import os", "--max-tokens", "2", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.rstrip("\n").endswith(", torch threads 2")


def test_tiny_model_writes_a_folder_generate_runs(tmp_path, torch_threads, capsys):
    folder = tmp_path / "tiny"
    assert cli.main(["tiny-model", str(folder), "--family", "llama"]) == 0
    assert capsys.readouterr().out.strip() == str(folder)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    argv = ["generate", "--model", str(folder), "--prompt", "a b", "--max-tokens", "3", "--device", "cpu"]
    assert cli.main(argv) == 0
    assert "generated 3 tokens" in capsys.readouterr().out


@pytest.mark.slow
def test_train_tiny_smallest_run_writes_a_model(tmp_path, torch_threads, capsys):
    """The smallest settings the flags allow: one step of the test shape on one module."""
    out = tmp_path / "m"
    argv = ["train-tiny", str(out), "--size", "test", "--vocab-size", "300", "--seq-len", "16", "--context-len", "32",
            "--batch-size", "1", "--max-steps", "1", "--warmup-steps", "0", "--eval-every", "1", "--eval-windows", "1",
            "--modules", "string", "--threads", "1", "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    import json

    record = json.loads((out / "training.json").read_text())
    assert record["time"]["steps"] == 1 and record["data"]["train_modules"] == ["string"]
    assert capsys.readouterr().out.startswith(f"{out}: 18,944 parameters, 1 steps in ")


def test_serve_answers_then_stops(torch_threads, monkeypatch, capsys):
    """``serve`` through ``cli.main`` on a thread, with the shipped model: it says its thread
    count, answers a completion over HTTP, and returns 0 when its uvicorn server is told to exit."""
    require_serve_extra()
    import importlib
    import threading

    import httpx

    server_class = importlib.import_module("uvicorn.server").Server
    servers, real_init = [], server_class.__init__

    def recording_init(self, *args, **kwargs):  # the real server (or a subclass), remembered to stop it
        real_init(self, *args, **kwargs)
        servers.append(self)

    monkeypatch.setattr(server_class, "__init__", recording_init)
    port = free_port()
    argv = ["serve", "--port", str(port), "--device", "cpu", "--max-model-len", "64", "--num-gpu-blocks-override", "16"]
    status = []
    thread = threading.Thread(target=lambda: status.append(cli.main(argv)), daemon=True)
    thread.start()
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", thread.is_alive, 60, lambda: str(status))
        body = {"model": "stdlib_tiny", "prompt": "def f():", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30).json()
        assert answer["model"] == "stdlib_tiny" and answer["usage"]["completion_tokens"] == 3, answer
    finally:
        for server in servers:
            server.should_exit = True
        thread.join(timeout=30)
    assert status == [0]
    assert "[tinyvllm] device cpu, dtype float32, attention backend torch, torch threads 1\n" in capsys.readouterr().err


def test_the_thread_rule_by_model_size():
    """cpu_threads.py NOTE 2: one thread under 100M parameters on the CPU; torch's own count
    (None) for a larger model, on a GPU, or when OMP_NUM_THREADS is set."""
    from tinyvllm.cpu_threads import choose_torch_threads, count_parameters

    stdlib_tiny = count_parameters(6144, 256, 640, 6, 4, 2, 64, tie_word_embeddings=True)
    qwen3_0_6b = count_parameters(151936, 1024, 3072, 28, 16, 8, 128, tie_word_embeddings=True)
    assert (stdlib_tiny, qwen3_0_6b) == (5_701_632, 595_984_384)  # Qwen3-0.6B: 596,049,920 with its norms
    assert choose_torch_threads(stdlib_tiny, on_cpu=True, environ={}) == 1
    assert choose_torch_threads(qwen3_0_6b, on_cpu=True, environ={}) is None
    assert choose_torch_threads(stdlib_tiny, on_cpu=False, environ={}) is None
    assert choose_torch_threads(stdlib_tiny, on_cpu=True, environ={"OMP_NUM_THREADS": "2"}) is None


# -- checks before anything loads -------------------------------------------------------------


@pytest.fixture
def no_engine(monkeypatch):
    """Fails the test if the engine is built: these checks must come before it."""
    monkeypatch.setattr(cli, "llm_from_args", lambda args: pytest.fail("the engine was built before the check"))


def _one_line_error(capsys, *fragments: str) -> str:
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and out.err.startswith("tinyvllm: error: "), out
    for fragment in fragments:
        assert fragment in out.err, (fragment, out.err)
    return out.err


@pytest.mark.parametrize(
    "field, flag", [("max_model_len", "--max-model-len"), ("num_gpu_blocks_override", "--num-gpu-blocks-override"),
                    ("torch_threads", "--threads")],
)  # fmt: skip
def test_the_command_line_and_llm_refuse_a_count_by_one_rule(no_engine, capsys, field, flag):
    """Issue 37: a count is checked by EngineArgs' rule wherever it comes from; the command
    line only spells the flag (``engine_args.CLI_NAMES``), before torch loads."""
    from tinyvllm import LLM

    with pytest.raises(ValueError) as engine_error:
        LLM(**{field: 0})
    assert cli.main(["generate", "--prompt", "p", flag, "0"]) == 2
    _one_line_error(capsys, str(engine_error.value).replace(field, flag))


@pytest.mark.parametrize("command", [["generate", "--prompt", "p"], ["serve"], ["trace", "--prompts"]])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_threads_below_one_is_refused_before_loading(no_engine, capsys, tmp_path, command, value):
    if command[-1] == "--prompts":
        (tmp_path / "p.txt").write_text("import os\n", encoding="utf-8")
        command = [*command, str(tmp_path / "p.txt")]
    assert cli.main([*command, "--threads", value]) == 2
    _one_line_error(capsys, f"--threads must be an int >= 1, got {value}")


def test_empty_prompt_is_refused_before_loading(no_engine, capsys):
    import time

    started = time.perf_counter()
    assert cli.main(["generate", "--prompt", ""]) == 2
    assert time.perf_counter() - started < 1.0
    _one_line_error(capsys, "--prompt must not be empty")


def test_serve_port_in_use_is_refused_before_loading(no_engine, capsys):
    import socket
    import time

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.perf_counter()
        assert cli.main(["serve", "--port", str(port)]) == 2
        assert time.perf_counter() - started < 1.0
    _one_line_error(capsys, f"--port {port}", "127.0.0.1", "in use")


def test_serve_holds_its_port_from_the_check_to_the_server(monkeypatch, capsys):
    """The port is bound before the model loads and that very socket is served: another
    process cannot take it while the model loads (a check that closed its probe left a race)."""
    import socket

    from serve_fixtures import free_port

    port = free_port()
    seen = {}

    def loading(args):  # stands for the model's load: the port must be taken meanwhile
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            try:
                other.bind(("127.0.0.1", port))
                seen["bound"] = True
            except OSError:
                seen["bound"] = False
        raise ValueError("stop here")

    monkeypatch.setattr(cli, "llm_from_args", loading)
    assert cli.main(["serve", "--port", str(port)]) == 2
    assert seen == {"bound": False}
    with socket.socket() as after:  # and released when serve ends
        after.bind(("127.0.0.1", port))


# -- the install ----------------------------------------------------------------------------


def _first_command(readme: str) -> str:
    """The README's first command: the first line of the first bash block under "Two commands"."""
    section = readme.split("## Two commands", 1)[1]
    return section.split("```bash\n", 1)[1].split("\n", 1)[0]


def test_install_resolves_torch_and_triton_to_the_cpu_pins_first():
    """The main dependencies bound torch and triton so that no release past the ``cpu``
    extra's pins can be the resolver's first choice: unbounded, pip took torch 2.14.1 and
    triton 3.9.0 first, then backtracked to the pins (484 MB of triton downloaded twice).
    And the README's first command installs what generating needs, not ``[ci]``."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    main = {r.name: r for r in map(Requirement, project["dependencies"])}
    pins = {r.name: r for r in map(Requirement, project["optional-dependencies"]["cpu"])}
    assert set(pins) == {"torch", "triton"}
    for name, pin in pins.items():
        [spec] = pin.specifier
        assert spec.operator == "==", pin
        release = Version(spec.version).release
        assert main[name].specifier.contains(spec.version), (main[name], pin)
        next_minor = f"{release[0]}.{release[1] + 1}.0"
        assert not main[name].specifier.contains(next_minor), f"{main[name]} lets the resolver try {name} {next_minor}"
        assert main[name].marker == pin.marker, (main[name], pin)
    first = _first_command((ROOT / "README.md").read_text(encoding="utf-8"))
    assert "pip install -e . " in first and "[ci]" not in first and "tinyvllm generate" in first, first


def test_a_reader_that_goes_away_ends_the_output_quietly():
    """``tinyvllm trace --list | head -2`` printed ``tinyvllm: error: [Errno 32] Broken pipe``
    (exit 2). Here the reader is gone before anything is written: a pipe whose read end is
    closed, so the very first flush fails, as the last ones do after ``head`` exits."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tinyvllm", "trace", "--list"], stdout=write_end, stderr=subprocess.PIPE,
            text=True, timeout=60,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (cli.EXIT_BROKEN_PIPE, "")


def test_starting_the_engine_does_not_import_torch_dynamo():
    """Building the model on the meta device ran nn.Embedding's random init and rotary's
    arithmetic through torch's reference ops, which import torch._dynamo: about 0.75-2.6 s
    of start-up for nothing (``models/llama.py``)."""
    import subprocess
    import sys

    code = "import sys\nfrom tinyvllm import LLM\nLLM().generate('x', use_tqdm=False)\nprint('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_generate_constraint_flags_shape_the_completion(torch_threads, tmp_path, capsys):
    """``--choice`` and ``--json-schema`` (a file; the schema's own text and ``--regex`` reach xgrammar in the next test)."""
    pytest.importorskip("xgrammar")
    import json

    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["age"], "additionalProperties": False}  # fmt: skip
    (tmp_path / "age.json").write_text(json.dumps(schema), encoding="utf-8")
    base = ["generate", "--max-tokens", "30", "--temperature", "0", "--device", "cpu", "--threads", "1"]
    cases = [(["--prompt", "Is the sky blue?", "--choice", "yes,no"], lambda t: t == "no"),
             (["--prompt", "x = ", "--json-schema", str(tmp_path / "age.json")], lambda t: json.loads(t)["age"] in range(100))]  # fmt: skip
    for flags, ok in cases:
        assert cli.main(base + flags) == 0
        completion, figures = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
        assert ok(completion) and figures.endswith("finish_reason=stop, torch threads 1"), (flags, completion, figures)


@pytest.mark.parametrize("flags, message", [
    (["--regex", "(unclosed"], "tinyvllm: error: --regex: structured_outputs regex is not a valid regex: "),
    (["--json-schema", '{"type": "nope"}'], "tinyvllm: error: --json-schema: structured_outputs json is not a valid json: "),
    (["--json-schema", "{not json"], "tinyvllm: error: --json-schema: must be a JSON object, got '{not json'"),
    (["--json-schema", "missing.json"], "tinyvllm: error: --json-schema 'missing.json' is neither a JSON object nor a readable file"),
    (["--choice", "a,,b"], "tinyvllm: error: --choice: structured_outputs choice must hold non-empty strs"),
])  # fmt: skip
def test_a_bad_constraint_flag_is_one_line_naming_it_before_the_model_loads(flags, message, capsys):
    pytest.importorskip("xgrammar")
    assert cli.main(["generate", "--prompt", "p", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_two_constraint_flags_are_argparse_s_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "--prompt", "p", "--regex", "a", "--choice", "a,b"])
    assert info.value.code == 2 and "argument --choice: not allowed with argument --regex" in capsys.readouterr().err
