"""``sample/ops/greedy.py``: the greedy draw in one kernel against the torch ops.

Under the interpreter on the CPU (``TRITON_INTERPRET=1``, the root conftest), bit for bit:
the first maximum wins ties within a block and across blocks, NaN and all ``-inf`` rows have
no token and a real id, every float dtype, strided rows, a vocabulary that is not a whole
number of blocks; the sampler's greedy batch takes the host's ids from it, three ops fewer;
the switch. The ``gpu`` twins run the kernel at Qwen3's vocabulary on a real device.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tinyvllm.config import EngineConfig, SchedulerConfig
from tinyvllm.sample.logits_processors import build_logitsprocs
from tinyvllm.sample.ops import greedy as greedy_ops
from tinyvllm.sample.ops.greedy import NO_TOKEN, greedy, greedy_torch, greedy_triton
from tinyvllm.sample.sampler import Sampler
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.input_batch import InputBatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def hard_rows(vocab: int, block: int) -> torch.Tensor:
    """[8, vocab] float32 scores with every case the kernel must get right (module header)."""
    torch.manual_seed(vocab)
    s = torch.randn(8, vocab)
    s[1] = float("-inf")  # nothing to pick: token 0, no token
    s[2, 3], s[2, vocab - 2] = float("nan"), float("nan")  # a NaN anywhere: its first index, no token
    s[3, 1], s[3, vocab - 1] = 50.0, 50.0  # a tie across blocks: the first
    s[4] = 1.0  # every score the same: index 0
    s[5, min(block + 1, vocab - 1)] = float("inf")  # +inf is a maximum like any other
    s[6, : vocab // 2] = float("-inf")  # the maximum in a later block, after -inf ones
    s[7, 5], s[7, 6] = 9.0, 9.0  # a tie inside a block
    return s


@pytest.mark.parametrize("vocab", [1, 7, 64, 300, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kernel_gives_the_torch_ops_tokens_verdicts_and_host_ids(vocab, dtype):
    s = hard_rows(max(vocab, 8), greedy_ops.BLOCK)[:, :vocab].to(dtype)
    want, got = greedy_torch(s), greedy_triton(s)
    for name, a, b in zip(("tokens", "no_token", "host_ids"), want, got):
        assert a.dtype == b.dtype and torch.equal(a, b), (name, a.tolist(), b.tolist())
    tokens, no_token, host_ids = got
    assert ((tokens >= 0) & (tokens < vocab)).all()  # a real id, even where no token: the next step may read it
    assert torch.equal(host_ids, torch.where(no_token, NO_TOKEN, tokens))


def test_rows_of_a_wider_buffer_and_an_empty_batch():
    wide = hard_rows(600, greedy_ops.BLOCK)
    view = wide[:, :300]  # [8, 300], rows 600 apart
    assert all(torch.equal(a, b) for a, b in zip(greedy_torch(view), greedy_triton(view)))
    empty = greedy_triton(torch.zeros(0, 50))
    assert [t.shape for t in empty] == [(0,), (0,), (0,)]
    with pytest.raises(ValueError, match=r"scores \(8,\) torch.float32"):
        greedy_triton(torch.zeros(8))
    with pytest.raises(ValueError, match="torch.int64"):
        greedy_triton(torch.zeros(2, 8, dtype=torch.int64))


def test_blocks_smaller_than_the_vocabulary_keep_the_first_maximum(monkeypatch):
    """NOTE 1 across many blocks: with 16 scores a block, 5000 scores are 313 blocks."""
    monkeypatch.setattr(greedy_ops, "BLOCK", 16)
    s = hard_rows(5000, 16)
    assert all(torch.equal(a, b) for a, b in zip(greedy_torch(s), greedy_triton(s)))


def _greedy_batch(n: int) -> InputBatch:
    batch = InputBatch(8, torch.device("cpu"), build_logitsprocs(EngineConfig(scheduler_config=SchedulerConfig(max_num_seqs=8)),
                       torch.device("cpu"), False, False), None, vocab_size=50)  # fmt: skip
    for i in range(n):
        batch.add_request(f"r{i}", SamplingParams(temperature=0), None, [])
    batch.refresh()
    return batch


def test_a_greedy_batch_makes_its_host_ids_in_the_kernel_with_three_ops_fewer():
    """sampler.py NOTE 8: the same output both ways, the host's ids made by the sampler; the
    torch ops' max, gt, bitwise_not and where are gone, one launch in their place."""
    logits = hard_rows(50, greedy_ops.BLOCK)[:4]
    md = _greedy_batch(4).make_sampling_metadata()
    outs, ops = {}, {}
    for impl in ("torch", "triton"):
        counted: Counter = Counter()

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counted[func.overloadpacket.__name__] += 1
                return func(*args, **(kwargs or {}))

        with Count():
            outs[impl] = Sampler(greedy_impl=impl)(logits, md)
        ops[impl] = counted
    for name in ("sampled_token_ids", "no_token", "host_ids"):
        assert torch.equal(getattr(outs["torch"], name), getattr(outs["triton"], name)), name
    assert outs["triton"].host_ids.tolist()[1:] == [NO_TOKEN, NO_TOKEN, 1]  # all -inf, a NaN, a tie: the first
    assert {"max", "gt", "bitwise_not", "where"} <= set(ops["torch"]) and not {"max", "gt", "bitwise_not", "where"} & set(ops["triton"])


def test_the_switch_is_read_when_the_sampler_is_built(monkeypatch):
    monkeypatch.delenv(greedy_ops.IMPL_ENV, raising=False)
    assert Sampler().greedy_impl == "auto"
    monkeypatch.setenv(greedy_ops.IMPL_ENV, "triton")
    assert Sampler().greedy_impl == "triton"
    monkeypatch.setenv(greedy_ops.IMPL_ENV, "fused")
    with pytest.raises(ValueError, match="TINYVLLM_GREEDY='fused'"):
        Sampler()
    s = hard_rows(50, greedy_ops.BLOCK)
    assert all(torch.equal(a, b) for a, b in zip(greedy(s, "auto"), greedy_torch(s)))  # auto on the CPU: the torch ops


# ---- GPU ----

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [1, 32, 129])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_the_kernel_gives_the_torch_ops_bits_at_qwen3s_vocabulary(rows, dtype):
    """On a real device, at Qwen3's 151,936 scores a row: the same three tensors, with the
    hard rows among random ones, and ``auto`` takes the kernel."""
    torch.manual_seed(rows)
    s = (4 * torch.randn(rows, 151936, device="cuda")).to(dtype)
    s[: min(rows, 8)] = hard_rows(151936, greedy_ops.BLOCK)[: min(rows, 8)].to(device="cuda", dtype=dtype)
    (tokens, no_token, host_ids), vocab = greedy_torch(s), s.shape[1]
    for got_tokens, got_no_token, got_host_ids in (greedy_triton(s), greedy(s, "auto")):
        assert torch.equal(got_no_token, no_token) and torch.equal(got_host_ids, host_ids)
        # which NaN torch's CUDA max points at is no contract: the kernel's is a real id, the first NaN
        assert torch.equal(got_tokens[~no_token], tokens[~no_token]) and ((got_tokens >= 0) & (got_tokens < vocab)).all()


@pytest.mark.gpu
@gpu
def test_gpu_an_engine_gives_the_same_greedy_tokens_with_the_kernel_and_without(tiny_model_dirs, monkeypatch):
    """The tiny Qwen3 in bf16 under real graphs with async scheduling: ``TINYVLLM_GREEDY=torch``
    and the default (the kernel) give the same tokens and logprobs."""
    from engine_compare import assert_same_tokens_and_logprobs

    from tinyvllm import LLM

    prompts = [{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": [(5 * i) % 90 + 1 for i in range(70)]}]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
    runs = {}
    for impl in ("torch", "auto"):
        monkeypatch.setenv(greedy_ops.IMPL_ENV, impl)
        llm = LLM(str(tiny_model_dirs["qwen3"]), device="cuda", dtype="bfloat16", max_model_len=256, attention_backend="triton",
                  async_scheduling=True)  # fmt: skip
        runs[impl] = llm.generate(prompts, params, use_tqdm=False)
        del llm
    assert_same_tokens_and_logprobs(runs["torch"], runs["auto"])
