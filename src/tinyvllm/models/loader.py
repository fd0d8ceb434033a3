"""Loading a Hugging Face model folder: config.json, safetensors, tokenizer, EOS.

Concept: turn a local folder as ``save_pretrained`` writes it into plain values the
engine can trust: a frozen ``ModelSpec`` (architecture and shapes), the weight tensors,
the tokenizer and the EOS token ids. Every problem is reported before anything runs, as
a ``ValueError`` naming the folder, file or tensor.

Mirrors: ``vllm/model_executor/model_loader/`` (default loader, safetensors iteration)
and ``vllm/transformers_utils/config.py``, in a few hundred lines.

Supported: ``Qwen3ForCausalLM`` (q/k RMSNorm), ``Qwen2ForCausalLM`` (q/k/v bias),
``LlamaForCausalLM`` (optionally llama3 rope scaling). Both forms of ``config.json``:
transformers v4 (top-level ``rope_theta`` and ``rope_scaling``) and v5
(``rope_parameters``).

NOTE 1 (no pickle): weights are read with safetensors only. A ``pytorch_model.bin`` is
a pickle that can run code when loaded; we refuse it instead of unpickling it.
NOTE 2 (dtype "auto"): the checkpoint's dtype on a GPU; float32 on the CPU, where
half-precision matmuls are slow and the equivalence tests want exact arithmetic.

Left out: quantised checkpoints, multimodal configs, remote code.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}
_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling of the rotary embedding."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelSpec:
    """The architecture of a decoder, as read from ``config.json``."""

    architecture: str  # e.g. "Qwen3ForCausalLM"
    family: str  # "qwen3" | "qwen2" | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k
    qkv_bias: bool  # Qwen2: bias on the q, k, v projections
    torch_dtype: str  # the checkpoint's dtype, one of float32 / float16 / bfloat16


def _require_folder(folder: str | Path) -> Path:
    path = Path(folder)
    if not path.is_dir():
        raise ValueError(f"model folder {str(folder)!r} does not exist or is not a directory")
    return path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} is missing") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _rope(config: dict[str, Any], path: Path) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling from either config form (v5 ``rope_parameters`` first)."""
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if not scaling:
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(f"{path}: rope type {rope_type!r} is not supported (only default and llama3)")
    return float(theta), RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def load_model_spec(folder: str | Path) -> ModelSpec:
    """Read and check ``config.json`` of a Hugging Face model folder."""
    path = _require_folder(folder) / "config.json"
    config = _read_json(path)
    archs = [a for a in config.get("architectures") or [] if a in SUPPORTED_ARCHITECTURES]
    if not archs:
        raise ValueError(
            f"{path}: architectures {config.get('architectures')!r} include none of the supported "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        )
    arch = archs[0]
    family = SUPPORTED_ARCHITECTURES[arch]
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        spec_fields = dict(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
        )
    except KeyError as e:
        raise ValueError(f"{path}: required field {e.args[0]!r} is missing") from None
    theta, scaling = _rope(config, path)
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    if dtype not in _DTYPES:
        raise ValueError(f"{path}: dtype {dtype!r} is not one of {_DTYPES}")
    return ModelSpec(
        architecture=arch,
        family=family,
        **spec_fields,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=family == "qwen3",
        qkv_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
        torch_dtype=dtype,
    )


def find_weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a folder: those named by ``model.safetensors.index.json``
    when it exists (sharded checkpoints), else every ``*.safetensors``."""
    path = _require_folder(folder)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise ValueError(f"{index} names {f.name}, which is missing from {path}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (found {pickled}: pickled weights are refused, convert them to safetensors)" if pickled else ""
        raise ValueError(f"no *.safetensors weights in {path}{hint}")
    return files


def iter_safetensors(files: Iterable[Path], device: str = "cpu") -> Iterator[tuple[str, Any]]:
    """Yield ``(name, tensor)`` for every tensor of the files, without unpickling."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device=device) as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def expected_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the decoder reads, in Hugging Face naming, with its shape."""
    hidden, inter, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, hidden)
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)}
        shapes |= {p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.o_proj.weight": (hidden, q)}
        shapes |= {p + "self_attn.k_proj.weight": (kv, hidden), p + "self_attn.v_proj.weight": (kv, hidden)}
        shapes |= {p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden)}
        shapes |= {p + "mlp.down_proj.weight": (hidden, inter)}
        if spec.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,)}
            shapes |= {p + "self_attn.v_proj.bias": (kv,)}
        if spec.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return shapes


def expected_tensor_names(spec: ModelSpec) -> list[str]:
    """Every tensor the decoder needs, in Hugging Face naming."""
    return list(expected_tensor_shapes(spec))


def check_tensor_names(spec: ModelSpec, names: Iterable[str], folder: str | Path) -> None:
    """Raise ValueError naming the first missing tensor, before any weight is used."""
    present = set(names)
    for name in expected_tensor_names(spec):
        if name not in present:
            raise ValueError(f"tensor {name!r} is missing from the weights in {folder}")


def load_tokenizer(folder: str | Path):
    """The folder's tokenizer, through transformers' ``AutoTokenizer``."""
    path = _require_folder(folder)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {path}: {e}") from None


def load_eos_token_ids(folder: str | Path, tokenizer=None) -> list[int]:
    """EOS ids from ``generation_config.json`` if present, else the tokenizer's."""
    gen = _require_folder(folder) / "generation_config.json"
    if gen.exists():
        eos = _read_json(gen).get("eos_token_id")
        if eos is not None:
            return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return [int(tokenizer.eos_token_id)]
    return []


def resolve_dtype(dtype: str, spec: ModelSpec, device: str):
    """The torch dtype to run in: "auto" is the checkpoint's on GPU, float32 on CPU (NOTE 2)."""
    import torch

    if dtype == "auto":
        dtype = spec.torch_dtype if device.startswith("cuda") else "float32"
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not 'auto' or one of {_DTYPES}")
    return getattr(torch, dtype)
