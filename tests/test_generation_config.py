"""Sampling defaults from the model's ``generation_config.json`` (vLLM's ``generation_config``).

Contract (``sampling_defaults.py``: ``load_generation_defaults`` and the rest,
``LLM(generation_config=...)``, ``LLM.get_default_sampling_params``, the command line):

- ``load_generation_defaults`` keeps vLLM's six fields (``repetition_penalty``,
  ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``max_new_tokens`` as ``max_tokens``),
  drops nulls, ignores every other key (``do_sample`` included, as vLLM does) and refuses a malformed value with a
  ValueError naming ``generation_config.json``, the field and the value;
- ``"auto"`` reads the model folder's file, ``"vllm"`` ignores it, a folder path reads
  that folder's; a bad value is refused before the model folder is read;
- ``generate(prompts)`` with no params runs exactly what an explicit ``SamplingParams``
  with the same values runs; explicit params win (whole objects offline, field by field
  through ``merge_defaults`` and the command line);
  of the defaults with a warning naming it, so such a model still generates.

Every folder is a tiny random Qwen3 (``tiny_model_dirs``) copied into ``tmp_path`` with its
``generation_config.json`` rewritten.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.sampling_defaults import load_generation_defaults, merge_defaults

ROOT = Path(__file__).resolve().parents[1]
ENGINE = dict(device="cpu", max_model_len=96, block_size=4)
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:"]
CONFIG = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "max_new_tokens": 20}
DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "max_tokens": 20}


def _folder(tiny_model_dirs, tmp_path: Path, fields: dict | None, name: str = "model") -> Path:
    """A copy of the tiny Qwen3 whose generation_config.json also holds ``fields``."""
    folder = tmp_path / name
    shutil.copytree(tiny_model_dirs["qwen3"], folder)
    if fields is not None:
        path = folder / "generation_config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | fields))
    return folder


def _gen_config_only(tmp_path: Path, fields: dict, name: str = "gen") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(fields))
    return folder


def _token_ids(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


# -- the loader ---------------------------------------------------------------------------------


def test_loader_keeps_vllms_six_fields_and_renames_max_new_tokens(tiny_model_dirs, tmp_path):
    fields = CONFIG | {
        "repetition_penalty": 1.1, "do_sample": False, "num_beams": 1, "typical_p": 0.5, "presence_penalty": None,
    }  # fmt: skip
    folder = _folder(tiny_model_dirs, tmp_path, fields)
    assert load_generation_defaults(folder) == DEFAULTS | {"repetition_penalty": 1.1}


def test_loader_drops_nulls_and_a_folder_without_fields_gives_nothing(tiny_model_dirs, tmp_path):
    assert load_generation_defaults(tiny_model_dirs["qwen3"]) == {}  # eos_token_id only
    folder = _folder(tiny_model_dirs, tmp_path, {"temperature": None, "top_k": 0})
    assert load_generation_defaults(folder) == {"top_k": 0}
    (folder / "generation_config.json").unlink()
    assert load_generation_defaults(folder) == {}


MALFORMED = {
    "temperature-string": ("temperature", "hot", "'hot'"),
    "temperature-bool": ("temperature", True, "True"),
    "temperature-negative": ("temperature", -1, "-1"),
    "temperature-tiny": ("temperature", 0.001, "0.001"),
    "top_p-zero": ("top_p", 0, "0"),
    "top_p-above-1": ("top_p", 1.5, "1.5"),
    "top_k-float": ("top_k", 2.5, "2.5"),
    "top_k-negative": ("top_k", -2, "-2"),
    "min_p-above-1": ("min_p", 2, "2"),
    "max_new_tokens-zero": ("max_new_tokens", 0, "0"),
    "max_new_tokens-float": ("max_new_tokens", 1.5, "1.5"),
    "max_new_tokens-list": ("max_new_tokens", [8], "[8]"),
    "repetition_penalty-zero": ("repetition_penalty", 0, "0"),
}


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_loader_refuses_a_malformed_value_naming_file_field_and_value(tiny_model_dirs, tmp_path, case):
    field, value, shown = MALFORMED[case]
    folder = _folder(tiny_model_dirs, tmp_path, {field: value})
    with pytest.raises(ValueError) as info:
        load_generation_defaults(folder)
    message = str(info.value)
    assert "generation_config.json" in message and repr(field) in message and shown in message, message
    with pytest.raises(ValueError, match="generation_config.json"):  # LLM() refuses it before loading weights
        LLM(str(folder), **ENGINE)


def test_loader_refuses_a_file_that_is_not_a_json_object(tiny_model_dirs, tmp_path):
    folder = _folder(tiny_model_dirs, tmp_path, None)
    (folder / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"generation_config.json must hold a JSON object"):
        load_generation_defaults(folder)


# -- LLM(generation_config=...) and get_default_sampling_params ---------------------------------


def test_auto_gives_the_model_defaults(tiny_model_dirs, tmp_path):
    llm = LLM(str(_folder(tiny_model_dirs, tmp_path, CONFIG)), **ENGINE)
    assert llm.generation_defaults == DEFAULTS
    assert llm.get_default_sampling_params() == SamplingParams(**DEFAULTS)


def test_vllm_ignores_the_model_defaults(tiny_model_dirs, tmp_path):
    llm = LLM(str(_folder(tiny_model_dirs, tmp_path, CONFIG)), generation_config="vllm", **ENGINE)
    assert llm.generation_defaults == {}
    assert llm.get_default_sampling_params() == SamplingParams()


def test_a_folder_path_gives_that_folders_defaults(tiny_model_dirs, tmp_path):
    model = _folder(tiny_model_dirs, tmp_path, CONFIG)
    other = _gen_config_only(tmp_path, {"temperature": 0.5, "max_new_tokens": 7, "eos_token_id": 0})
    llm = LLM(str(model), generation_config=str(other), **ENGINE)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.5, max_tokens=7)
    llm = LLM(str(model), generation_config=other, **ENGINE)  # a Path is a folder too
    assert llm.generation_defaults == {"temperature": 0.5, "max_tokens": 7}


def test_a_model_without_a_generation_config_gives_sampling_params_defaults(tiny_model_dirs, tmp_path):
    folder = _folder(tiny_model_dirs, tmp_path, None)
    (folder / "generation_config.json").unlink()
    llm = LLM(str(folder), **ENGINE)
    assert llm.get_default_sampling_params() == SamplingParams()


BAD_ARGUMENT = {
    "unknown-word": ("greedy", ValueError, "'greedy'"),
    "missing-folder": ("/no/such/folder", ValueError, "'/no/such/folder'"),
    "not-a-str": (5, TypeError, "5"),
}


@pytest.mark.parametrize("case", BAD_ARGUMENT, ids=list(BAD_ARGUMENT))
def test_a_bad_generation_config_argument_is_refused_before_the_model_is_read(case):
    value, error, shown = BAD_ARGUMENT[case]
    with pytest.raises(error) as info:
        LLM("/no/such/model", generation_config=value, device="cpu")  # the model would fail later
    assert "generation_config" in str(info.value) and shown in str(info.value), str(info.value)


def test_a_folder_without_generation_config_json_is_refused(tiny_model_dirs, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"generation_config .*no generation_config.json"):
        LLM(str(tiny_model_dirs["qwen3"]), generation_config=str(empty), **ENGINE)


# -- generate uses the defaults; explicit params win ---------------------------------------------


def test_generate_without_params_runs_the_defaults(tiny_model_dirs, tmp_path):
    folder = str(_folder(tiny_model_dirs, tmp_path, CONFIG))
    defaults = LLM(folder, seed=7, **ENGINE).generate(PROMPTS, use_tqdm=False)
    explicit = LLM(folder, seed=7, generation_config="vllm", **ENGINE)
    same = explicit.generate(PROMPTS, SamplingParams(**DEFAULTS), use_tqdm=False)
    assert _token_ids(defaults) == _token_ids(same)
    assert any(len(ids) == 20 for ids in _token_ids(defaults))  # max_new_tokens, not SamplingParams' 16
    assert all(len(ids) <= 20 for ids in _token_ids(defaults))
    auto = LLM(folder, **ENGINE)  # a request seed gives the same tokens whatever the global generator did
    a = auto.generate(PROMPTS, merge_defaults(auto.get_default_sampling_params(), {"seed": 3}), use_tqdm=False)
    b = explicit.generate(PROMPTS, SamplingParams(**DEFAULTS, seed=3), use_tqdm=False)
    assert _token_ids(a) == _token_ids(b)


def test_explicit_params_replace_the_defaults(tiny_model_dirs, tmp_path):
    folder = str(_folder(tiny_model_dirs, tmp_path, CONFIG))
    llm = LLM(folder, **ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=5)
    reference = LLM(folder, generation_config="vllm", **ENGINE).generate(PROMPTS, greedy, use_tqdm=False)
    assert _token_ids(llm.generate(PROMPTS, greedy, use_tqdm=False)) == _token_ids(reference)


def test_merge_defaults_lets_each_explicit_field_win():
    defaults = SamplingParams(**DEFAULTS)
    merged = merge_defaults(defaults, {"temperature": 0.0, "max_tokens": 3})
    assert merged == SamplingParams(temperature=0.0, top_p=0.9, top_k=40, min_p=0.05, max_tokens=3)
    assert merge_defaults(defaults, {}) == defaults
    assert merge_defaults(defaults, {"stop": "\n", "seed": 1}).top_k == 40
    with pytest.raises(TypeError, match="'temprature'"):
        merge_defaults(defaults, {"temprature": 0.5})
    with pytest.raises(ValueError, match="top_p"):
        merge_defaults(defaults, {"top_p": 2})


def test_a_repetition_penalty_in_the_config_is_a_default(tiny_model_dirs, tmp_path):
    folder = str(_folder(tiny_model_dirs, tmp_path, CONFIG | {"repetition_penalty": 1.2}))
    llm = LLM(folder, **ENGINE)
    assert llm.get_default_sampling_params() == SamplingParams(**DEFAULTS, repetition_penalty=1.2)


def test_the_override_is_logged(tiny_model_dirs, tmp_path, caplog):
    folder = str(_folder(tiny_model_dirs, tmp_path, CONFIG))
    with caplog.at_level(logging.INFO, logger="tinyvllm"):
        LLM(folder, **ENGINE)
    assert any("Default sampling parameters have been overridden" in r.getMessage() for r in caplog.records)


# -- the command line ----------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "tinyvllm", "generate", "--prompt", "def add(a, b):", "--device", "cpu", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _generated(out: subprocess.CompletedProcess) -> tuple[str, int]:
    assert out.returncode == 0, out.stderr
    *text, figures = out.stdout.rstrip("\n").split("\n")
    return "\n".join(text), int(figures.split("generated ")[1].split(" ")[0])


@pytest.mark.slow
def test_cli_applies_the_model_defaults_and_each_flag_wins(tiny_model_dirs, tmp_path):
    folder = str(_folder(tiny_model_dirs, tmp_path, {"temperature": 0.7, "max_new_tokens": 5}))
    greedy_64 = LLM(folder, device="cpu").generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=64))[0]
    sampled_5 = LLM(folder, device="cpu").generate("def add(a, b):")[0]  # the CLI's engine and start-up seed
    text, n = _generated(_cli("--model", folder))
    assert n <= 5 and (text, n) == (sampled_5.outputs[0].text, len(sampled_5.outputs[0].token_ids))  # not 64
    text, n = _generated(_cli("--model", folder, "--max-tokens", "3"))
    assert n <= 3
    text, n = _generated(_cli("--model", folder, "--generation-config", "vllm"))  # the CLI's own defaults
    assert text == greedy_64.outputs[0].text and n == len(greedy_64.outputs[0].token_ids)
    text, n = _generated(_cli("--model", folder, "--temperature", "0", "--max-tokens", "64"))  # flags win
    assert text == greedy_64.outputs[0].text


def test_cli_flag_values_are_checked_before_the_engine(tiny_model_dirs, tmp_path):
    out = _cli("--model", str(tiny_model_dirs["qwen3"]), "--generation-config", str(tmp_path / "nowhere"))
    assert out.returncode == 2 and out.stdout == "", out.stderr
    [line] = out.stderr.splitlines()
    assert line.startswith("tinyvllm: error: generation_config") and str(tmp_path / "nowhere") in line, line
    folder = str(_folder(tiny_model_dirs, tmp_path, {"top_p": 3}))
    out = _cli("--model", folder)
    [line] = out.stderr.splitlines()
    assert out.returncode == 2 and "generation_config.json" in line and "'top_p'" in line, out.stderr
    assert _cli("--model", folder, "--generation-config", "vllm").returncode == 0  # "vllm" never reads the fields


# -- model defaults that speculative decoding cannot honour ------------------------------------

SPEC = {"num_speculative_tokens": 2}


@pytest.mark.parametrize("where", ["model", "folder"])
def test_a_default_speculation_cannot_honour_is_refused_at_start_up_naming_file_and_field(tiny_model_dirs, tmp_path, where):
    """Issue 36 item 9: a generation_config.json with min_p loaded beside a speculative config
    made every request that left min_p unset refused. Now the engine refuses at start-up,
    naming the file and the field, and says how to run."""
    model = _folder(tiny_model_dirs, tmp_path, CONFIG if where == "model" else None)
    source = model if where == "model" else _gen_config_only(tmp_path, CONFIG)
    kw = {} if where == "model" else {"generation_config": str(source)}
    with pytest.raises(ValueError, match=r"generation_config\.json.*min_p=0\.05.*speculative_config") as info:
        LLM(str(model), speculative_config=SPEC, **ENGINE, **kw)
    assert str(source / "generation_config.json") in str(info.value) and "generation_config='vllm'" in str(info.value)
    llm = LLM(str(model), speculative_config=SPEC, generation_config="vllm", **ENGINE)  # the way out it names
    assert _token_ids(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3), use_tqdm=False))[0]


def test_defaults_speculation_honours_run_with_it(tiny_model_dirs, tmp_path):
    fields = {"temperature": 0.7, "top_k": 40, "min_p": 0.0}  # min_p 0 is off: nothing to refuse
    llm = LLM(str(_folder(tiny_model_dirs, tmp_path, fields)), speculative_config=SPEC, **ENGINE)
    [out] = llm.generate(PROMPTS[:1], use_tqdm=False)  # the model's defaults, with drafts
    assert out.outputs[0].token_ids
