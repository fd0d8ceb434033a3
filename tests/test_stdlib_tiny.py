"""The shipped model, ``src/tinyvllm/stdlib_tiny/``: it has learned, the engine
runs it exactly, and its record is complete.

Contract: on held-out standard-library modules (never trained on), the model's loss is at
most ``MAX_RATIO`` = 0.6 times the unigram entropy of the same tokens; tinyvllm's greedy output equals
transformers' ``generate`` with prefix caching on and off; ``tinyvllm generate`` with no
``--model`` uses it and prints readable text; ``training.json`` and ``loss_curve.json``
describe the run; the folder stays under 20 MB.

Each test takes a few seconds on two cores: the held-out text is 24 windows of 512 tokens
spread over the held-out modules, and both engines generate 24 tokens for eight prompts.
"""

from __future__ import annotations

import json
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinyvllm.stdlib_tiny import STDLIB_TINY
from tinyvllm.stdlib_tiny.train import HELD_OUT_MODULES, SIZES, stdlib_sources, unigram_entropy, windows

ROOT = Path(__file__).resolve().parents[1]
FOLDER = Path(STDLIB_TINY)
PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(len(items)):\n",
    "def read_lines(path):\n    with open(path) as f:\n",
    '"""Utilities for',
    "if __name__ == '__main__':\n",
    "    except KeyError:\n",
]
MAX_TOKENS = 24
HELD_OUT_WINDOWS = 24
MAX_RATIO = 0.6  # the goal; the shipped weights measure 0.57 on all held-out tokens


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(FOLDER)).eval()


@pytest.fixture(scope="module")
def tokenizer():
    from tinyvllm.models.tokenizer import load_tokenizer

    return load_tokenizer(FOLDER)


@pytest.mark.slow
def test_stdlib_tiny_beats_the_unigram_baseline_on_held_out_modules(hf_model, tokenizer):
    from tinyvllm.stdlib_tiny.train import encode_stream

    sources = stdlib_sources()
    stream = encode_stream(tokenizer, [sources[name] for name in HELD_OUT_MODULES])
    rows = windows(stream, 512, limit=HELD_OUT_WINDOWS)
    assert rows.shape == (HELD_OUT_WINDOWS, 512)
    total = 0.0
    with torch.no_grad():
        for batch in rows.split(6):
            logits = hf_model(input_ids=batch).logits[:, :-1]
            total += float(
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
                )
            )
    loss = total / (HELD_OUT_WINDOWS * 511)  # nats per predicted token
    baseline = unigram_entropy(rows)  # nats per token of the same text
    assert loss <= MAX_RATIO * baseline, (loss, baseline, loss / baseline)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["caching", "no-caching"])
def test_stdlib_tiny_greedy_equals_transformers(hf_model, tokenizer, prefix_caching):
    from tinyvllm import LLM, SamplingParams

    llm = LLM(device="cpu", enable_prefix_caching=prefix_caching, num_gpu_blocks_override=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer(prompt).input_ids
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            seq = hf_model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                repetition_penalty=1.0,  # plain greedy: not the folder's generation_config.json penalty
            )  # fmt: skip
        assert out.outputs[0].token_ids == seq[0, len(ids) :].tolist(), prompt


@pytest.mark.slow
def test_stdlib_tiny_is_the_default_of_generate():
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "tinyvllm", "generate", "--prompt", "def fibonacci(n):", "--device", "cpu"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    *text_lines, figures = out.stdout.rstrip("\n").split("\n")
    assert figures.startswith("[tinyvllm] prompt ")
    text = "\n".join(text_lines)
    assert len(text.strip()) >= 20, text
    readable = sum(c in string.printable for c in text)
    assert readable >= 0.9 * len(text), text


def test_stdlib_tiny_records_its_training():
    record = json.loads((FOLDER / "training.json").read_text())
    curve = json.loads((FOLDER / "loss_curve.json").read_text())
    config = json.loads((FOLDER / "config.json").read_text())
    assert record["data"]["held_out_modules"] == list(HELD_OUT_MODULES)
    assert not set(record["data"]["train_modules"]) & set(HELD_OUT_MODULES)
    assert len(record["data"]["train_modules"]) > 300 and record["data"]["python_version"].startswith("3.")
    assert record["config"]["size"] in SIZES and record["config"]["seed"] == 0
    hidden, layers, heads, kv_heads, head_dim, inter = SIZES[record["config"]["size"]]
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (hidden, layers, inter)
    assert config["vocab_size"] == record["model"]["vocab_size"] and config["dtype"] == "float32"
    assert 5_000_000 <= record["model"]["parameters"] <= 15_000_000
    steps = record["time"]["steps"]
    assert curve["step"] == list(range(1, steps + 1)) and len(curve["train_loss"]) == steps
    assert curve["eval"][-1]["step"] == steps
    assert 0 < record["time"]["train_seconds"] <= 46 * 60  # about 45 minutes on two cores
    r = record["results"]
    assert r["held_out_ratio"] <= MAX_RATIO and r["held_out_loss"] < curve["eval"][0]["held_out_loss"]
    assert (FOLDER / "loss_curve.svg").read_text().startswith("<svg")


def test_stdlib_tiny_folder_is_small_and_complete():
    from tinyvllm.models.loader import check_model_folder

    check_model_folder(FOLDER)
    total = sum(f.stat().st_size for f in FOLDER.iterdir())
    assert total <= 20 * 1024 * 1024, total
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (FOLDER / name).is_file(), name
    tok_config = json.loads((FOLDER / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == tok_config["bos_token"] == "<|endoftext|>"
    assert (FOLDER / "chat_template.jinja").read_text(encoding="utf-8").count("add_generation_prompt") == 1
