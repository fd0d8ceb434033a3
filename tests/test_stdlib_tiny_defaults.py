"""The shipped model's sampling defaults: measured, shipped, and the README's first command.

Contract:
- ``bench/generation_defaults.py --quick`` runs every code path of the measurement and
  writes a record with the schema below (its figures mean nothing);
- ``src/tinyvllm/stdlib_tiny/generation_config.json`` holds exactly the sampling
  fields the full run chose (``bench/results/generation_defaults.json``), beside its EOS;
- the README's first command, ``tinyvllm generate --prompt "def fibonacci(n):"`` (on the
  CPU, the default seed), prints a completion whose share of repeated 4-grams is below
  ``MAX_REPEATED_4GRAM_SHARE``, and not the greedy completion, which loops.

``MAX_REPEATED_4GRAM_SHARE`` = 0.3, from the measurement (the model card's "Sampling
defaults"): none of the 97 held-out continuations of real Python reaches it (the highest
scores 0.21, the mean 0.03); 80 of the 97 greedy completions pass it (mean 0.51; the
README prompt's greedy one scores 0.79); none of the chosen setting's 97 does (mean 0.044,
the highest 0.26). The README command's own completion, sampled with the default seed,
scores 0.0. The greedy completion it is compared with is plain greedy: without the model's
repetition penalty (``--generation-config vllm``), which would break the loop too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tinyvllm.stdlib_tiny import STDLIB_TINY
from tinyvllm.models.tokenizer import load_tokenizer
from tinyvllm.sampling_defaults import load_generation_defaults

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "bench" / "results" / "generation_defaults.json"
MAX_REPEATED_4GRAM_SHARE = 0.3
README_COMMAND = ["generate", "--prompt", "def fibonacci(n):"]


def _bench_module():
    spec = importlib.util.spec_from_file_location("generation_defaults", ROOT / "bench" / "generation_defaults.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _completion(*flags: str) -> str:
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "tinyvllm", *README_COMMAND, "--device", "cpu", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout[: out.stdout.rindex("\n[tinyvllm] prompt ")]  # the completion, before the figures line


@pytest.mark.slow
def test_readme_first_command_does_not_loop():
    bench = _bench_module()
    tokenizer = load_tokenizer(STDLIB_TINY)
    text = _completion()
    greedy = _completion("--generation-config", "vllm", "--temperature", "0")
    share = bench.repeated_ngram_share(tokenizer(text).input_ids)
    greedy_share = bench.repeated_ngram_share(tokenizer(greedy).input_ids)
    assert share < MAX_REPEATED_4GRAM_SHARE, (share, text)
    assert greedy_share > MAX_REPEATED_4GRAM_SHARE, (greedy_share, greedy)  # the loop the defaults avoid
    assert text != greedy and len(text.strip()) >= 20
    assert _completion() == text  # the default seed: the same text every run


def test_shipped_generation_config_holds_the_measured_choice():
    record = json.loads(RECORD.read_text())
    assert record["quick"] is False and record["threads"] == 1
    chosen = record["chosen"]["generation_config"]
    config = json.loads((Path(STDLIB_TINY) / "generation_config.json").read_text())
    assert config["eos_token_id"] == 0
    assert load_generation_defaults(STDLIB_TINY) == chosen
    assert chosen["temperature"] > 0  # sampled: greedy loops
    [setting] = [s for s in record["settings"] if s["name"] == record["chosen"]["name"]]
    gap = abs(setting["repeated_4gram_share"] - record["reference"]["repeated_4gram_share"])
    assert gap <= record["rule"]["tolerance"]


@pytest.mark.slow
def test_bench_generation_defaults_quick_writes_its_record(tmp_path):
    out = tmp_path / "generation_defaults.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, str(ROOT / "bench" / "generation_defaults.py"), "--quick", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["quick"] is True and record["threads"] == 1 and record["benchmark"] == "generation_defaults"
    assert {"date", "command", "machine", "versions"} <= set(record)
    assert record["workload"]["num_prompts"] == 2 and len(record["workload"]["prompts"]) == 2
    assert set(record["workload"]["held_out_modules"]) >= {p["module"] for p in record["workload"]["prompts"]}
    assert set(record["reference"]) >= {"repeated_4gram_share", "syntax_line_share"}
    assert [s["name"] for s in record["settings"]] == ["greedy", "T=0.7 top_p=0.95 top_k=0 min_p=0.05"]
    for setting in record["settings"]:
        assert 0 <= setting["repeated_4gram_share"] <= 1 and 0 <= setting["syntax_line_share"] <= 1
        assert setting["mean_tokens"] == 8 and len(setting["per_completion_syntax_lines"]) == 2
    assert record["chosen"]["name"] in {s["name"] for s in record["settings"]}
    assert set(record["readme_command"]) == {"prompt", "greedy", "chosen"}


def test_the_statistics_on_known_text():
    bench = _bench_module()
    assert bench.repeated_ngram_share([1, 2, 3, 4, 5, 6]) == 0.0
    assert bench.repeated_ngram_share([7, 8] * 10) == 1 - 2 / 17  # a loop: 17 4-grams, 2 distinct
    assert bench.repeated_ngram_share([1, 2, 3]) == 0.0  # no 4-gram at all
    prompt = "def f(x):"
    assert bench.syntax_lines(prompt, "\n    y = x + 1\n    return y\n", finished=False) == (2, 2)
    assert bench.syntax_lines(prompt, "\n    y = = 1\n    return y\n", finished=False) == (0, 2)
    assert bench.syntax_lines(prompt, '\n    """Doc of\n    many lines\n', finished=False) == (2, 2)  # unfinished
    assert bench.syntax_lines(prompt, "\n    return x\n  y = 2\n    z", finished=False) == (1, 2)  # bad dedent
    assert bench.syntax_lines(prompt, "\n    return x + (", finished=True) == (1, 1)  # an open bracket
    assert bench.syntax_lines(prompt, "\n    return x +", finished=False) == (0, 0)  # cut off: not judged
