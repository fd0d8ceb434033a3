"""The decoder: one Llama-style transformer for Llama, Qwen2 and Qwen3 over the paged KV cache.

Concept: ``DecoderForCausalLM`` turns the N scheduled tokens of a step (prefill chunks and
decodes, back to back) into hidden states, through the paged KV cache and the step's
``AttentionMetadata``. Per layer: RMSNorm, fused q/k/v projection, (Qwen3) RMSNorm per q/k
head, rotary embedding, the backend's KV write, ``paged_attention``, output projection,
residual; then RMSNorm and a fused SiLU-gated MLP. ``compute_logits`` maps only the rows the
runner asks for to the vocabulary, in float32. The families differ by ``ModelSpec`` flags:
``qk_norm`` (Qwen3), ``qkv_bias`` (Qwen2), ``rope_scaling`` (llama3), ``tie_word_embeddings``.

Follows: seed 003 "KV cache物理内存分配" (the per-layer cache ``(2, num_blocks, block_size,
num_kv_heads, head_size)``: keys ``kv[0]``, values ``kv[1]``); seed 000 "CUDA Graphs",
"嵌套 Wrapper 设计" (the forward runs as pieces between attention ops, NOTE 5).
Mirrors: ``vllm/model_executor/models/llama.py`` (and ``qwen2.py``, ``qwen3.py``) with
``layers/rotary_embedding.py`` and ``layernorm.py`` folded in (CUDA: ``rms_norm.py``, ``rotary.py``).

Invariants: the arithmetic is transformers' own, operation for operation, so float32 results
match ``AutoModelForCausalLM`` to rounding; padding rows (past ``query_start_loc[-1]``)
write nothing to the cache and leave the real rows unchanged; no Python loop runs over
tokens, and the forward reads no tensor's value on the host (a CUDA graph could not).

NOTE 1 (fused projections): q, k and v share one linear map whose weight stacks the three
checkpoint matrices, ``[(H + 2 * Hkv) * D, hidden]`` (q rows, then k, then v; the bias
likewise); gate and up share one, ``[2 * I, hidden]`` (gate first): one matmul, not three
(or two), as vLLM's; the layers' weight loaders stack them (``parallel_layers.py``).
NOTE 2 (transformers' rounding): RMSNorm's variance in float32, the weight multiplied after
the cast back; ``inv_freq`` and cos/sin float32, cast to the model dtype, as transformers.
NOTE 3 (inv_freq stays float32): recomputed after every ``.to()`` / ``to_empty()``.
NOTE 4 (flat names): no Hugging Face ``model.`` level; ``load_model`` maps the names.
NOTE 5 (the piecewise split, by hand): vLLM's torch.compile splits the traced forward at
every attention op; here ``pieces[0]`` is the embedding and layer 0 up to its attention,
``pieces[i]`` the rest of layer ``i - 1`` and layer ``i`` up to its attention, the last
finishes the last layer and the final norm; ``attention_op`` (KV write + paged attention;
where fused, the q/k norms and rotary too, qk_norm_rotary.py NOTE 3) runs between them.
Each piece allocates the buffer the next attention writes into, so every tensor crossing a
split has a fixed address. The runner may wrap each piece (``worker/cuda_graph.py``); the
model knows nothing of graphs. A piece holds the model weakly (``Piece``), so model and
pieces form no cycle and ``del llm`` frees the weights at once.
NOTE 6 (the LM head for one to three rows on the CPU): for so few rows MKL's matrix-vector
path over ``[V, hidden]`` is slower than ``hidden @ weight.t().contiguous()`` (docs/model_runner.md),
so on the CPU ``compute_logits`` keeps that copy (remade if the weight changes) for up to
``SMALL_LM_HEAD_ROWS`` rows, if at most ``SMALL_LM_HEAD_MAX_BYTES``; logits differ by rounding.
NOTE 7 (the MLP in place): ``silu`` and the product with ``up`` overwrite the gate half of
the gate/up output (one kernel on CUDA, ``activation.py``), with transformers' rounding.
NOTE 8 (a backend's plan per step): host work that depends only on the step and the
``AttentionLayout`` (torch's gather indices and masks; Triton's checks, tiles, grid, buffers)
is the backend's ``plan_step``, called once per forward outside any piece and passed on by
each layer's ``attention_op``, as vLLM's metadata builders run once per step.
NOTE 9 (the residual adds ride with the norms): each residual add is followed by a norm, so
``RMSNorm.add_forward`` does both (one kernel on CUDA, ``rms_norm.py`` NOTE 3). After the MLP
that norm is the next layer's ``input_layernorm``, in the next piece: ``after_attention``
returns the residual stream and the MLP's output apart and ``before_attention`` (or the
final norm) adds them, as vLLM's layers pass ``hidden_states, residual``.
NOTE 10 (tensor parallelism): the layers are ``parallel_layers.py``'s, for this process's
rank of N: H / N query heads, ``kv_heads_per_rank`` KV heads (its cache too), I / N of the
MLP, V / N of the vocabulary. ``load_model`` refuses an N the heads do not split over before
reading anything, then reads only the rank's slices (``loader.py`` NOTE 6).
Left out: quantisation, sliding windows, rope types other than default and llama3,
``mlp_bias`` / ``o_proj`` bias, LoRA, pipeline stages.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from tinyvllm.attention.backends import ATTENTION_BACKENDS, AttentionBackend  # noqa: F401  (re-exported)
from tinyvllm.attention.cudagraph_support import AttentionCGSupport
from tinyvllm.attention.metadata import AttentionLayout, AttentionMetadata
from tinyvllm.dependent_launch import pdl_from_env
from tinyvllm.distributed.parallel_state import get_tensor_model_parallel_world_size
from tinyvllm.distributed.utils import check_tensor_parallel_size, kv_heads_per_rank
from tinyvllm.models.activation import silu_and_mul, silu_and_mul_impl
from tinyvllm.models.loader import (
    ModelSpec,
    TensorInfo,
    check_weights,
    checkpoint_slices,
    find_weight_files,
    load_model_spec,
    read_tensor_infos,
)
from tinyvllm.models.model_files import check_weights_fit
from tinyvllm.models.parallel_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from tinyvllm.models.qk_norm_rotary import (
    fused_kv_write,
    qk_norm_rotary_applies,
    qk_norm_rotary_triton,
    qk_norm_rotary_write_kv_triton,
)
from tinyvllm.models.rms_norm import add_rms_norm, rms_norm, rms_norm_impl
from tinyvllm.models.rotary import rotary, rotary_applies, rotary_impl, rotary_write_kv_triton

# NOTE 6: on the CPU, up to this many rows use a column-major copy of the LM head, if at most this big.
SMALL_LM_HEAD_ROWS = 3
SMALL_LM_HEAD_MAX_BYTES = 256 * 2**20


def kv_cache_shape(spec: ModelSpec, num_blocks: int, block_size: int, tensor_parallel_size: int = 1) -> tuple[int, ...]:
    """One layer's cache on one rank (seed 003, NOTE 10): ``(2, num_blocks, block_size, Hkv / N, D)``,
    keys at index 0."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks = {num_blocks} and block_size = {block_size} must both be >= 1")
    return (2, num_blocks, block_size, kv_heads_per_rank(spec.num_key_value_heads, tensor_parallel_size), spec.head_dim)


# --8<-- [start:rmsnorm]
class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))``, the variance in float32 (NOTE 2): one
    Triton kernel on CUDA, the torch ops elsewhere (``rms_norm.py``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.impl = rms_norm_impl()  # "auto" unless TINYVLLM_RMS_NORM says otherwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size]
        return rms_norm(x, self.weight, self.eps, self.impl)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + delta), x + delta)``: the residual add and the norm, one kernel on CUDA."""
        return add_rms_norm(x, delta, self.weight, self.eps, self.impl)
# --8<-- [end:rmsnorm]


# --8<-- [start:rope]
def compute_inv_freq(spec: ModelSpec, device: torch.device | str | None = None) -> torch.Tensor:
    """Rotary inverse frequencies ``theta^(-2i/D)`` in float32, [D/2]; llama3 scaling divides
    the low frequencies by ``factor`` and blends the middle band smoothly (NOTE 2)."""
    dim = spec.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim  # [D/2]
    inv_freq = 1.0 / (spec.rope_theta**exponents)  # [D/2]
    scaling = spec.rope_scaling
    if scaling is None:
        return inv_freq
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)  # long waves: / factor
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos and sin of ``position * inv_freq`` for each token, neox layout (two halves)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        # Computed on the CPU even under the meta device (load_model), where the arithmetic
        # would run through torch's reference ops and import torch._dynamo; _apply recomputes it.
        self.register_buffer("inv_freq", compute_inv_freq(spec, "cpu"), persistent=False)  # [D/2] float32

    def _apply(self, fn, recurse=True):  # NOTE 3: recompute in float32 wherever we moved
        super()._apply(fn, recurse)
        self.inv_freq = compute_inv_freq(self.spec, self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)
# --8<-- [end:rope]


class Attention(nn.Module):
    """Fused q/k/v projection, optional q/k norm, rotary, paged KV cache, output projection."""

    def __init__(self, spec: ModelSpec, backend: AttentionBackend) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        self.qkv_proj = QKVParallelLinear(
            spec.hidden_size, self.head_dim, spec.num_attention_heads, spec.num_key_value_heads, bias=spec.qkv_bias
        )  # NOTE 1
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's (NOTE 10)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(spec.num_attention_heads * self.head_dim, spec.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.scale = self.head_dim**-0.5
        self.backend = backend
        self.rotary_impl = rotary_impl()  # "auto" unless TINYVLLM_ROTARY says otherwise
        self.fuse_kv_write = fused_kv_write()  # qk_norm_rotary.py NOTE 3
        pdl_from_env()  # a bad TINYVLLM_PDL is refused as the layers are built (dependent_launch.py)

    # --8<-- [start:attention_forward]
    def project(
        self,
        x: torch.Tensor,  # [N, hidden], already normalised
        cos: torch.Tensor,  # [N, D]
        sin: torch.Tensor,  # [N, D]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused q/k/v projection, (Qwen3) q/k norm and rotary: [N, H, D], [N, Hkv, D] x 2.
        Where the rotation is a kernel, ``attention_op`` rotates instead, in its KV write's launch."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)  # [N, H, D]
        k = k.view(n, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        v = v.view(n, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        if self._qk_kernel(q):  # Qwen3 on CUDA: the norms and the rotary in one kernel, in place
            if not self.fuse_kv_write:  # else attention_op's kernel does them, with the KV write
                q, k = qk_norm_rotary_triton(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin)
            return q, k, v
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not (self.fuse_kv_write and rotary_applies(q, k, cos, sin, self.rotary_impl)):  # else in attention_op
            q, k = rotary(q, k, cos, sin, self.rotary_impl)  # one kernel on CUDA, in place (rotary.py)
        return q, k, v

    def _qk_kernel(self, q: torch.Tensor) -> bool:
        return self.q_norm is not None and qk_norm_rotary_applies(q, self.q_norm.impl, self.rotary_impl)

    def attention_op(
        self,
        q: torch.Tensor,  # [N, H, D]
        k: torch.Tensor, v: torch.Tensor,  # [N, Hkv, D] each: this step's keys and values
        cos: torch.Tensor, sin: torch.Tensor,  # [N, D] each
        kv_cache: torch.Tensor,  # [2, B, S, Hkv, D]
        meta: AttentionMetadata,
        out: torch.Tensor,  # [N, H, D], written in place
        plan: object | None = None,  # the backend's plan for this step (NOTE 8)
    ) -> torch.Tensor:
        """The split point (NOTE 5): write this step's K/V into the cache (rotating q and k in
        the same launch where ``project`` left them), attend over it."""
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [B, S, Hkv, D] each
        if self.fuse_kv_write and self._qk_kernel(q):  # q/k norms, rotary and KV write: one kernel
            qk_norm_rotary_write_kv_triton(q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                           cos, sin, key_cache, value_cache, meta.slot_mapping)  # fmt: skip
        elif self.fuse_kv_write and rotary_applies(q, k, cos, sin, self.rotary_impl):  # rotary and KV write
            rotary_write_kv_triton(q, k, v, cos, sin, key_cache, value_cache, meta.slot_mapping)
        else:  # padding slots skipped
            self.backend.write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        extra = ({} if plan is None else {"plan": plan}) | ({"key": k, "value": v} if self.backend.step_rows else {})
        return self.backend.paged_attention(
            q, key_cache, value_cache, meta.query_start_loc, meta.seq_lens, meta.block_table, self.scale, out=out, **extra
        )  # [N, H, D]; padding rows zero
    # --8<-- [end:attention_forward]


# --8<-- [start:mlp_layer]
class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul (NOTE 1)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(spec.hidden_size, [spec.intermediate_size] * 2, bias=False)
        self.intermediate_size = self.gate_up_proj.output_size_per_partition // 2  # this rank's I / N (NOTE 10)
        self.down_proj = RowParallelLinear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.act_impl = silu_and_mul_impl()  # "auto" unless TINYVLLM_SILU_AND_MUL says otherwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden]
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.intermediate_size, self.act_impl))  # NOTE 7


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, spec: ModelSpec, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, backend)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def before_attention(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mlp_out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """The residual stream (``x + mlp_out``: the previous layer's last add, NOTE 9), and
        ``norm`` of it to q, k, v, plus the empty [N, H, D] buffer attention writes into (NOTE 5)."""
        if mlp_out is None:  # the first layer: x is the embedding
            normed = self.input_layernorm(x)
        else:
            normed, x = self.input_layernorm.add_forward(x, mlp_out)
        q, k, v = self.self_attn.project(normed, cos, sin)
        return x, q, k, v, torch.empty_like(q)

    def after_attention(self, x: torch.Tensor, attn_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x + o_proj(attn)``, then ``mlp(norm(x))``: the residual stream and the MLP's output,
        not yet added (the next norm adds them, NOTE 9): [N, hidden] each."""
        normed, x = self.post_attention_layernorm.add_forward(x, self.self_attn.o_proj(attn_out.view(x.shape[0], -1)))
        return x, self.mlp(normed)
# --8<-- [end:mlp_layer]


class Piece:
    """One piece of the forward (NOTE 5): ``model.<method>(*args, *inputs)``, with the model held
    weakly. The model keeps its pieces; a bound method would hold the model in turn, a cycle
    that only the garbage collector frees, so ``del llm`` would keep the weights until then."""

    def __init__(self, model: nn.Module, method: str, *args: int) -> None:
        self._model, self._function, self._args = weakref.ref(model), getattr(type(model), method), args

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._function(self._model(), *self._args, *inputs)


class DecoderForCausalLM(nn.Module):
    """Llama / Qwen2 / Qwen3 over the paged KV cache. Build it with ``load_model``."""

    def __init__(self, spec: ModelSpec, attention_backend: str = "reference") -> None:
        super().__init__()
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend {attention_backend!r} is not one of {sorted(ATTENTION_BACKENDS)}")
        self.spec = spec
        self.attention_backend = attention_backend
        backend = ATTENTION_BACKENDS[attention_backend]
        # Built on the meta device (``load_model``), the weights come from the checkpoint: the
        # parallel layers' empty weights skip nn.Embedding's random init, whose code path imports
        # torch._dynamo (1-2.6 s of the command line's start-up, measured with python -X importtime).
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size)
        self.rotary = RotaryEmbedding(spec)
        self.layers = nn.ModuleList(DecoderLayer(spec, backend) for _ in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size)
        self.tie_weights()
        # NOTE 5: the pieces between attention ops, in order; a runner may wrap each one.
        middle = (Piece(self, "middle_piece", i) for i in range(1, len(self.layers)))
        self.pieces: list = [Piece(self, "first_piece"), *middle, Piece(self, "last_piece")]

    # --8<-- [start:tie]
    def tie_weights(self) -> None:
        """With ``tie_word_embeddings``, lm_head shares the embedding matrix (one Parameter)."""
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
    # --8<-- [end:tie]

    # --8<-- [start:pieces]
    def first_piece(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Embedding, rotary angles, and layer 0 up to its attention: x, cos, sin, q, k, v, out."""
        x = self.embed_tokens(input_ids)  # [N, hidden]
        cos, sin = self.rotary(positions, x.dtype)  # [N, D] each
        x, q, k, v, out = self.layers[0].before_attention(x, cos, sin)
        return x, cos, sin, q, k, v, out

    def middle_piece(
        self, i: int, x: torch.Tensor, attn_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """Layer ``i - 1`` after its attention, then layer ``i`` up to its attention: x, q, k, v, out."""
        x, mlp_out = self.layers[i - 1].after_attention(x, attn_out)
        return self.layers[i].before_attention(x, cos, sin, mlp_out)

    def last_piece(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The last layer after its attention, then the final norm (with its last add): [N, hidden]."""
        x, mlp_out = self.layers[-1].after_attention(x, attn_out)
        return self.norm.add_forward(x, mlp_out)[0]

    def forward(
        self,
        input_ids: torch.Tensor,  # [N] int64 (N may include CUDA-graph padding)
        positions: torch.Tensor,  # [N] int64
        kv_caches: list[torch.Tensor],  # L x [2, B, S, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per token: [N, hidden].

        The pieces run back to back with each layer's attention between them (NOTE 5).
        """
        n = attn_metadata.num_padded_tokens
        if input_ids.shape != (n,) or positions.shape != (n,):
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must both be "
                f"[{n}] (num_padded_tokens of the attention metadata)"
            )
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} tensors for {len(self.layers)} layers")
        attn, kv = self.layers[0].self_attn, kv_caches[0]  # [2, B, S, Hkv, D]: every layer's shape
        layout = AttentionLayout(attn.num_heads, kv.shape[3], attn.head_dim, kv.shape[2], kv.dtype, kv.device)
        plan = attn.backend.plan_step(attn_metadata, layout) if attn.backend.plan_step else None  # NOTE 8
        x, cos, sin, q, k, v, out = self.pieces[0](input_ids, positions)
        for i, layer in enumerate(self.layers):
            layer.self_attn.attention_op(q, k, v, cos, sin, kv_caches[i], attn_metadata, out, plan)  # between pieces
            if i + 1 < len(self.layers):
                x, q, k, v, out = self.pieces[i + 1](x, out, cos, sin)
        return self.pieces[-1](x, out)
    # --8<-- [end:pieces]

    def head_sources(self) -> list[tuple[str, nn.Parameter, Callable[..., None], object]]:
        """The head's entries of ``weight_sources``: none when it is the (tied) embedding."""
        return [] if self.spec.tie_word_embeddings else [("lm_head.weight", self.lm_head.weight, self.lm_head.weight_loader, None)]

    @property
    def cudagraph_support(self) -> AttentionCGSupport:
        """What its attention backend allows under CUDA graphs (seed 000)."""
        return ATTENTION_BACKENDS[self.attention_backend].cudagraph_support

    # --8<-- [start:compute_logits]
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> [R, V] float32 logits (the matmul runs in the model's dtype), the whole
        vocabulary on every rank (each computes its V / tp columns, then they are gathered)."""
        weight = self.lm_head.weight  # [V / tp, hidden]
        small = hidden.shape[0] <= SMALL_LM_HEAD_ROWS and weight.device.type == "cpu"
        if small and weight.numel() * weight.element_size() <= SMALL_LM_HEAD_MAX_BYTES:  # NOTE 6
            return self.lm_head.gather((hidden @ self._lm_head_columns()).float())  # [R, hidden] @ [hidden, V / tp]
        return self.lm_head.gather(self.lm_head(hidden).float())

    def _lm_head_columns(self) -> torch.Tensor:  # [hidden, V / tp], contiguous
        """The LM head's weight, transposed and copied (NOTE 6); remade if the weight changed."""
        weight = self.lm_head.weight
        key = (weight.data_ptr(), weight._version, weight.dtype)
        if getattr(self, "_columns_key", None) != key:
            self._columns = weight.detach().t().contiguous()
            self._columns_key = key
        return self._columns
    # --8<-- [end:compute_logits]


# --8<-- [start:load_model]
# --8<-- [start:sharded_load]
def weight_sources(model: DecoderForCausalLM) -> list[tuple[str, nn.Parameter, Callable[..., None], object]]:
    """Every checkpoint tensor the model reads: ``(name, parameter, weight_loader, shard_id)``.
    The loader copies this rank's slice of the tensor into the parameter (NOTE 10); q/k/v and
    gate/up land in their fused parameter at their part's offset (NOTE 1)."""
    spec, whole = model.spec, default_weight_loader  # norms: replicated, read whole
    sources = [("model.embed_tokens.weight", model.embed_tokens.weight, model.embed_tokens.weight_loader, None)]
    sources.append(("model.norm.weight", model.norm.weight, whole, None))
    sources += model.head_sources()  # the LM head's (unless tied), or a classifier's score
    for i, layer in enumerate(model.layers):
        p, attn, mlp = f"model.layers.{i}.", layer.self_attn, layer.mlp
        sources += [(p + "input_layernorm.weight", layer.input_layernorm.weight, whole, None)]
        sources += [(p + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight, whole, None)]
        qkv = attn.qkv_proj
        sources += [(p + f"self_attn.{x}_proj.weight", qkv.weight, qkv.weight_loader, x) for x in "qkv"]
        if spec.qkv_bias:
            sources += [(p + f"self_attn.{x}_proj.bias", qkv.bias, qkv.weight_loader, x) for x in "qkv"]
        sources += [(p + "self_attn.o_proj.weight", attn.o_proj.weight, attn.o_proj.weight_loader, None)]
        if spec.qk_norm:
            sources += [(p + "self_attn.q_norm.weight", attn.q_norm.weight, whole, None)]
            sources += [(p + "self_attn.k_norm.weight", attn.k_norm.weight, whole, None)]
        gate_up = mlp.gate_up_proj
        sources += [(p + "mlp.gate_proj.weight", gate_up.weight, gate_up.weight_loader, 0)]
        sources += [(p + "mlp.up_proj.weight", gate_up.weight, gate_up.weight_loader, 1)]
        sources += [(p + "mlp.down_proj.weight", mlp.down_proj.weight, mlp.down_proj.weight_loader, None)]
    return sources


@torch.no_grad()
def _load_weights(model: DecoderForCausalLM, slices: dict) -> None:
    """Each parameter's loader reads its rank's slice of the checkpoint tensor (NOTE 10)."""
    for name, param, weight_loader, shard_id in weight_sources(model):
        weight_loader(param, slices[name], shard_id)
# --8<-- [end:sharded_load]


class _MetaRead:
    """A stand-in for a checkpoint tensor that reads nothing and records what a loader indexes."""

    def __init__(self, info: TensorInfo, read: list[TensorInfo]) -> None:
        self.info, self.read, self._meta = info, read, torch.empty(info.shape, device="meta")

    def __getitem__(self, index: object) -> torch.Tensor:
        piece = self._meta[index]
        self.read.append(TensorInfo(self.info.file, self.info.dtype, tuple(piece.shape)))
        return piece


def rank_tensor_infos(model: DecoderForCausalLM, infos: dict[str, TensorInfo]) -> list[TensorInfo]:
    """The parts of the checkpoint this rank reads, found by running its loaders on a model
    still on the meta device (nothing is read): the memory check counts only these."""
    read: list[TensorInfo] = []
    for name, param, weight_loader, shard_id in weight_sources(model):
        weight_loader(param, _MetaRead(infos[name], read), shard_id)
    return read


def load_model(
    folder: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attention_backend: str = "reference",
    model_class: Callable[..., DecoderForCausalLM] | None = None,  # None: the causal LM; classifier.py's its own
    hf_overrides: dict | None = None,  # vLLM's: laid over config.json (loader.py NOTE 8)
) -> DecoderForCausalLM:
    """Read the folder's spec, refuse a tensor-parallel size its heads do not split over, check
    every tensor from the safetensors headers and this rank's bytes against the memory before
    reading any, then build ``model_class`` (a classifier's: ``classifier.py``) on ``device`` in
    ``dtype`` and copy this rank's slices in (NOTE 10). A broken folder: a ValueError naming it."""
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend {attention_backend!r} is not one of {sorted(ATTENTION_BACKENDS)}")
    spec = load_model_spec(folder, hf_overrides)
    check_tensor_parallel_size(get_tensor_model_parallel_world_size(), spec.num_attention_heads,
                               spec.num_key_value_heads, spec.intermediate_size)  # fmt: skip
    files = find_weight_files(folder)
    infos = read_tensor_infos(files)
    check_weights(spec, infos, folder)  # headers only: nothing read yet
    if (spec.labels is not None) != (model_class not in (None, DecoderForCausalLM)):  # loader.py NOTE 7
        raise ValueError(f"{folder} holds a {spec.architecture}: classifier.load_classifier loads classifiers, load_model the rest")
    with torch.device("meta"):  # no random init: shapes only, memory comes with to_empty
        model = (model_class or DecoderForCausalLM)(spec, attention_backend)
    check_weights_fit(rank_tensor_infos(model, infos), Path(folder), "cpu")  # every slice passes through the CPU
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()  # moving off "meta" makes new Parameters, which unties them
    with checkpoint_slices(files) as slices:
        _load_weights(model, slices)
    return model.requires_grad_(False).eval()
# --8<-- [end:load_model]
