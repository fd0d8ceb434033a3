"""Tutorial 11: one decoder layer of the shipped model split over two ranks (tensor parallelism).

1. The rule: for ``tensor_parallel_size`` 1 to 5, what each rank of the shipped model
   (4 query heads, 2 KV heads) holds, or the one-line error that refuses the size.
2. Two processes, spawned here, join one gloo process group (``distributed/parallel_state.py``)
   on the CPU. Each reads only its slices of layer 0's weights from the safetensors file
   (``get_slice``), runs the attention block's projections and the MLP on its heads and its
   columns, and adds its partial sum to the other rank's with a real all-reduce; the
   vocabulary-split embedding and LM head use a masked lookup plus an all-reduce, and an
   all-gather of the logits. Each rank prints its shapes; rank 0 compares every result with
   the same layer computed whole in one process. (The demonstration leaves out the norms and
   the rotary embedding: they act on replicated activations or per head, and change nothing
   in the split.)
3. The engine itself: ``LLM(..., tensor_parallel_size=2)`` (two worker processes, the
   sharded layers) gives the same greedy tokens as one rank.

Run it from the repository root: ``python tutorials/11_tensor_parallel.py`` (CPU, one torch
thread per process, about ten seconds).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import queue
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from safetensors import safe_open  # noqa: E402

from tinyvllm.distributed.parallel_state import (  # noqa: E402
    destroy_distributed_environment,
    init_distributed_environment,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from tinyvllm.distributed.utils import (  # noqa: E402
    check_tensor_parallel_size,
    kv_head_range,
    shard_range,
    vocab_range,
)
from tinyvllm.models.loader import load_model_spec  # noqa: E402
from tinyvllm.stdlib_tiny import STDLIB_TINY  # noqa: E402

TP = 2  # the tensor-parallel size of part 2
TOKENS = 5  # N: the token rows of the demonstration
TOKEN_IDS = [5, 100, 3071, 3072, 6000]  # on both sides of the vocabulary's split at 3072
WEIGHTS = str(Path(STDLIB_TINY) / "model.safetensors")
TENSORS = {  # the checkpoint's names of layer 0's projections and of the (tied) embedding
    **{p: f"model.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{p: f"model.layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
    "embed_tokens": "model.embed_tokens.weight",
}
TOLERANCE = 1e-5  # relative: float32 partial sums added in another order differ in the last bits


def shape(t: torch.Tensor | list[int]) -> str:
    return "[" + ", ".join(str(d) for d in (t.shape if isinstance(t, torch.Tensor) else t)) + "]"


def part1_the_rule(spec) -> None:
    h, hkv, inter, vocab = spec.num_attention_heads, spec.num_key_value_heads, spec.intermediate_size, spec.vocab_size
    print(f"The shipped model: {h} query heads, {hkv} KV heads, head_dim {spec.head_dim}, "
          f"hidden {spec.hidden_size}, intermediate {inter}, vocabulary {vocab}\n")  # fmt: skip
    print("TP | per rank: q heads | KV heads of rank 0, 1, ...  | intermediate | vocab rows")
    print("---+-------------------+-----------------------------+--------------+-----------")
    for n in range(1, 6):
        try:
            check_tensor_parallel_size(n, h, hkv, inter)
        except ValueError as error:
            print(f"{n:2d} | refused: {error}")
            continue
        heads = " ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in (kv_head_range(hkv, n, r) for r in range(n)))
        replicated = " (replicated)" if n > hkv else ""
        print(f"{n:2d} | {h // n:17d} | {heads + replicated:27s} | {inter // n:12d} | {vocab_range(vocab, n, 0)[1]:10d}")


def _slices(f, rank: int, spec) -> dict[str, torch.Tensor]:
    """This rank's slices of layer 0 and of the embedding, read with ``get_slice``."""
    d = spec.head_dim
    q0, q1 = shard_range(spec.num_attention_heads, TP, rank)
    k0, k1 = kv_head_range(spec.num_key_value_heads, TP, rank)
    i0, i1 = shard_range(spec.intermediate_size, TP, rank)
    v0, v1 = vocab_range(spec.vocab_size, TP, rank)
    get = lambda name: f.get_slice(TENSORS[name])  # noqa: E731
    weights = {
        "q_proj": get("q_proj")[q0 * d : q1 * d],  # [H/TP*D, hidden]: rows (column split)
        "k_proj": get("k_proj")[k0 * d : k1 * d],  # [Hkv/TP*D, hidden]
        "v_proj": get("v_proj")[k0 * d : k1 * d],  # [Hkv/TP*D, hidden]
        "o_proj": get("o_proj")[:, q0 * d : q1 * d],  # [hidden, H/TP*D]: columns (row split)
        "gate_proj": get("gate_proj")[i0:i1],  # [I/TP, hidden]
        "up_proj": get("up_proj")[i0:i1],  # [I/TP, hidden]
        "down_proj": get("down_proj")[:, i0:i1],  # [hidden, I/TP]
        "embed_tokens": get("embed_tokens")[v0 : min(v1, spec.vocab_size)],  # [V/TP, hidden]
    }
    return {name: t.float() for name, t in weights.items()}  # the checkpoint's bfloat16, computed in float32


def attention(x: torch.Tensor, w: dict[str, torch.Tensor], d: int) -> torch.Tensor:
    """Causal attention over the heads whose projections ``w`` holds, then ``o_proj``."""
    n = x.shape[0]
    q = (x @ w["q_proj"].T).view(n, -1, d).transpose(0, 1)  # [H', N, D]
    k = (x @ w["k_proj"].T).view(n, -1, d).transpose(0, 1)  # [Hkv', N, D]
    v = (x @ w["v_proj"].T).view(n, -1, d).transpose(0, 1)  # [Hkv', N, D]
    group = q.shape[0] // k.shape[0]  # query heads per KV head
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # [H', N, D]
    return out.transpose(0, 1).reshape(n, -1) @ w["o_proj"].T  # [N, hidden]: a partial sum under TP


def mlp(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """SiLU(gate) * up, then ``down_proj``, over the columns ``w`` holds."""
    return (torch.nn.functional.silu(x @ w["gate_proj"].T) * (x @ w["up_proj"].T)) @ w["down_proj"].T


def rank_main(rank: int, init_method: str, results) -> None:
    """One rank of part 2: join the group, read its slices, compute, report its lines."""
    torch.set_num_threads(1)
    init_distributed_environment(TP, rank, init_method, "gloo")
    spec = load_model_spec(STDLIB_TINY)
    d = spec.head_dim
    lines: list[str] = []
    checks: list[str] = []  # rank 0's comparisons, printed after every rank's shapes
    with safe_open(WEIGHTS, "pt") as f:
        w = _slices(f, rank, spec)
        full_shapes = {name: f.get_slice(TENSORS[name]).get_shape() for name in w}  # from the header, no data
        whole = {name: f.get_tensor(TENSORS[name]).float() for name in w} if rank == 0 else {}  # the check's
    read = sum(t.numel() for t in w.values())
    total = sum(math.prod(s) for s in full_shapes.values())
    q0, q1 = shard_range(spec.num_attention_heads, TP, rank)
    k0, k1 = kv_head_range(spec.num_key_value_heads, TP, rank)
    i0, i1 = shard_range(spec.intermediate_size, TP, rank)
    v0, v1 = vocab_range(spec.vocab_size, TP, rank)
    lines.append(f"rank {rank}: query heads {q0}-{q1 - 1}, KV head {k0}, intermediate columns {i0}-{i1 - 1}, "
                 f"vocabulary rows {v0}-{v1 - 1}")  # fmt: skip
    lines.append(f"  reads {read:,} of these tensors' {total:,} values ({read / total:.2f})")
    for name, t in w.items():
        lines.append(f"  {name:12s} {shape(t):12s} of {shape(full_shapes[name])}")

    generator = torch.Generator().manual_seed(0)  # the same input on every rank: x is replicated
    x = torch.randn(TOKENS, spec.hidden_size, generator=generator)  # [N, hidden]
    partial = attention(x, w, d)  # [N, hidden]
    lines.append(f"  attention: q [{TOKENS}, {q1 - q0}, {d}], k and v [{TOKENS}, {k1 - k0}, {d}] -> "
                 f"o_proj's partial sum {shape(partial)}")  # fmt: skip
    attn = tensor_model_parallel_all_reduce(partial)  # the block's one all-reduce: the sum over the ranks
    partial = mlp(attn, w)
    lines.append(f"  MLP: gate and up [{TOKENS}, {i1 - i0}] -> down_proj's partial sum {shape(partial)}")
    out = tensor_model_parallel_all_reduce(partial)  # the MLP's one all-reduce

    ids = torch.tensor(TOKEN_IDS)  # [N]
    outside = (ids < v0) | (ids >= v1)  # ids another rank holds
    rows = w["embed_tokens"][(ids - v0).masked_fill(outside, 0)].masked_fill(outside[:, None], 0.0)  # [N, hidden]
    lines.append(f"  embedding: {int((~outside).sum())} of the ids {TOKEN_IDS} in this rank's rows")
    embedded = tensor_model_parallel_all_reduce(rows)
    logits = out @ w["embed_tokens"].T  # [N, V/TP]: tied embeddings, the LM head is the embedding
    gathered = tensor_model_parallel_all_gather(logits, dim=-1)[:, : spec.vocab_size]  # [N, V]
    lines.append(f"  LM head: logits {shape(logits)} -> all-gather {shape(gathered)}")
    greedy = gathered.argmax(-1)
    every_rank = tensor_model_parallel_all_gather(greedy[None], dim=0)  # [TP, N]: each rank's ids

    if rank == 0:  # the same layer computed whole, in this one process
        dense_attn = attention(x, whole, d)
        dense_out = mlp(dense_attn, whole)
        dense_logits = dense_out @ whole["embed_tokens"].T
        check = lambda a, b: "yes" if (a - b).abs().max() < TOLERANCE * b.abs().max() else "NO"  # noqa: E731
        checks.append(f"rank 0 against the layer computed whole in one process "
                      f"(largest difference < {TOLERANCE:g} of the largest value):")  # fmt: skip
        checks.append(f"  attention block after the all-reduce:  {check(attn, dense_attn)}")
        checks.append(f"  MLP after the all-reduce:              {check(out, dense_out)}")
        checks.append(f"  embedding after the all-reduce:        "
                     f"{'yes, exactly' if torch.equal(embedded, whole['embed_tokens'][ids]) else 'NO'}")  # fmt: skip
        checks.append(f"  logits after the all-gather:           {check(gathered, dense_logits)}")
        same = bool((every_rank == dense_logits.argmax(-1)).all())
        checks.append(f"  greedy ids the same on both ranks and as the whole layer's: {'yes' if same else 'NO'}")
    results.put((rank, lines, checks))
    destroy_distributed_environment()


def part2_two_ranks() -> None:
    context = mp.get_context("spawn")  # a fresh interpreter per rank, as the engine's workers
    results = context.Queue()
    with tempfile.TemporaryDirectory() as folder:  # the group's rendezvous: a file both ranks open
        init_method = f"file://{folder}/rendezvous"
        processes = [context.Process(target=rank_main, args=(r, init_method, results)) for r in range(TP)]
        for p in processes:
            p.start()
        reports: dict[int, tuple[list[str], list[str]]] = {}
        while len(reports) < TP:  # never wait on a rank that died: its partner would wait forever too
            try:
                rank, lines, checks = results.get(timeout=1.0)
                reports[rank] = lines, checks
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in processes):
                    for p in processes:
                        p.kill()
                    raise SystemExit(f"a rank died: exit codes {[p.exitcode for p in processes]}") from None
        for p in processes:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise SystemExit(f"a rank exited with {p.exitcode}")
    print(f"\nTwo ranks, one gloo group, layer 0 of the shipped model, {TOKENS} token rows:\n")
    for rank in sorted(reports):
        print("\n".join(reports[rank][0]))
    print()
    print("\n".join(reports[0][1]))


def part3_llm() -> None:
    from tinyvllm import LLM, SamplingParams

    print()
    prompt = "import os\nimport "
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for n in (1, 2):
        llm = LLM(STDLIB_TINY, device="cpu", max_model_len=128, seed=0, tensor_parallel_size=n)
        tokens[n] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        llm.shutdown()  # the worker processes end here, not when the collector finds the engine
    print(f"LLM, greedy, prompt {prompt!r}:")
    for n in (1, 2):
        print(f"  tensor_parallel_size={n}: {list(tokens[n])}")
    print(f"  the same tokens: {'yes' if tokens[1] == tokens[2] else 'NO'}")


def main() -> None:
    torch.set_num_threads(1)
    spec = load_model_spec(STDLIB_TINY)
    part1_the_rule(spec)
    part2_two_ranks()
    part3_llm()


if __name__ == "__main__":
    main()
