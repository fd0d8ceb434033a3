"""Loading Hugging Face folders: config forms, safetensors (sharded too), tokenizer, EOS,
and a clear ValueError for every broken folder."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from tinyvllm.models.loader import (
    check_model_folder,
    check_tensor_names,
    check_weights,
    expected_tensor_names,
    find_weight_files,
    iter_safetensors,
    load_model_spec,
    read_tensor_infos,
    resolve_dtype,
)
from tinyvllm.models.tokenizer import load_eos_token_ids, load_tokenizer
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


# -- malformed folders, field by field: one ValueError naming the file and the field --------------


def _with_config(src, tmp_path, edit, name="config.json"):
    """A copy of ``src`` whose JSON file ``name`` went through ``edit`` (which may return a
    replacement value, e.g. a list, to write instead)."""
    folder = _copy(src, tmp_path, f"copy{len(list(tmp_path.iterdir()))}")
    data = json.loads((folder / name).read_text())
    replaced = edit(data)
    (folder / name).write_text(json.dumps(data if replaced is None else replaced))
    return folder


def _pop(table, key):
    del table[key]


CONFIG_CASES = [
    # (family, edit of config.json, regex the ValueError must match)
    ("qwen3", lambda c: [c], r"config\.json must hold a JSON object .*got a list"),
    ("qwen3", lambda c: "a string", r"config\.json must hold a JSON object .*got a string"),
    ("qwen3", lambda c: c.update(architectures="Qwen3ForCausalLM"), r"config\.json: field 'architectures' must be a list"),
    ("qwen3", lambda c: c.update(architectures=[{"a": 1}]), r"config\.json: field 'architectures' must be a list"),
    ("qwen3", lambda c: _pop(c, "vocab_size"), r"config\.json: required field 'vocab_size' is missing"),
    ("qwen3", lambda c: c.update(vocab_size=None), r"config\.json: required field 'vocab_size' is null"),
    ("qwen3", lambda c: c.update(vocab_size="512"), r"config\.json: field 'vocab_size' must be an integer, got '512'"),
    ("qwen3", lambda c: c.update(vocab_size=True), r"config\.json: field 'vocab_size' must be an integer, got True"),
    ("qwen3", lambda c: c.update(vocab_size=512.0), r"config\.json: field 'vocab_size' must be an integer, got 512\.0"),
    ("qwen3", lambda c: c.update(vocab_size=0), r"config\.json: field 'vocab_size' must be >= 1, got 0"),
    ("qwen3", lambda c: c.update(num_attention_heads=0), r"config\.json: field 'num_attention_heads' must be >= 1, got 0"),
    ("qwen3", lambda c: c.update(num_key_value_heads=0), r"config\.json: field 'num_key_value_heads' must be >= 1, got 0"),
    ("qwen3", lambda c: c.update(num_hidden_layers=0), r"config\.json: field 'num_hidden_layers' must be >= 1, got 0"),
    ("qwen3", lambda c: c.update(hidden_size=-64), r"config\.json: field 'hidden_size' must be >= 1, got -64"),
    ("qwen3", lambda c: c.update(intermediate_size=0), r"config\.json: field 'intermediate_size' must be >= 1"),
    ("qwen3", lambda c: c.update(head_dim=0), r"config\.json: field 'head_dim' must be >= 1, got 0"),
    ("qwen3", lambda c: c.update(head_dim=15), r"config\.json: head_dim must be even .*got 15"),
    ("qwen3", lambda c: c.update(max_position_embeddings=0), r"config\.json: field 'max_position_embeddings' must be >= 1"),
    ("qwen3", lambda c: c.update(num_key_value_heads=3), r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    ("qwen2", lambda c: c.update(hidden_size=66), r"hidden_size \(66\) is not a multiple of num_attention_heads \(4\)"),
    ("qwen3", lambda c: c.update(rms_norm_eps="1e-6"), r"config\.json: field 'rms_norm_eps' must be a number"),
    ("qwen3", lambda c: c.update(rms_norm_eps=-1.0), r"config\.json: field 'rms_norm_eps' must be a finite number > 0"),
    ("qwen3", lambda c: c.update(rms_norm_eps=float("nan")), r"config\.json: field 'rms_norm_eps' must be a finite"),
    ("qwen3", lambda c: c.update(tie_word_embeddings="false"), r"config\.json: field 'tie_word_embeddings' must be true or false"),
    ("llama", lambda c: c.update(attention_bias=1), r"config\.json: field 'attention_bias' must be true or false"),
    ("qwen3", lambda c: c.update(dtype="float64"), r"config\.json: dtype 'float64' is not one of"),
    ("qwen3", lambda c: c.update(dtype=0, torch_dtype="bfloat16"), r"config\.json: dtype 0 is not one of"),
    ("qwen3", lambda c: c.update(vocab_size=2**31), r"config\.json: field 'vocab_size' must be <= 2147483647"),
    ("qwen3", lambda c: c.update(rope_parameters=[1e6]), r"config\.json: field 'rope_parameters' must be an object"),
    ("qwen3", lambda c: c.update(rope_scaling="llama3"), r"config\.json: field 'rope_scaling' must be an object"),
    ("qwen3", lambda c: c["rope_parameters"].update(rope_theta=0), r"rope_parameters: field 'rope_theta' must be a finite number > 0"),
    ("qwen3", lambda c: c["rope_parameters"].update(rope_type=3), r"rope_parameters: field 'rope_type' must be a string"),
    ("llama", lambda c: _pop(c["rope_parameters"], "factor"), r"config\.json: rope_parameters: rope type 'llama3' needs the field 'factor'"),
    ("llama", lambda c: _pop(c["rope_parameters"], "original_max_position_embeddings"),
     r"rope_parameters: rope type 'llama3' needs the field 'original_max_position_embeddings'"),
    ("llama", lambda c: c["rope_parameters"].update(low_freq_factor=0), r"rope_parameters: field 'low_freq_factor' must be a finite number > 0, got 0"),
    ("llama", lambda c: c["rope_parameters"].update(high_freq_factor=1.0),
     r"rope_parameters: field 'high_freq_factor' \(1\.0\) must be greater than 'low_freq_factor' \(1\.0\)"),
    ("llama", lambda c: c["rope_parameters"].update(factor="8"), r"rope_parameters: field 'factor' must be a number, got '8'"),
    ("llama", lambda c: c["rope_parameters"].update(original_max_position_embeddings=64.5),
     r"rope_parameters: field 'original_max_position_embeddings' must be an integer"),
]  # fmt: skip


@pytest.mark.parametrize(("family", "edit", "pattern"), CONFIG_CASES, ids=[c[2][:60] for c in CONFIG_CASES])
def test_loader_malformed_config_names_the_file_and_field(tiny_folders, tmp_path, family, edit, pattern):
    folder = _with_config(tiny_folders[family], tmp_path, edit)
    with pytest.raises(ValueError, match=pattern) as info:
        load_model_spec(folder)
    assert str(folder / "config.json") in str(info.value)


@pytest.mark.parametrize("key", ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"])
def test_loader_v4_llama3_rope_scaling_names_the_missing_key(tiny_folders, tmp_path, key):
    def to_v4_without_key(cfg):
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        params.pop(key)
        cfg["rope_scaling"] = params

    folder = _with_config(tiny_folders["llama"], tmp_path, to_v4_without_key)
    with pytest.raises(ValueError, match=rf"config\.json: rope_scaling: rope type 'llama3' needs the field '{key}'"):
        load_model_spec(folder)


def test_loader_config_json_syntax_and_encoding_errors(tiny_folders, tmp_path):
    folder = _copy(tiny_folders["qwen3"], tmp_path)
    for text, pattern in [(b'{"vocab_size": ', "is not valid JSON"), (b"", "is not valid JSON"),
                          (b"\xff\xfe\x00garbage", "config.json is not"), (b"[" * 100_000, "nested too deeply")]:  # fmt: skip
        (folder / "config.json").write_bytes(text)
        with pytest.raises(ValueError, match=pattern):
            load_model_spec(folder)
    (folder / "config.json").unlink()
    (folder / "config.json").mkdir()
    with pytest.raises(ValueError, match="config.json cannot be read"):
        load_model_spec(folder)


BAD_VALUES = [None, "7", True, False, 0, -1, 1.5, 2.0, [], {}, [4], float("nan"), float("inf"), 10**400]
CHECKED_FIELDS = [
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "attention_bias", "rope_parameters", "rope_scaling", "rope_theta", "architectures", "dtype",
]  # fmt: skip


def test_loader_any_json_value_in_any_field_is_accepted_or_named(tiny_folders, tmp_path):
    """Every field of config.json, every kind of JSON value: the spec loads, or a ValueError
    names config.json and the field. Never a TypeError, KeyError, OverflowError, ..."""
    folder = _copy(tiny_folders["llama"], tmp_path)
    good = json.loads((folder / "config.json").read_text())
    nested = [("rope_parameters", k) for k in ("rope_theta", "rope_type", "factor", "low_freq_factor")]
    for field in CHECKED_FIELDS + nested:
        for value in BAD_VALUES:
            cfg = json.loads(json.dumps(good))
            if isinstance(field, tuple):
                cfg[field[0]][field[1]] = value
                name = field[1]
            else:
                cfg[field] = value
                name = field
            (folder / "config.json").write_text(json.dumps(cfg))
            try:
                load_model_spec(folder)
            except ValueError as e:
                assert "config.json" in str(e) and name in str(e), (field, value, str(e))


def test_loader_null_head_dim_and_kv_heads_fall_back(tiny_folders, tmp_path):
    folder = _with_config(tiny_folders["qwen2"], tmp_path, lambda c: c.update(head_dim=None, num_key_value_heads=None))
    spec = load_model_spec(folder)
    assert (spec.head_dim, spec.num_key_value_heads) == (16, 4)


# -- weights: shard paths, headers, duplicates, dtypes -------------------------------------------


def _index(folder, shard):
    weight_map = {name: shard for name in expected_tensor_names(load_model_spec(folder))}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_loader_refuses_shards_outside_the_folder(tiny_folders, tmp_path):
    folder = _copy(tiny_folders["qwen3"], tmp_path)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(folder / "model.safetensors", outside)
    for shard, pattern in [("../outside.safetensors", r"shard '\.\./outside\.safetensors' is outside the model folder"),
                           ("sub/../../outside.safetensors", "is outside the model folder"),
                           (str(outside), "is outside the model folder"),
                           ("..\\outside.safetensors", "is outside the model folder")]:  # fmt: skip
        _index(folder, shard)
        with pytest.raises(ValueError, match=pattern) as info:
            find_weight_files(folder)
        assert "model.safetensors.index.json" in str(info.value)
    (folder / "link.safetensors").symlink_to(outside)
    _index(folder, "link.safetensors")
    with pytest.raises(ValueError, match=r"link\.safetensors resolves to .*outside\.safetensors, outside the model"):
        find_weight_files(folder)


def test_loader_refuses_a_globbed_symlink_outside_the_folder(tiny_folders, tmp_path):
    folder = _copy(tiny_folders["qwen3"], tmp_path)
    outside = tmp_path / "outside.safetensors"
    (folder / "model.safetensors").rename(outside)
    (folder / "model.safetensors").symlink_to(outside)
    with pytest.raises(ValueError, match="resolves to .* outside the model folder"):
        find_weight_files(folder)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()
    with pytest.raises(ValueError, match="is not a regular file"):
        find_weight_files(folder)


def test_loader_accepts_symlinks_inside_the_folder_and_the_hub_cache_layout(tiny_folders, tmp_path):
    """The Hugging Face hub cache: snapshots/<rev>/file -> ../../blobs/<hash> (NOTE 3)."""
    repo = tmp_path / "models--tiny--qwen3"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in tiny_folders["qwen3"].iterdir():
        shutil.copy(f, repo / "blobs" / f"hash-{f.name}")
        (snapshot / f.name).symlink_to(Path("../../blobs") / f"hash-{f.name}")
    assert check_model_folder(snapshot) == load_model_spec(tiny_folders["qwen3"])
    assert find_weight_files(snapshot) == [snapshot / "model.safetensors"]
    inside = _copy(tiny_folders["qwen3"], tmp_path)
    (inside / "weights").mkdir()
    (inside / "model.safetensors").rename(inside / "weights" / "real.safetensors")
    (inside / "model.safetensors").symlink_to(inside / "weights" / "real.safetensors")
    assert find_weight_files(inside) == [inside / "model.safetensors"]


@pytest.mark.parametrize(
    ("index", "pattern"),
    [([1, 2], r"index\.json must hold a JSON object"), ({"weight_map": []}, "field 'weight_map' must be a non-empty"),
     ({"weight_map": {}}, "field 'weight_map' must be a non-empty"), ({}, "field 'weight_map' must be a non-empty"),
     ({"weight_map": {"x": 3}}, "weight_map values must be file names, got 3"),
     ({"weight_map": {"x": ""}}, "weight_map values must be file names, got ''")],
)  # fmt: skip
def test_loader_malformed_index(tiny_folders, tmp_path, index, pattern):
    folder = _copy(tiny_folders["qwen3"], tmp_path)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=pattern):
        find_weight_files(folder)


def test_loader_truncated_and_empty_safetensors_are_named(tiny_folders, tmp_path):
    folder = _copy(tiny_folders["qwen3"], tmp_path)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    for content, reason in [(data[: len(data) // 2], "file not fully covered"), (b"", "header too small"),
                            (data[:5], "header too small"), (b"\x10" + b"\x00" * 7 + b"not json header!", "")]:  # fmt: skip
        weights.write_bytes(content)
        for read in (read_tensor_infos, lambda files: dict(iter_safetensors(files))):
            with pytest.raises(ValueError, match=rf"{weights}.*cannot be read as safetensors.*{reason}"):
                read([weights])
        with pytest.raises(ValueError, match="model.safetensors cannot be read as safetensors"):
            check_model_folder(folder)


def test_loader_load_model_names_a_truncated_file(tiny_folders, tmp_path):
    from tinyvllm.models.llama import load_model

    folder = _copy(tiny_folders["qwen3"], tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-1])
    with pytest.raises(ValueError, match="model.safetensors cannot be read as safetensors"):
        load_model(folder)


def test_loader_refuses_a_tensor_stored_twice(tiny_folders, tmp_path):
    folder = _copy(tiny_folders["qwen3"], tmp_path)
    shutil.copy(folder / "model.safetensors", folder / "model-copy.safetensors")
    pattern = r"tensor '.*' is stored twice, in .*model-copy.safetensors and in .*model.safetensors"
    with pytest.raises(ValueError, match=pattern):
        read_tensor_infos(find_weight_files(folder))


def test_loader_check_weights_from_the_headers(tiny_folders, tmp_path):
    from safetensors.torch import save_file

    spec = load_model_spec(tiny_folders["qwen3"])
    infos = read_tensor_infos(find_weight_files(tiny_folders["qwen3"]))
    check_weights(spec, infos, tiny_folders["qwen3"])
    assert infos["model.norm.weight"].dtype == "F32" and infos["model.norm.weight"].shape == (64,)
    many_layers = dataclasses.replace(spec, num_hidden_layers=10**9)  # must not list 10**9 layers first
    with pytest.raises(ValueError, match=r"'model\.layers\.999999999\.input_layernorm\.weight' is missing.*10+"):
        check_weights(many_layers, infos, tiny_folders["qwen3"])
    folder = _copy(tiny_folders["qwen3"], tmp_path)
    tensors = dict(iter_safetensors(find_weight_files(folder)))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' in .*model\.safetensors has dtype F8_E4M3"):
        check_model_folder(folder)


# -- tokenizer and EOS -----------------------------------------------------------------------------


def test_loader_refuses_a_folder_without_tokenizer_files(tiny_folders, tmp_path):
    """transformers v5 would build Qwen2Tokenizer's default one-token vocabulary (NOTE 4)."""
    folder = _copy(tiny_folders["qwen3"], tmp_path)
    for f in folder.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ValueError, match=rf"no tokenizer files in {folder}"):
        load_tokenizer(folder)
    with pytest.raises(ValueError, match="no tokenizer files"):
        check_model_folder(folder)
    (folder / "vocab.json").write_text("{}")  # vocab.json alone is not a BPE tokenizer
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_tokenizer(folder)


def test_loader_broken_tokenizer_files_are_named(tiny_folders, tmp_path):
    folder = _copy(tiny_folders["qwen3"], tmp_path)
    (folder / "tokenizer_config.json").write_text("[]")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json must hold a JSON object"):
        load_tokenizer(folder)
    shutil.copy(tiny_folders["qwen3"] / "tokenizer_config.json", folder / "tokenizer_config.json")
    (folder / "tokenizer.json").write_text("{")
    with pytest.raises(ValueError, match=r"tokenizer\.json is not valid JSON"):
        load_tokenizer(folder)
    (folder / "tokenizer.json").write_text("{}")  # valid JSON, not a tokenizer: transformers' error, wrapped
    with pytest.raises(ValueError, match=rf"cannot load a tokenizer from {folder} \(KeyError: 'added_tokens'\)"):
        load_tokenizer(folder)


GEN = "generation_config.json"


@pytest.mark.parametrize(
    ("eos", "pattern"),
    [("0", "got '0'"), (True, "got True"), (-1, "got -1"), (1.0, "got 1.0"), ([0, "2"], "got '2'"), ({"id": 0}, "got {")],
)  # fmt: skip
def test_loader_bad_eos_ids_are_named(tiny_folders, tmp_path, eos, pattern):
    folder = _with_config(tiny_folders["qwen3"], tmp_path, lambda g: g.update(eos_token_id=eos), GEN)
    with pytest.raises(ValueError, match=rf"{GEN}: field 'eos_token_id' must be a token id.*{pattern}"):
        load_eos_token_ids(folder)


def test_loader_eos_ids_list_and_malformed_generation_config(tiny_folders, tmp_path):
    folder = _with_config(tiny_folders["qwen3"], tmp_path, lambda g: g.update(eos_token_id=[0, 2]), GEN)
    assert load_eos_token_ids(folder) == [0, 2]
    (folder / "generation_config.json").write_text("[0]")
    with pytest.raises(ValueError, match=r"generation_config\.json must hold a JSON object .*got a list"):
        load_eos_token_ids(folder)
    (folder / "generation_config.json").write_text("{eos: 0}")
    with pytest.raises(ValueError, match=r"generation_config\.json is not valid JSON"):
        load_eos_token_ids(folder)


def test_loader_check_model_folder_on_good_folders(tiny_folders):
    for folder in tiny_folders.values():
        assert check_model_folder(folder) == load_model_spec(folder)
