"""Loading a Hugging Face model folder: config.json and safetensors (the tokenizer: NOTE 4).

Concept: turn a local folder as ``save_pretrained`` writes it into plain values the
engine can trust: a frozen ``ModelSpec`` (architecture and shapes) and the weight tensors. Every problem with the folder is one ``ValueError``
naming the file and the field (or tensor) and the value found, before anything runs;
nothing from deep inside (``KeyError``, ``SafetensorError``, ...) escapes.

Mirrors: ``vllm/model_executor/model_loader/`` (default loader, safetensors iteration)
and ``vllm/transformers_utils/config.py``, in a few hundred lines.

Supported: ``Qwen3ForCausalLM`` (q/k RMSNorm), ``Qwen2ForCausalLM`` (q/k/v bias),
``LlamaForCausalLM`` (optionally llama3 rope scaling), and each family's
``*ForSequenceClassification`` (a ``score`` head for the labels of ``id2label``, NOTE 7);
``config.json`` in transformers v4's form (top-level ``rope_theta``, ``rope_scaling``) and v5's
(``rope_parameters``).

What is checked (each failure a ``ValueError`` naming the file and the field):
- Every file read or handed on: a regular file inside the folder, of bounded size (NOTE 5).
- JSON files: valid UTF-8 JSON, an object at the top (``model_files.read_json_object``).
- ``config.json``: one supported architecture; sizes integers in [1, ``MAX_CONFIG_INT``];
  heads a multiple of KV heads, ``head_dim`` even; ``rms_norm_eps`` and ``rope_theta``
  finite > 0; bools and ``dtype`` as named; rope type default or llama3 with its fields.
- Weights: safetensors only (NOTE 1); shards stay inside the folder (NOTE 3); every
  header parses and covers its file; no tensor in two files; every tensor the decoder
  needs with its shape and a float dtype, none it would ignore (``check_weights``, from
  the headers alone); their bytes fit in the memory available (NOTE 5).
- Tokenizer files and EOS ids: ``models/tokenizer.py`` (NOTE 4). ``check_model_folder``
  runs all of these but the tokenizer's loading, without torch or transformers (the
  command line calls it first).

NOTE 1 (no pickle): weights are read with safetensors only. A ``pytorch_model.bin`` is
a pickle that can run code when loaded; we refuse it instead of unpickling it.
NOTE 2 (dtype "auto"): the checkpoint's dtype on a GPU; float32 on the CPU, where
half-precision matmuls are slow and the equivalence tests want exact arithmetic.
NOTE 3 (shards stay inside): an index's shard name that is absolute or climbs out with
``..`` is refused, and so is any file resolving outside the folder, but for a hub
snapshot's links into ``../../blobs/`` (otherwise a downloaded folder could make us read
any file on the machine).
NOTE 4 (the tokenizer and EOS ids): read by ``models/tokenizer.py``, whose checks
``check_model_folder`` runs too.
NOTE 5 (files that never end): a name linked to ``/dev/zero``, a FIFO, or a consistent
but absurd checkpoint (``vocab_size`` 2**31 - 1 and a sparse weights file) would read
forever, hang, or fail inside torch. ``models/model_files.py`` reads each file within
bounds, and the weights' bytes from the headers are compared with the memory available
(CPU in ``check_model_folder``, the device in ``iter_safetensors``) before any is read.
NOTE 6 (a rank reads its slice): ``checkpoint_slices`` hands out each tensor unread, as a
``CheckpointSlice``; indexing it (``w[a:b]``, ``w[:, a:b]``) reads only those rows or columns
from the file, so a tensor-parallel rank never holds a whole split tensor (vLLM's loader
calls safetensors' ``get_slice`` for the same reason).
NOTE 7 (classifiers): a ``*ForSequenceClassification`` checkpoint is the decoder with a
``score.weight`` ``[num_labels, hidden]`` for the LM head; ``labels`` are ``id2label``'s names
(default ``LABEL_0``, ``LABEL_1``); an ``lm_head.weight`` beside it is skipped, as vLLM does.
NOTE 8 (a causal LM read as one, vLLM's ``classifier_from_token`` in ``hf_overrides``): the
score head is those tokens' LM-head rows, made at load time (``models/classifier.py``); two
with ``method: from_2_way_softmax`` make one label (``pooling_spec.py`` NOTE 3).

Left out: quantised checkpoints, multimodal configs, remote code; checking that the
tokenizer's ids fit ``vocab_size`` (some checkpoints list added tokens past it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from tinyvllm.models.pooling_spec import classifier_head
from tinyvllm.models.tokenizer import check_tokenizer_files, load_eos_token_ids
from tinyvllm.models.model_files import (
    check_model_file,
    check_weights_fit,
    json_type,
    read_json_object,
    read_model_config,
    require_model_folder,
)

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "Qwen3ForSequenceClassification": "qwen3",  # NOTE 7
    "Qwen2ForSequenceClassification": "qwen2",
    "LlamaForSequenceClassification": "llama",
}
_DTYPES = ("float32", "float16", "bfloat16")
# safetensors dtype codes a weight may have (float8 and integers mean a quantised checkpoint)
WEIGHT_DTYPES = ("F16", "BF16", "F32", "F64")
# Checkpoint tensors that carry nothing the decoder needs (old Llama exports saved the buffer).
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_REQUIRED = object()  # sentinel: a field with no default
MAX_CONFIG_INT = 2**31 - 1  # sizes past it are typos (and overflow int32 index arithmetic)


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
    labels: tuple[str, ...] | None = None  # NOTE 7: a classifier's label names by id; None: a causal LM
    score_from_tokens: tuple[str, ...] | None = None  # NOTE 8: the score head made of these tokens' LM-head rows
    two_way: bool = False  # NOTE 8: one label, the second token's row minus the first's

    @property
    def num_labels(self) -> int | None:
        """A classifier's number of labels (the rows of ``score.weight``); None for a causal LM."""
        return None if self.labels is None else len(self.labels)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it (no data read)."""

    file: Path
    dtype: str  # safetensors code: "F32", "BF16", "I64", ...
    shape: tuple[int, ...]


# -- typed fields: each failure names the file, the field and the value --------------------


def _int_field(table: dict[str, Any], key: str, where: str, default: Any = _REQUIRED, minimum: int = 1) -> int:
    """``table[key]`` as an int >= ``minimum``; absent or null gives ``default``."""
    value = table.get(key)
    if value is None:
        if default is _REQUIRED:
            missing = "is missing" if key not in table else "is null"
            raise ValueError(f"{where}: required field {key!r} {missing}")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: field {key!r} must be an integer, got {value!r} ({json_type(value)})")
    if value < minimum:
        raise ValueError(f"{where}: field {key!r} must be >= {minimum}, got {value}")
    if value > MAX_CONFIG_INT:
        raise ValueError(f"{where}: field {key!r} must be <= {MAX_CONFIG_INT}, got {value}")
    return value


def _float_field(table: dict[str, Any], key: str, where: str, default: float | object = _REQUIRED) -> float:
    """``table[key]`` as a finite number > 0; absent or null gives ``default``."""
    value = table.get(key)
    if value is None:
        if default is _REQUIRED:
            missing = "is missing" if key not in table else "is null"
            raise ValueError(f"{where}: required field {key!r} {missing}")
        return float(default)  # type: ignore[arg-type]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: field {key!r} must be a number, got {value!r} ({json_type(value)})")
    try:
        number = float(value)
    except OverflowError:  # an integer past float's range
        number = math.inf
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{where}: field {key!r} must be a finite number > 0, got {value!r}")
    return number


def _bool_field(table: dict[str, Any], key: str, where: str, default: bool) -> bool:
    value = table.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{where}: field {key!r} must be true or false, got {value!r} ({json_type(value)})")
    return value


def _object_field(table: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    """``table[key]`` as a JSON object; absent or null gives ``{}``."""
    value = table.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where}: field {key!r} must be an object {{...}}, got {value!r} ({json_type(value)})")
    return value


def _rope(config: dict[str, Any], path: Path) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling from either config form (v5 ``rope_parameters`` first)."""
    params = _object_field(config, "rope_parameters", str(path))
    legacy = _object_field(config, "rope_scaling", str(path))
    if params.get("rope_theta") is not None:
        theta = _float_field(params, "rope_theta", f"{path}: rope_parameters")
    else:
        theta = _float_field(config, "rope_theta", str(path), default=10000.0)
    source, scaling = ("rope_scaling", legacy) if legacy else ("rope_parameters", params)
    where = f"{path}: {source}"
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if not isinstance(rope_type, str):
        raise ValueError(f"{where}: field 'rope_type' must be a string, got {rope_type!r}")
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(
            f"{where}: rope type {rope_type!r} is not supported (field 'rope_type'; only default and llama3)"
        )
    for key in _LLAMA3_KEYS:
        if scaling.get(key) is None:
            raise ValueError(f"{where}: rope type 'llama3' needs the field {key!r}, which is missing")
    rope = RopeScaling(
        factor=_float_field(scaling, "factor", where),
        low_freq_factor=_float_field(scaling, "low_freq_factor", where),
        high_freq_factor=_float_field(scaling, "high_freq_factor", where),
        original_max_position_embeddings=_int_field(scaling, "original_max_position_embeddings", where),
    )
    if rope.high_freq_factor <= rope.low_freq_factor:  # the smooth band divides by their difference
        raise ValueError(
            f"{where}: field 'high_freq_factor' ({rope.high_freq_factor}) must be greater than "
            f"'low_freq_factor' ({rope.low_freq_factor})"
        )
    return theta, rope


def _architecture(config: dict[str, Any], path: Path) -> str:
    archs = config.get("architectures")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"{path}: field 'architectures' must be a list of class names, got {archs!r}")
    supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise ValueError(
            f"{path}: architectures {archs!r} include none of the supported {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return supported[0]


def load_model_spec(folder: str | Path, overrides: Mapping[str, Any] | None = None) -> ModelSpec:
    """Read and check ``config.json`` of a Hugging Face model folder, ``overrides`` (vLLM's
    ``hf_overrides``) laid over it (every check listed in the module header); a ValueError
    names the file, the field and the value."""
    path = require_model_folder(folder) / "config.json"
    config = read_model_config(folder, overrides)
    where = str(path)
    arch = _architecture(config, path)
    family = SUPPORTED_ARCHITECTURES[arch]
    sizes = {
        key: _int_field(config, key, where)
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    }
    hidden, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    kv_heads = _int_field(config, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise ValueError(
            f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    head_dim = _int_field(config, "head_dim", where, default=None)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(
                f"{where}: hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}) "
                f"and no head_dim is given"
            )
        head_dim = hidden // heads
    if head_dim % 2:
        raise ValueError(f"{where}: head_dim must be even (the rotary embedding rotates pairs), got {head_dim}")
    theta, scaling = _rope(config, path)
    dtype = next((config[k] for k in ("dtype", "torch_dtype") if config.get(k) is not None), "float32")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ValueError(f"{where}: dtype {dtype!r} is not one of {_DTYPES}")
    return ModelSpec(
        architecture=arch,
        family=family,
        **sizes,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float_field(config, "rms_norm_eps", where, default=1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_int_field(config, "max_position_embeddings", where, default=2048),
        tie_word_embeddings=_bool_field(config, "tie_word_embeddings", where, default=False),
        qk_norm=family == "qwen3",
        qkv_bias=family == "qwen2" or _bool_field(config, "attention_bias", where, default=False),
        torch_dtype=dtype,
        **classifier_head(config, arch, where),
    )


# -- weights --------------------------------------------------------------------------------


def _shard_path(name: object, folder: Path, index: Path) -> Path:
    """The file an index entry names, refused if the name leaves the folder (NOTE 3)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{index}: weight_map values must be file names, got {name!r}")
    rel = PurePosixPath(name.replace("\\", "/"))
    if rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"{index}: shard {name!r} is outside the model folder {folder} (absolute or '..')")
    return folder / rel


def find_weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a folder: those named by ``model.safetensors.index.json``
    when it exists (sharded checkpoints), else every ``*.safetensors``. Every file is a
    regular file inside the folder (NOTE 3)."""
    path = require_model_folder(folder)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json_object(index, path, "index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(
                f"{index}: field 'weight_map' must be a non-empty object {{tensor: file}}, got {weight_map!r}"
            )
        names = set()
        for name in weight_map.values():
            if not isinstance(name, str):
                raise ValueError(f"{index}: weight_map values must be file names, got {name!r}")
            names.add(name)
        files = [_shard_path(name, path, index) for name in sorted(names)]
        for f in files:
            if not os.path.lexists(f):
                raise ValueError(f"{index} names {f.name}, which is missing from {path}")
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            pickled = sorted(p.name for p in path.glob("*.bin"))
            hint = f" (found {pickled}: pickled weights are refused, convert them to safetensors)" if pickled else ""
            raise ValueError(f"no *.safetensors weights in {path}{hint}")
    for f in files:
        check_model_file(f, path)  # a regular file inside the folder (NOTE 3), of any size
    return files


def _safetensors_error(file: Path, error: Exception, tensor: str | None = None) -> ValueError:
    what = f"tensor {tensor!r} of {file}" if tensor else str(file)
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    return ValueError(f"{what} cannot be read as safetensors (truncated or not a safetensors file?): {reason}")


def read_tensor_infos(files: Iterable[Path]) -> dict[str, TensorInfo]:
    """Name -> dtype and shape of every tensor, from the safetensors headers only: cheap,
    no torch. A header that does not parse or does not cover its file (truncated, empty)
    and a tensor stored in two files are ValueErrors naming the file."""
    from safetensors import SafetensorError, safe_open

    infos: dict[str, TensorInfo] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as handle:
                for name in handle.keys():
                    piece = handle.get_slice(name)
                    if name in infos:
                        raise ValueError(f"tensor {name!r} is stored twice, in {infos[name].file} and in {f}")
                    infos[name] = TensorInfo(f, str(piece.get_dtype()), tuple(piece.get_shape()))
        except (SafetensorError, OSError) as e:
            raise _safetensors_error(f, e) from None
    return infos


def iter_safetensors(files: Iterable[Path], device: str = "cpu") -> Iterator[tuple[str, Any]]:
    """Yield ``(name, tensor)`` for every tensor of the files, without unpickling; an
    unreadable file or tensor is a ValueError naming it, and so are weights larger than
    the memory available on ``device``, before any tensor is read (NOTE 5)."""
    from safetensors import SafetensorError, safe_open

    files = list(files)
    if files:
        check_weights_fit(read_tensor_infos(files).values(), files[0].parent, device)
    for f in files:
        try:
            handle_cm = safe_open(str(f), framework="pt", device=device)
        except (SafetensorError, OSError) as e:
            raise _safetensors_error(f, e) from None
        with handle_cm as handle:
            for name in handle.keys():
                try:
                    tensor = handle.get_tensor(name)
                except (SafetensorError, OSError) as e:
                    raise _safetensors_error(f, e, name) from None
                yield name, tensor


class CheckpointSlice:
    """One checkpoint tensor, not yet read: indexing reads only the indexed part (NOTE 6); a
    failed read is a ValueError naming the tensor and its file."""

    def __init__(self, handle: Any, name: str, file: Path) -> None:
        self.name, self.file = name, file
        self._slice = handle.get_slice(name)

    def get_shape(self) -> list[int]:
        return self._slice.get_shape()

    def __getitem__(self, index: Any) -> Any:  # a torch.Tensor of the indexed part
        from safetensors import SafetensorError

        try:
            return self._slice[index]
        except (SafetensorError, OSError) as e:
            raise _safetensors_error(self.file, e, self.name) from None


@contextmanager
def checkpoint_slices(files: Iterable[Path]) -> Iterator[dict[str, CheckpointSlice]]:
    """Every tensor of the files as a ``CheckpointSlice`` (NOTE 6), open while the block runs.
    Check the headers (``read_tensor_infos``) and the memory first: this reads nothing."""
    from safetensors import SafetensorError, safe_open

    with ExitStack() as stack:
        slices: dict[str, CheckpointSlice] = {}
        for f in files:
            try:
                handle = stack.enter_context(safe_open(str(f), framework="pt"))
                slices |= {name: CheckpointSlice(handle, name, f) for name in handle.keys()}
            except (SafetensorError, OSError) as e:
                raise _safetensors_error(f, e) from None
        yield slices


def expected_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the decoder reads, in Hugging Face naming, with its shape."""
    hidden, inter, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if spec.labels is not None and spec.score_from_tokens is None:  # NOTE 7
        shapes["score.weight"] = (len(spec.labels), hidden)
    elif not spec.tie_word_embeddings:  # a causal LM's head, or the rows a converted classifier takes (NOTE 8)
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


def check_weights(spec: ModelSpec, infos: dict[str, TensorInfo], folder: str | Path) -> None:
    """Missing, misshapen, non-float or unused tensors: a ValueError naming the tensor and
    its file. Runs on the headers (``read_tensor_infos``), before any tensor is read."""
    last = f"model.layers.{spec.num_hidden_layers - 1}.input_layernorm.weight"
    if last not in infos:  # before listing every tensor of num_hidden_layers layers (it could be huge)
        raise ValueError(
            f"tensor {last!r} is missing from the weights in {folder} "
            f"(config.json has num_hidden_layers = {spec.num_hidden_layers})"
        )
    check_tensor_names(spec, infos, folder)
    shapes = expected_tensor_shapes(spec)
    for name, info in infos.items():
        if name in shapes:
            if info.shape != shapes[name]:
                raise ValueError(f"tensor {name!r} in {info.file} has shape {info.shape}, expected {shapes[name]}")
            if info.dtype not in WEIGHT_DTYPES:
                raise ValueError(
                    f"tensor {name!r} in {info.file} has dtype {info.dtype}, not one of {WEIGHT_DTYPES} "
                    f"(quantised checkpoints are not supported)"
                )
        elif not (name.endswith(IGNORED_TENSOR_SUFFIXES) or (name == "lm_head.weight" and (spec.tie_word_embeddings or spec.labels))):
            raise ValueError(f"tensor {name!r} in {info.file} is not used by this decoder (unsupported feature)")


def check_model_folder(folder: str | Path, overrides: Mapping[str, Any] | None = None) -> ModelSpec:
    """Every check of the module header but loading the tokenizer, without importing torch
    or transformers; returns the spec. The command line runs it before starting the engine."""
    spec = load_model_spec(folder, overrides)
    infos = read_tensor_infos(find_weight_files(folder))
    check_weights(spec, infos, folder)
    check_weights_fit(infos.values(), folder, "cpu")  # every tensor passes through CPU memory (NOTE 5)
    check_tokenizer_files(folder)
    load_eos_token_ids(folder)
    return spec


def resolve_dtype(dtype: str, spec: ModelSpec, device: str):
    """The torch dtype to run in: "auto" is the checkpoint's on GPU, float32 on CPU (NOTE 2)."""
    import torch

    if dtype == "auto":
        dtype = spec.torch_dtype if device.startswith("cuda") else "float32"
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not 'auto' or one of {_DTYPES}")
    return getattr(torch, dtype)
