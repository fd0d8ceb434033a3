"""The command line on a new user's mistakes: bad flags and broken model folders.

Contract (``tinyvllm/cli.py``): a user error exits with status 2 and prints exactly one
line on stderr, ``tinyvllm: error: <message naming the value>``, nothing on stdout, and no
traceback; argparse's own refusals keep argparse's usage and message (status 2); Ctrl-C is
one line and status 130; a bug keeps its traceback. A good run prints nothing on stderr,
so "exactly one line" is checked strictly, not "the last line".

Each folder case copies a tiny model (``tiny_model_dirs``) into ``tmp_path`` and breaks
one thing. The CLI runs in a subprocess, as a user would run it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tinyvllm import cli

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false"}


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tinyvllm", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)


def generate(model: Path | str, *flags: str) -> subprocess.CompletedProcess:
    return run_cli("generate", "--model", str(model), "--prompt", "def add(a, b):", "--device", "cpu", *flags)


def assert_one_line_error(out: subprocess.CompletedProcess, *fragments: str) -> str:
    """Status 2, nothing on stdout, exactly one stderr line, the error, naming ``fragments``."""
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("tinyvllm: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert out.stdout == ""
    return lines[0]


def assert_argparse_error(out: subprocess.CompletedProcess, fragment: str) -> None:
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.splitlines()
    assert lines[0].startswith("usage: tinyvllm") and "error:" in lines[-1] and fragment in lines[-1], out.stderr


# -- broken folders ----------------------------------------------------------------------------


def _edit_json(name: str, edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        data = json.loads((folder / name).read_text())
        edit(data)
        (folder / name).write_text(json.dumps(data))

    return apply


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_text(text)


def _truncate(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def _empty_weights(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"")


def _index_to(target: Callable[[Path], str]) -> Callable[[Path], None]:
    """An index whose single shard is ``target(folder)``; the real weights become that shard."""

    def apply(folder: Path) -> None:
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), framework="numpy") as handle:
            names = list(handle.keys())
        shard = target(folder)
        weight_map = {name: shard for name in names}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    return apply


def _outside_copy(folder: Path) -> Path:
    outside = folder.parent / "outside.safetensors"
    shutil.copy(folder / "model.safetensors", outside)
    return outside


def _parent_shard(folder: Path) -> str:
    _outside_copy(folder)
    return "../outside.safetensors"


def _absolute_shard(folder: Path) -> str:
    return str(_outside_copy(folder))


def _symlinked_shard(folder: Path) -> str:
    (folder / "model-00001-of-00001.safetensors").symlink_to(_outside_copy(folder))
    return "model-00001-of-00001.safetensors"


def _remove_tokenizer(folder: Path) -> None:
    for f in folder.glob("tokenizer*"):
        f.unlink()


def _pop_rope_factor(cfg: dict) -> None:
    cfg["rope_parameters"].pop("factor")


def _int_weights(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, str(folder / "model.safetensors"))


FOLDER_CASES = {
    # case: (family, how to break the copy, fragments the one error line must hold)
    "config-is-a-list": ("qwen3", _write("config.json", "[1, 2]"), ["config.json", "JSON object", "list"]),
    "config-invalid-json": ("qwen3", _write("config.json", '{"vocab_size": '), ["config.json", "not valid JSON"]),
    "config-missing": ("qwen3", lambda f: (f / "config.json").unlink(), ["config.json is missing"]),
    "zero-heads": ("qwen3", _edit_json("config.json", lambda c: c.update(num_attention_heads=0)),
                   ["config.json", "'num_attention_heads'", "got 0"]),
    "zero-layers": ("qwen2", _edit_json("config.json", lambda c: c.update(num_hidden_layers=0)),
                    ["config.json", "'num_hidden_layers'", "got 0"]),
    "negative-hidden": ("qwen3", _edit_json("config.json", lambda c: c.update(hidden_size=-64)),
                        ["'hidden_size'", "got -64"]),
    "heads-not-divisible": ("qwen3", _edit_json("config.json", lambda c: c.update(num_key_value_heads=3)),
                            ["num_attention_heads (4)", "num_key_value_heads (3)"]),
    "llama3-rope-without-factor": ("llama", _edit_json("config.json", _pop_rope_factor),
                                   ["config.json", "rope_parameters", "llama3", "'factor'"]),
    "vocab-size-a-string": ("qwen3", _edit_json("config.json", lambda c: c.update(vocab_size="512")),
                            ["config.json", "'vocab_size'", "'512'"]),
    "vocab-size-a-bool": ("qwen3", _edit_json("config.json", lambda c: c.update(vocab_size=True)),
                          ["config.json", "'vocab_size'", "True"]),
    "vocab-size-a-float": ("qwen3", _edit_json("config.json", lambda c: c.update(vocab_size=512.0)),
                           ["'vocab_size'", "512.0"]),
    "eos-id-a-string": ("qwen3", _edit_json("generation_config.json", lambda c: c.update(eos_token_id="0")),
                        ["generation_config.json", "'eos_token_id'", "'0'"]),
    "truncated-safetensors": ("qwen3", _truncate, ["model.safetensors", "truncated"]),
    "empty-safetensors": ("qwen3", _empty_weights, ["model.safetensors", "header too small"]),
    "index-to-parent": ("qwen3", _index_to(_parent_shard),
                        ["model.safetensors.index.json", "'../outside.safetensors'", "outside the model folder"]),
    "index-to-absolute-path": ("qwen3", _index_to(_absolute_shard),
                               ["model.safetensors.index.json", "outside.safetensors", "outside the model folder"]),
    "index-to-outside-symlink": ("qwen3", _index_to(_symlinked_shard),
                                 ["model-00001-of-00001.safetensors", "resolves to", "outside the model folder"]),
    "index-to-missing-shard": ("qwen3", _index_to(lambda f: "gone.safetensors"),
                               ["model.safetensors.index.json", "gone.safetensors", "missing"]),
    "no-tokenizer-files": ("qwen3", _remove_tokenizer, ["no tokenizer files"]),
    "tokenizer-json-garbage": ("qwen3", _write("tokenizer.json", "not json"), ["tokenizer.json", "not valid JSON"]),
    "tokenizer-json-empty": ("qwen3", _write("tokenizer.json", "{}"), ["cannot load a tokenizer", "added_tokens"]),
    "pickled-weights-only": ("qwen3", lambda f: (f / "model.safetensors").rename(f / "pytorch_model.bin"),
                             ["pytorch_model.bin", "pickled weights are refused"]),
    "integer-weights": ("qwen3", _int_weights, ["'model.norm.weight'", "I32"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(FOLDER_CASES))
def test_cli_broken_folder_is_one_line(tiny_model_dirs, tmp_path, case):
    family, breakit, fragments = FOLDER_CASES[case]
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dirs[family], folder)
    breakit(folder)
    assert_one_line_error(generate(folder, "--max-model-len", "64"), *fragments)


def test_cli_missing_folder_is_one_line(tmp_path):
    assert_one_line_error(generate(tmp_path / "nope"), "nope", "does not exist")


# -- bad flags on a good folder ------------------------------------------------------------------


FLAG_CASES = {
    "max-tokens-0": (["--max-tokens", "0"], ["max_tokens", "got 0"]),
    "temperature-negative": (["--temperature", "-1"], ["temperature", "-1"]),
    "top-p-2": (["--top-p", "2"], ["top_p", "2"]),
    "top-k-negative": (["--top-k", "-3"], ["top_k", "-3"]),
    "max-model-len-0": (["--max-model-len", "0"], ["--max-model-len", "got 0"]),
    "max-model-len-past-the-model": (["--max-model-len", "100000"], ["--max-model-len 100000", "512"]),
    "num-gpu-blocks-0": (["--num-gpu-blocks-override", "0"], ["--num-gpu-blocks-override", "got 0"]),
    "num-gpu-blocks-too-few": (["--max-model-len", "64", "--num-gpu-blocks-override", "1"], ["holds 1 blocks"]),
    "device-unknown": (["--device", "tpu"], ["'tpu'"]),
}


@pytest.mark.parametrize("case", sorted(FLAG_CASES))
def test_cli_bad_flag_is_one_line(tiny_model_dirs, case):
    flags, fragments = FLAG_CASES[case]
    assert_one_line_error(generate(tiny_model_dirs["qwen3"], *flags), *fragments)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cli_cuda_without_a_gpu_is_one_line(tiny_model_dirs):
    assert_one_line_error(generate(tiny_model_dirs["qwen3"], "--device", "cuda"), "'cuda'", "no CUDA device")


def test_cli_empty_prompt_is_one_line(tiny_model_dirs):
    """An error raised after the engine is built (adding the request) is one line too."""
    cmd = ["generate", "--model", str(tiny_model_dirs["qwen3"]), "--prompt", "", "--device", "cpu"]
    assert_one_line_error(run_cli(*cmd, "--max-model-len", "64"), "prompt")


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [(["--dtype", "bogus"], "invalid choice: 'bogus'"), (["--max-tokens", "many"], "invalid int value: 'many'"),
     (["--temperature", "hot"], "invalid float value: 'hot'")],
)  # fmt: skip
def test_cli_argparse_errors_keep_the_usage(tiny_model_dirs, flags, fragment):
    assert_argparse_error(generate(tiny_model_dirs["qwen3"], *flags), fragment)


def test_cli_tiny_model_errors(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert_one_line_error(run_cli("tiny-model", str(a_file)), "File exists", str(a_file))
    assert_argparse_error(run_cli("tiny-model", str(tmp_path / "m"), "--family", "gpt2"), "invalid choice: 'gpt2'")


def test_cli_good_run_prints_nothing_on_stderr(tiny_model_dirs):
    out = generate(tiny_model_dirs["llama"], "--max-tokens", "2", "--max-model-len", "64")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert "generated 2 tokens" in out.stdout


# -- in process: Ctrl-C, bugs, the traceback switch -----------------------------------------------


def _raising(error: BaseException):
    def fake_generate(args) -> int:
        raise error

    return fake_generate


ARGV = ["generate", "--model", "m", "--prompt", "p"]


def test_cli_keyboard_interrupt_is_one_line_and_status_130(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_generate", _raising(KeyboardInterrupt()))
    assert cli.main(ARGV) == 130
    assert capsys.readouterr().err == "tinyvllm: error: interrupted\n"


def test_cli_multi_line_message_becomes_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_generate", _raising(TypeError("first\n  second\n\n")))
    assert cli.main(ARGV) == 2
    assert capsys.readouterr().err == "tinyvllm: error: first second\n"
    monkeypatch.setattr(cli, "_generate", _raising(OSError()))
    assert cli.main(ARGV) == 2
    assert capsys.readouterr().err == "tinyvllm: error: OSError\n"


def test_cli_bug_keeps_its_traceback(monkeypatch):
    monkeypatch.setattr(cli, "_generate", _raising(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(ARGV)


def test_cli_traceback_switch_reraises_user_errors(monkeypatch):
    monkeypatch.setattr(cli, "_generate", _raising(ValueError("bad value")))
    monkeypatch.setenv("TINYVLLM_TRACEBACK", "1")
    with pytest.raises(ValueError, match="bad value"):
        cli.main(ARGV)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("{bad", "--speculative-config must be a JSON object, got '{bad'"),
        ("[3]", "--speculative-config must be a JSON object, got '[3]'"),
        ('{"num_speculative_tokens": 3, "window": 9}', "'window'"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
    ],
)  # fmt: skip
def test_cli_speculative_config_is_checked_before_the_model_loads(monkeypatch, capsys, value, fragment):
    monkeypatch.setattr(cli, "llm_from_args", lambda args: pytest.fail("the model was loaded before the flag was checked"))
    assert cli.main(["generate", "--prompt", "p", "--speculative-config", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tinyvllm: error: ") and fragment in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flags, want", [([], 20), (["--max-logprobs", "50"], 50), (["--max-logprobs", "-1"], -1)])
def test_cli_max_logprobs_reaches_the_engine(tiny_model_dirs, flags, want):
    """``--max-logprobs`` (``generate`` and ``serve``), vLLM's engine flag: the LLM it builds
    lets a request ask for that many logprobs."""
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "--model", str(tiny_model_dirs["qwen3"]), "--prompt", "p", "--device", "cpu",
                              "--max-model-len", "64", *flags])  # fmt: skip
    llm = cli.llm_from_args(args)
    assert llm.max_logprobs == llm.engine.max_logprobs == want
    serve_args = parser.parse_args(["serve", *flags])
    assert serve_args.max_logprobs == want
