"""Loading Hugging Face folders: config forms, safetensors (sharded too), tokenizer, EOS,
and a clear ValueError for every broken folder."""

import json
import shutil

import pytest
import torch

from tinyvllm.models.loader import (
    check_tensor_names,
    expected_tensor_names,
    find_weight_files,
    iter_safetensors,
    load_eos_token_ids,
    load_model_spec,
    load_tokenizer,
    resolve_dtype,
)
from tinyvllm.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {fam: build_tiny_model(root / fam, fam) for fam in ("qwen3", "qwen2", "llama")}


def _copy(src, tmp_path, name="copy"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    ("family", "arch", "qk_norm", "qkv_bias", "scaled"),
    [("qwen3", "Qwen3ForCausalLM", True, False, False), ("qwen2", "Qwen2ForCausalLM", False, True, False),
     ("llama", "LlamaForCausalLM", False, False, True)],
)
def test_loader_reads_each_family(tiny_folders, family, arch, qk_norm, qkv_bias, scaled):
    spec = load_model_spec(tiny_folders[family])
    assert (spec.architecture, spec.family, spec.qk_norm, spec.qkv_bias) == (arch, family, qk_norm, qkv_bias)
    assert (spec.num_attention_heads, spec.num_key_value_heads, spec.num_hidden_layers) == (4, 2, 2)
    assert spec.head_dim == 16 and spec.vocab_size == 512
    assert (spec.rope_scaling is not None) == scaled
    names = {n for n, _ in iter_safetensors(find_weight_files(tiny_folders[family]))}
    check_tensor_names(spec, names, tiny_folders[family])
    assert set(expected_tensor_names(spec)) <= names


def test_loader_reads_the_transformers_v4_config_form(tiny_folders, tmp_path):
    folder = _copy(tiny_folders["llama"], tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = {k: v for k, v in params.items()}
    (folder / "config.json").write_text(json.dumps(cfg))
    v4 = load_model_spec(folder)
    assert v4 == load_model_spec(tiny_folders["llama"])
    assert v4.rope_theta == 500000.0 and v4.rope_scaling.factor == 8.0


def test_loader_reads_sharded_checkpoints(tiny_folders, tmp_path):
    from safetensors.torch import save_file

    folder = _copy(tiny_folders["qwen3"], tmp_path)
    tensors = dict(iter_safetensors(find_weight_files(folder)))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(folder / fname))
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    files = find_weight_files(folder)
    assert [f.name for f in files] == sorted(shards)
    loaded = dict(iter_safetensors(files))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], tensors[k]) for k in names)


def test_loader_tokenizer_and_eos(tiny_folders):
    tok = load_tokenizer(tiny_folders["qwen3"])
    ids = tok("def f(x):\n    return x").input_ids
    assert tok.decode(ids) == "def f(x):\n    return x"
    assert load_eos_token_ids(tiny_folders["qwen3"], tok) == [0] == [tok.eos_token_id]


def test_loader_eos_falls_back_to_the_tokenizer(tiny_folders, tmp_path):
    folder = _copy(tiny_folders["qwen3"], tmp_path)
    (folder / "generation_config.json").unlink()
    tok = load_tokenizer(folder)
    assert load_eos_token_ids(folder, tok) == [tok.eos_token_id]


def test_loader_dtype_auto_is_float32_on_cpu(tiny_folders):
    spec = load_model_spec(tiny_folders["qwen3"])
    assert resolve_dtype("auto", spec, "cpu") == torch.float32
    assert resolve_dtype("bfloat16", spec, "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype 'float8' is not 'auto'"):
        resolve_dtype("float8", spec, "cpu")


# -- broken folders: a ValueError naming the folder, file or tensor -----------------------


def test_loader_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model_spec(tmp_path / "nope")


def test_loader_missing_config(tmp_path):
    with pytest.raises(ValueError, match="config.json is missing"):
        load_model_spec(tmp_path)


def test_loader_unsupported_architecture(tiny_folders, tmp_path):
    folder = _copy(tiny_folders["qwen3"], tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*none of the supported"):
        load_model_spec(folder)


def test_loader_unsupported_rope_type(tiny_folders, tmp_path):
    folder = _copy(tiny_folders["qwen3"], tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        load_model_spec(folder)


def test_loader_missing_tensor_is_named(tiny_folders, tmp_path):
    from safetensors.torch import save_file

    folder = _copy(tiny_folders["qwen2"], tmp_path)
    tensors = dict(iter_safetensors(find_weight_files(folder)))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(folder / "model.safetensors"))
    spec = load_model_spec(folder)
    names = [n for n, _ in iter_safetensors(find_weight_files(folder))]
    with pytest.raises(ValueError, match="'model.layers.1.self_attn.k_proj.bias' is missing"):
        check_tensor_names(spec, names, folder)


def test_loader_refuses_pickled_weights(tiny_folders, tmp_path):
    folder = _copy(tiny_folders["qwen3"], tmp_path)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(ValueError, match="pickled weights are refused"):
        find_weight_files(folder)


def test_loader_index_naming_a_missing_shard(tiny_folders, tmp_path):
    folder = _copy(tiny_folders["qwen3"], tmp_path)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(ValueError, match="names gone.safetensors, which is missing"):
        find_weight_files(folder)


def test_loader_tiny_model_rejects_unknown_family(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model family 'gpt2'"):
        build_tiny_model(tmp_path, "gpt2")
