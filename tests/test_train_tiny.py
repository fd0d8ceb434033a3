"""``tinyvllm train-tiny`` end to end, in seconds: a few steps on a few modules.

Contract (``tinyvllm/stdlib_tiny/train.py``; the loss plot ``plot.py``): the command writes
a Hugging Face folder that transformers and tinyvllm both load, whose stored weights are
bfloat16 but run in float32, whose tokenizer knows ``<|endoftext|>``, ``<think>`` and
``</think>``, and beside it the record of the run (``training.json``, ``loss_curve.json``,
``loss_curve.svg``).
The held-out modules are never trained on. The loss goes down.

The run trains once per module (``trained`` fixture, about ten seconds on two cores).
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import pytest
import torch

from tinyvllm import cli
from tinyvllm.stdlib_tiny import plot
from tinyvllm.stdlib_tiny import train as train_tiny
from tinyvllm.stdlib_tiny.train import HELD_OUT_MODULES, TrainConfig, learning_rate

MODULES = "json.decoder,string,difflib,pprint"
STEPS = 40


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("train_tiny") / "model"
    flags = ["--size", "test", "--vocab-size", "400", "--seq-len", "64", "--batch-size", "8"]
    flags += ["--max-steps", str(STEPS), "--warmup-steps", "5", "--lr", "1e-2", "--eval-every", "10"]
    status = cli.main(["train-tiny", str(out), *flags, "--modules", MODULES, "--no-progress"])
    assert status == 0
    return out


def test_train_tiny_folder_loads_in_transformers_and_tinyvllm(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tinyvllm import LLM, SamplingParams
    from tinyvllm.models.loader import check_model_folder

    spec = check_model_folder(trained)
    assert spec.architecture == "Qwen3ForCausalLM" and spec.torch_dtype == "float32"
    hf = AutoModelForCausalLM.from_pretrained(str(trained)).eval()
    assert next(hf.parameters()).dtype == torch.float32  # config says float32 (NOTE 2)
    tok = AutoTokenizer.from_pretrained(str(trained))
    vocab = tok.get_vocab()
    assert [vocab["<|endoftext|>"], vocab["<think>"], vocab["</think>"]] == [0, 1, 2]
    assert tok.eos_token == tok.bos_token == "<|endoftext|>"
    llm = LLM(str(trained), device="cpu", num_gpu_blocks_override=64)
    prompt = tok("def f(x):").input_ids
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert out.outputs[0].token_ids == theirs[0, len(prompt) :].tolist()
    assert llm.config.reasoning_config is not None  # <think> and </think> were found


def test_train_tiny_stores_bfloat16_weights(trained):
    from safetensors import safe_open

    with safe_open(str(trained / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
        assert "lm_head.weight" not in f.keys()  # tied to the embedding
    assert dtypes == {"BF16"}
    assert json.loads((trained / "generation_config.json").read_text())["eos_token_id"] == 0


def test_train_tiny_loss_goes_down(trained):
    curve = json.loads((trained / "loss_curve.json").read_text())
    losses = curve["train_loss"]
    assert len(losses) == STEPS == curve["step"][-1]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, (first, last)
    evals = [e["held_out_loss"] for e in curve["eval"]]
    assert [e["step"] for e in curve["eval"]] == [10, 20, 30, 40]
    assert evals[-1] < evals[0], evals


def test_train_tiny_records_config_data_and_time(trained):
    record = json.loads((trained / "training.json").read_text())
    assert record["config"]["max_steps"] == STEPS and record["config"]["size"] == "test"
    assert record["data"]["train_modules"] == MODULES.split(",")
    assert record["data"]["held_out_modules"] == list(HELD_OUT_MODULES)
    assert not set(record["data"]["train_modules"]) & set(HELD_OUT_MODULES)
    assert record["data"]["python_version"].count(".") == 2
    assert record["time"]["steps"] == STEPS and record["time"]["train_seconds"] > 0
    assert record["model"]["parameters"] == sum(
        p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(str(trained)).parameters()
    )
    r = record["results"]
    assert math.isclose(r["held_out_ratio"], r["held_out_loss"] / r["held_out_unigram_entropy"], rel_tol=1e-3)
    assert abs(r["held_out_loss"] - r["held_out_loss_float32"]) < 0.05  # bfloat16 storage costs little
    svg = ET.fromstring((trained / "loss_curve.svg").read_text())
    assert svg.tag.endswith("svg") and len(svg.findall("{http://www.w3.org/2000/svg}polyline")) == 2


def test_train_tiny_refuses_held_out_and_unknown_modules():
    sources = {name: "x = 1\n" for name in ("os", "heapq", "json")}
    with pytest.raises(ValueError, match="held-out"):
        train_tiny.split_sources(sources, ("os", "heapq"))
    with pytest.raises(ValueError, match="not in the standard library"):
        train_tiny.split_sources(sources, ("nosuchmodule",))
    train, held = train_tiny.split_sources(sources)
    assert sorted(train) == ["json", "os"] and sorted(held) == ["heapq"]


def test_train_tiny_module_names_and_skipped_files():
    from pathlib import Path

    assert train_tiny.module_name(Path("json/decoder.py")) == "json.decoder"
    assert train_tiny.module_name(Path("json/__init__.py")) == "json"
    names = train_tiny.stdlib_sources()
    assert "json" in names and "os" in names and set(HELD_OUT_MODULES) <= set(names)
    parts = {part for name in names for part in name.split(".")}
    assert not parts & {"test", "tests", "idlelib", "tkinter", "encodings", "pydoc_data"}
    assert not any(name.split(".")[-1].startswith("test_") for name in names)


def test_train_tiny_schedule_warms_up_then_decays():
    cfg = TrainConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    warm = [learning_rate(cfg, s, 0.0) for s in range(10)]
    assert warm == sorted(warm) and warm[-1] == 1.0
    decay = [learning_rate(cfg, 10, p / 10) for p in range(11)]
    assert decay == sorted(decay, reverse=True)
    assert decay[0] == 1.0 and math.isclose(decay[-1], 0.1)


def test_train_tiny_trains_on_short_windows_then_on_the_context_length():
    cfg = TrainConfig(seq_len=128, context_len=512, batch_size=8, long_fraction=0.15)
    assert train_tiny.window_shape(cfg, 0.0) == train_tiny.window_shape(cfg, 0.849) == (8, 128)
    assert train_tiny.window_shape(cfg, 0.85) == train_tiny.window_shape(cfg, 0.99) == (2, 512)  # same tokens
    assert train_tiny.window_shape(TrainConfig(seq_len=64, context_len=512, batch_size=2), 0.9) == (1, 512)
    assert train_tiny.window_shape(TrainConfig(long_fraction=0.0), 0.99) == (8, 128)


def test_train_tiny_records_the_tokens_of_both_phases(trained):
    record = json.loads((trained / "training.json").read_text())
    cfg = TrainConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in record["config"].items()})
    assert (cfg.seq_len, cfg.context_len) == (64, 512)
    # the fixture's run is bounded by steps: progress is step / max_steps (NOTE 3)
    expected = sum(rows * window for rows, window in (train_tiny.window_shape(cfg, s / STEPS) for s in range(STEPS)))
    assert record["data"]["tokens_seen"] == expected
    assert [train_tiny.window_shape(cfg, d) for d in (0.0, 0.9)] == [(8, 64), (1, 512)]
    assert record["model"]["max_position_embeddings"] == 512


def test_train_tiny_precision_is_resolved_and_recorded(trained):
    assert train_tiny.resolve_precision("float32") == "float32"
    assert train_tiny.resolve_precision("bfloat16") == "bfloat16"
    assert train_tiny.resolve_precision("auto") in ("bfloat16", "float32")
    with pytest.raises(ValueError, match="'fp8'"):
        train_tiny.resolve_precision("fp8")
    record = json.loads((trained / "training.json").read_text())
    assert record["time"]["precision"] == train_tiny.resolve_precision("auto")


def test_train_tiny_loss_curve_averages_long_runs_into_at_most_max_points():
    xs, ys, k = plot.bucket_means([1, 2, 3, 4, 5], [5.0, 3.0, 4.0, 2.0, 1.0], max_points=2)
    assert (xs, ys, k) == ([2.0, 4.5], [4.0, 1.5], 3)
    assert plot.bucket_means([1, 2], [2.0, 1.0], max_points=10) == ([1.0, 2.0], [2.0, 1.0], 1)
    curve = {"step": list(range(1, 2001)), "train_loss": [5.0 - i / 1000 for i in range(2000)], "lr": [], "eval": []}
    svg = ET.fromstring(plot.loss_curve_svg(curve, 6.0, max_points=500))
    [line] = svg.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(line.get("points").split()) == 500
    assert any("mean of 4 steps" in (t.text or "") for t in svg.iter("{http://www.w3.org/2000/svg}text"))
