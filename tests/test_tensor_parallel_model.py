"""The sharded model (``models/parallel_layers.py``, ``models/llama.py`` NOTE 10): each parallel
layer against its dense counterpart, the whole Qwen3 / Qwen2 / Llama decoder at N = 2 against
N = 1, and each rank reading only its slice of the checkpoint.

The two-rank checks run in one spawn of two gloo processes (``run_on_ranks``, start-up costs a
few seconds), shared by the tests through a module fixture; the rest are pure, one process."""

from __future__ import annotations

import dataclasses
import multiprocessing
import pickle
import queue
import socket
import traceback

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tinyvllm.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tinyvllm.distributed.parallel_state import destroy_distributed_environment, init_distributed_environment
from tinyvllm.distributed.utils import kv_heads_per_rank
from tinyvllm.models import llama
from tinyvllm.models.llama import kv_cache_shape, load_model, rank_tensor_infos
from tinyvllm.models.loader import find_weight_files, load_model_spec, read_tensor_infos
from tinyvllm.models.model_files import weights_nbytes
from tinyvllm.models.parallel_layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tinyvllm.models.tiny import build_tiny_model
from tinyvllm.worker.attention_metadata import build_attention_metadata
from tinyvllm.worker.startup_report import format_bytes
from tinyvllm.worker.worker import Worker

WORLD = 2
FAMILIES = ("qwen3", "qwen2", "llama")
TOKENS = [5, 77, 3, 201, 9, 444, 18]  # one prompt of 7 tokens, a prefill


# -- running a function on two ranks ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank: int, world_size: int, init_method: str, join: bool, args: tuple, results) -> None:
    torch.set_num_threads(1)
    try:
        if join:
            init_distributed_environment(world_size, rank, init_method, "gloo")
            value = fn(rank, *args)
        else:  # fn joins the group itself (a Worker's init_device)
            value = fn(rank, init_method, *args)
        # Plain pickle copies tensors into the bytes; the queue's own pickler would pass them as
        # shared memory, which is gone if this process exits before the parent reads it.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, "error", traceback.format_exc()))
    finally:
        destroy_distributed_environment()


def run_on_ranks(fn, args: tuple = (), world_size: int = WORLD, timeout: float = 120.0, join: bool = True) -> list:
    """``fn(rank, *args)`` in ``world_size`` spawned processes joined into one gloo group (or,
    ``join=False``, ``fn(rank, init_method, *args)``, which joins it); the results by rank. A
    rank that fails or hangs fails the caller within ``timeout`` seconds."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, init_method, join, args, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        out = {}
        for _ in range(world_size):
            rank, status, value = results.get(timeout=timeout)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
        return [out[r] for r in range(world_size)]
    except queue.Empty:
        raise AssertionError(f"the ranks did not finish within {timeout} s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join()


# -- what each rank computes (in its own process) -----------------------------------------------


def _dense_weights(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _layers_on_rank(rank: int) -> dict:
    """Each parallel layer of this rank on the same inputs as the dense layer, float32."""
    hidden, head, heads, kv_heads, inter, vocab = 8, 2, 4, 2, 6, 11  # vocab 11: rank 1 has a padding row
    x = _dense_weights(0, 5, hidden)  # [N, hidden], the same on both ranks
    out = {}
    w_q, w_k, w_v = (_dense_weights(seed, rows, hidden) for seed, rows in ((1, heads * head), (2, kv_heads * head), (3, kv_heads * head)))
    qkv = QKVParallelLinear(hidden, head, heads, kv_heads, bias=False)
    for part, w in zip("qkv", (w_q, w_k, w_v)):
        qkv.weight_loader(qkv.weight, w, part)
    out["qkv"] = qkv(x)  # [N, (H/2 + 2 Hkv/2) * D]
    w_gate, w_up = _dense_weights(4, inter, hidden), _dense_weights(5, inter, hidden)
    gate_up = MergedColumnParallelLinear(hidden, [inter, inter])
    gate_up.weight_loader(gate_up.weight, w_gate, 0)
    gate_up.weight_loader(gate_up.weight, w_up, 1)
    out["gate_up"] = gate_up(x)  # [N, 2 * I/2]
    w_col = _dense_weights(6, inter, hidden)
    col = ColumnParallelLinear(hidden, inter)
    col.weight_loader(col.weight, w_col)
    w_down = _dense_weights(7, hidden, inter)
    down = RowParallelLinear(inter, hidden)
    down.weight_loader(down.weight, w_down)
    out["column_then_row"] = down(col(x))  # [N, hidden], all-reduced
    emb_w = _dense_weights(8, vocab, hidden)
    emb = VocabParallelEmbedding(vocab, hidden)
    emb.weight_loader(emb.weight, emb_w)
    out["embedding"] = emb(torch.tensor([0, 10, 5, 6, 3, 10]))  # ids of both ranks, the last row
    head_layer = ParallelLMHead(vocab, hidden)
    head_layer.weight_loader(head_layer.weight, emb_w)
    out["lm_head"] = head_layer.gather(head_layer(x))  # [N, V]
    out["embedding_padding_row"] = emb.weight[-1].clone() if rank == 1 else None
    return out


class _CountingSlice:
    """Wraps a safetensors slice and counts the elements each read materialises."""

    def __init__(self, inner, name: str, counts: dict) -> None:
        self.inner, self.name, self.counts = inner, name, counts

    def __getattr__(self, name):  # get_shape, get_dtype: headers, nothing read
        return getattr(self.inner, name)

    def __getitem__(self, index):
        piece = self.inner[index]
        self.counts[self.name] = self.counts.get(self.name, 0) + piece.numel()
        return piece


def _count_reads(counts: dict):
    """Replace ``safetensors.safe_open`` so that every tensor or slice read is counted."""
    import safetensors

    real = safetensors.safe_open

    class Handle:
        def __init__(self, *args, **kwargs) -> None:
            self.inner = real(*args, **kwargs)

        def __enter__(self):
            self.handle = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_slice(self, name):
            return _CountingSlice(self.handle.get_slice(name), name, counts)

        def get_tensor(self, name):
            tensor = self.handle.get_tensor(name)
            counts[name] = counts.get(name, 0) + tensor.numel()
            return tensor

    safetensors.safe_open = Handle


def prefill_logits(model, num_kv_heads: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """One prefill of ``TOKENS`` through a paged cache of ``num_kv_heads`` heads: the logits of
    every row [T, V] (the LM head's matmul path) and of the last row alone [1, V] (NOTE 6's copy
    on the CPU), on the CPU."""
    block_size, blocks = 4, [2, 0]
    shape = (2, 3, block_size, num_kv_heads, model.spec.head_dim)
    caches = [torch.full(shape, float("nan"), device=device) for _ in range(model.spec.num_hidden_layers)]
    meta = build_attention_metadata([0], [len(TOKENS)], [blocks], block_size, device=device)
    with torch.inference_mode():
        hidden = model(torch.tensor(TOKENS, device=device), meta.positions, caches, meta)  # [T, hidden]
        return model.compute_logits(hidden).cpu(), model.compute_logits(hidden[-1:]).cpu()


def worker_config(folder: str, tensor_parallel_size: int) -> EngineConfig:
    return EngineConfig(
        SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64),
        CacheConfig(block_size=4),
        model_config=ModelConfig(model=folder, spec=load_model_spec(folder), dtype="float32", attention_backend="torch"),
        device_config=DeviceConfig(device="cpu", num_gpu_blocks_override=10, torch_threads=1),
        parallel_config=ParallelConfig(tensor_parallel_size, "mp" if tensor_parallel_size > 1 else "uni"),
    )


def _worker_start_up(rank: int, init_method: str, folder: str) -> dict:
    """A real ``Worker`` of rank ``rank``: it joins the group, loads its slices, sizes and
    allocates its KV cache and reports."""
    config = worker_config(folder, WORLD)
    worker = Worker(config, rank=rank, distributed_init_method=init_method)
    worker.init_device()
    worker.load_model()
    available = worker.determine_available_memory()
    sized = dataclasses.replace(config, cache_config=dataclasses.replace(config.cache_config, num_gpu_blocks=10))
    worker.initialize_from_config(sized)
    worker.compile_or_warm_up_model()
    return {
        "per_block": worker.kv_bytes_per_block(), "available": available,
        "cache_shapes": [tuple(t.shape) for t in worker.model_runner.kv_caches], "report": worker.startup_report,
    }


def _models_on_rank(rank: int, init_method: str, folders: dict) -> dict:
    out = {"worker": _worker_start_up(rank, init_method, folders["qwen3"])}  # joins the group
    out["layers"] = _layers_on_rank(rank)
    counts: dict = {}
    _count_reads(counts)
    for name, folder in folders.items():
        counts.clear()
        model = load_model(folder)
        read = dict(counts)
        attn = model.layers[0].self_attn
        spec = model.spec
        out[name] = {
            "logits": prefill_logits(model, kv_heads_per_rank(spec.num_key_value_heads, WORLD)),
            "heads": (attn.num_heads, attn.num_kv_heads, model.layers[0].mlp.intermediate_size),
            "read": read,
            "cache_shape": kv_cache_shape(spec, 3, 4, WORLD),
        }
    return out


# -- the shared two-rank run --------------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tiny_model_dirs, tmp_path_factory):
    """The three tiny families, and a Llama with one KV head (replicated on both ranks)."""
    mqa = build_tiny_model(tmp_path_factory.mktemp("mqa") / "llama_mqa", "llama", num_key_value_heads=1)
    return {**{f: str(tiny_model_dirs[f]) for f in FAMILIES}, "llama_mqa": str(mqa)}


@pytest.fixture(scope="module")
def two_ranks(folders):
    return run_on_ranks(_models_on_rank, (folders,), join=False)


def test_each_ranks_worker_sizes_and_allocates_a_cache_of_its_kv_heads_and_reports(two_ranks, folders):
    one = Worker(worker_config(folders["qwen3"], 1))
    one.load_model()  # one rank: no group to join (init_device would set this process's threads)
    spec = one.model_config.spec  # 2 KV heads: one per rank
    assert one.kv_bytes_per_block() == 2 * spec.num_hidden_layers * 4 * 2 * spec.head_dim * 4
    whole = sum(p.numel() * p.element_size() for p in one.model.parameters())
    norms = sum(p.numel() * 4 for n, p in one.model.named_parameters() if n.endswith("norm.weight"))
    for rank, out in enumerate(r["worker"] for r in two_ranks):
        assert out["per_block"] == one.kv_bytes_per_block() // 2 and out["available"] == 10 * out["per_block"]
        assert out["cache_shapes"] == [(2, 10, 4, 1, spec.head_dim)] * spec.num_hidden_layers
        report = out["report"]
        assert (report.tensor_parallel_size, report.rank, report.num_kv_heads, report.total_num_kv_heads) == (2, rank, 1, 2)
        assert report.weight_bytes == (whole - norms) // 2 + norms  # the norms whole, the rest halved
        assert report.kv_cache_bytes == 10 * out["per_block"]
        assert report.lines()[-1] == f"rank {rank} of 2: weights {format_bytes(report.weight_bytes)}, KV heads 1 of 2"


def test_each_parallel_layer_at_two_ranks_equals_its_dense_layer(two_ranks):
    hidden, head, heads, kv_heads, inter, vocab = 8, 2, 4, 2, 6, 11
    x = _dense_weights(0, 5, hidden)
    q = x @ _dense_weights(1, heads * head, hidden).T  # [N, H * D]
    k = x @ _dense_weights(2, kv_heads * head, hidden).T
    v = x @ _dense_weights(3, kv_heads * head, hidden).T
    gate, up = x @ _dense_weights(4, inter, hidden).T, x @ _dense_weights(5, inter, hidden).T
    column_then_row = (x @ _dense_weights(6, inter, hidden).T) @ _dense_weights(7, hidden, inter).T
    emb_w = _dense_weights(8, vocab, hidden)
    close = dict(rtol=1e-6, atol=1e-6)
    for rank, out in enumerate(r["layers"] for r in two_ranks):
        qh, kvh = slice(rank * 2 * head, (rank + 1) * 2 * head), slice(rank * head, (rank + 1) * head)
        torch.testing.assert_close(out["qkv"], torch.cat([q[:, qh], k[:, kvh], v[:, kvh]], dim=1), **close)
        ih = slice(rank * inter // 2, (rank + 1) * inter // 2)
        torch.testing.assert_close(out["gate_up"], torch.cat([gate[:, ih], up[:, ih]], dim=1), **close)
        torch.testing.assert_close(out["column_then_row"], column_then_row, **close)  # all-reduced
        assert torch.equal(out["embedding"], emb_w[[0, 10, 5, 6, 3, 10]])  # one rank's row + zeros: exact
        torch.testing.assert_close(out["lm_head"], x @ emb_w.T, **close)  # gathered, padding column dropped
    assert torch.equal(two_ranks[1]["layers"]["embedding_padding_row"], torch.zeros(hidden))


@pytest.mark.parametrize("family", [*FAMILIES, "llama_mqa"])
def test_the_model_at_two_ranks_gives_one_ranks_logits(two_ranks, folders, family):
    model = load_model(folders[family])  # N = 1 in this process
    spec = model.spec
    full, last = prefill_logits(model, spec.num_key_value_heads)
    for rank, out in enumerate(r[family] for r in two_ranks):
        heads = (spec.num_attention_heads // 2, kv_heads_per_rank(spec.num_key_value_heads, 2), spec.intermediate_size // 2)
        assert out["heads"] == heads
        assert out["cache_shape"] == (2, 3, 4, heads[1], spec.head_dim)
        full2, last2 = out["logits"]
        assert full2.shape == (len(TOKENS), spec.vocab_size) and full2.dtype == torch.float32
        torch.testing.assert_close(full2, full, atol=1e-5, rtol=0)
        torch.testing.assert_close(last2, last, atol=1e-5, rtol=0)
        assert torch.equal(full2.argmax(-1), full.argmax(-1)) and torch.equal(last2.argmax(-1), last.argmax(-1))
    assert torch.equal(two_ranks[0][family]["logits"][0], two_ranks[1][family]["logits"][0])  # every rank alike


SPLIT = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight",
         "down_proj.weight", "embed_tokens.weight", "lm_head.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias")  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_reads_only_its_half_of_each_split_tensor(two_ranks, folders, family):
    infos = read_tensor_infos(find_weight_files(folders[family]))
    numel = {name: torch.Size(info.shape).numel() for name, info in infos.items()}
    reads = [r[family]["read"] for r in two_ranks]
    assert set(reads[0]) == set(reads[1]) == set(numel)  # every tensor read, by slices or whole
    split = [name for name in numel if name.endswith(SPLIT)]
    spec = llama.load_model_spec(folders[family])  # the vocabulary (twice untied), 7 projections (+3 biases) a layer
    assert len(split) == 1 + (not spec.tie_word_embeddings) + spec.num_hidden_layers * (7 + 3 * spec.qkv_bias)
    for name in numel:
        if name in split:
            assert reads[0][name] == reads[1][name] == numel[name] // 2, name
        else:  # norms: replicated, read whole
            assert reads[0][name] == reads[1][name] == numel[name], name


def test_kv_heads_replicated_on_two_ranks_are_read_by_both(two_ranks, folders):
    infos = read_tensor_infos(find_weight_files(folders["llama_mqa"]))
    k = "model.layers.0.self_attn.k_proj.weight"
    assert infos[k].shape[0] == 16  # one KV head of 16
    assert [r["llama_mqa"]["read"][k] for r in two_ranks] == [16 * 64, 16 * 64]


# -- one process ---------------------------------------------------------------------------------


def test_at_one_rank_each_layer_computes_exactly_what_the_dense_torch_layer_does():
    x = _dense_weights(0, 5, 8)
    w, b = _dense_weights(1, 12, 8), _dense_weights(2, 12)
    dense = nn.Linear(8, 12)
    dense.weight.data, dense.bias.data = w, b
    col = ColumnParallelLinear(8, 12, bias=True)
    col.weight_loader(col.weight, w)
    col.weight_loader(col.bias, b)
    assert torch.equal(col(x), dense(x))
    row = RowParallelLinear(12, 8)
    row.weight_loader(row.weight, _dense_weights(3, 8, 12))
    assert torch.equal(row(dense(x)), F.linear(dense(x), _dense_weights(3, 8, 12)))
    qkv = QKVParallelLinear(8, 2, 4, 2, bias=True)
    for part, rows, seed in (("q", 8, 4), ("k", 4, 5), ("v", 4, 6)):
        qkv.weight_loader(qkv.weight, _dense_weights(seed, rows, 8), part)
        qkv.weight_loader(qkv.bias, _dense_weights(seed + 10, rows), part)
    stacked = torch.cat([_dense_weights(s, r, 8) for r, s in ((8, 4), (4, 5), (4, 6))])
    assert torch.equal(qkv(x), F.linear(x, stacked, torch.cat([_dense_weights(s, r) for r, s in ((8, 14), (4, 15), (4, 16))])))
    table = _dense_weights(7, 11, 8)
    emb, head = VocabParallelEmbedding(11, 8), ParallelLMHead(11, 8)
    emb.weight_loader(emb.weight, table)
    head.weight_loader(head.weight, table)
    ids = torch.tensor([3, 0, 10])
    assert torch.equal(emb(ids), nn.Embedding(11, 8, _weight=table)(ids))
    assert torch.equal(head.gather(head(x)), F.linear(x, table))


@pytest.mark.parametrize("rank", range(4))
def test_four_ranks_over_two_kv_heads_replicate_each_head_on_two_ranks(rank):
    """8 query heads, 2 KV heads, N = 4: rank r holds q heads 2r, 2r+1 and KV head r // 2."""
    head = 3
    qkv = QKVParallelLinear(4, head, 8, 2, tp_size=4, tp_rank=rank)
    assert (qkv.num_heads, qkv.num_kv_heads) == (2, 1)
    label = lambda heads: torch.arange(heads).repeat_interleave(head)[:, None].float().expand(-1, 4)  # row = head id
    for part, heads, offset in (("q", 8, 0), ("k", 2, 100), ("v", 2, 200)):
        qkv.weight_loader(qkv.weight, label(heads) + offset, part)
    held = qkv.weight[::head, 0].tolist()  # one row per head: q heads, then the k head, then the v head
    assert held == [2 * rank, 2 * rank + 1, 100 + rank // 2, 200 + rank // 2]


def test_rank_tensor_infos_counts_one_ranks_bytes(folders, monkeypatch):
    """The memory check before loading counts the slices this rank will read (built on meta)."""
    import tinyvllm.models.parallel_layers as layers

    infos = read_tensor_infos(find_weight_files(folders["llama"]))
    spec = llama.load_model_spec(folders["llama"])
    with torch.device("meta"):
        one = llama.DecoderForCausalLM(spec)
    monkeypatch.setattr(layers, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(layers, "get_tensor_model_parallel_rank", lambda: 1)
    with torch.device("meta"):
        half = llama.DecoderForCausalLM(spec)
    whole_bytes = weights_nbytes(infos.values())
    assert weights_nbytes(rank_tensor_infos(one, infos)) == whole_bytes
    norms = sum(weights_nbytes([i]) for n, i in infos.items() if n.endswith("norm.weight"))
    assert weights_nbytes(rank_tensor_infos(half, infos)) == (whole_bytes - norms) // 2 + norms


def test_a_size_the_heads_do_not_split_over_is_refused_before_anything_is_read(folders, monkeypatch):
    import safetensors

    def no_reading(*args, **kwargs):
        raise AssertionError("a safetensors file was opened")

    monkeypatch.setattr(llama, "get_tensor_model_parallel_world_size", lambda: 3)
    monkeypatch.setattr(safetensors, "safe_open", no_reading)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size 3 does not divide the model's 4 attention heads$"):
        load_model(folders["qwen3"])


def _cuda_logits_on_rank(rank: int, folders: dict) -> dict:
    out = {}
    for family in FAMILIES:
        model = load_model(folders[family], device="cuda", attention_backend="torch")
        out[family] = prefill_logits(model, kv_heads_per_rank(model.spec.num_key_value_heads, WORLD), "cuda")
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_ranks_sharing_one_gpu_over_gloo_give_one_ranks_logits(folders):
    """NCCL wants a device per rank; gloo lets two ranks share the one GPU (all-gather via the host)."""
    ranks = run_on_ranks(_cuda_logits_on_rank, (folders,))
    for family in FAMILIES:
        model = load_model(folders[family], device="cuda", attention_backend="torch")
        full, last = prefill_logits(model, model.spec.num_key_value_heads, "cuda")
        for out in ranks:
            torch.testing.assert_close(out[family][0], full, atol=1e-4, rtol=0)
            torch.testing.assert_close(out[family][1], last, atol=1e-4, rtol=0)
            assert torch.equal(out[family][0].argmax(-1), full.argmax(-1))
