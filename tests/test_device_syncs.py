"""Device synchronisations (tinyvllm/device_syncs.py): the counter names every call that
would make the host wait for the GPU, and one engine step waits once, for its sampled
tokens, whatever its requests ask (sampling, penalties, logprobs, allowed and bad words,
speculative decoding). On a GPU the twin at the bottom checks the count against what
``torch.cuda.set_sync_debug_mode`` reports."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.config import CUDAGraphMode
from tinyvllm.device_syncs import DeviceSyncCounter, Sync, call_site, fill_at, pin_memory_for, upload
from tinyvllm.sample.logits_processors import LogitsProcessor

DEV = torch.device("cpu")
HERE = os.path.basename(__file__)


def kinds(syncs: list[Sync]) -> list[tuple[str, str]]:
    return [(s.kind, s.op) for s in syncs]


# -- the counter on single calls -----------------------------------------------------------


def test_host_tensors_never_sync():
    counter = DeviceSyncCounter()
    counter.counting = True
    with counter:
        h = torch.arange(6)  # made without a device: host
        s = torch.tensor([3, 1], device="cpu")  # the string "cpu": host (NOTE 1)
        assert h.tolist() == [0, 1, 2, 3, 4, 5] and int(h.sum()) == 15
        assert h[h > 2].tolist() == [3, 4, 5] and h[[0, 5]].tolist() == [0, 5]
        assert s.cpu().tolist() == [3, 1] and bool(s.any())
    assert counter.take() == []
    assert not counter.is_device(h) and not counter.is_device(s)


def test_reads_of_device_values():
    counter = DeviceSyncCounter()
    counter.counting = True
    with counter:
        x = torch.arange(6, device=DEV)  # made for a torch.device: on the device
        got = (x.tolist(), x.sum().item(), bool(x.any()), int(x[2]), x.cpu().tolist(), x.to("cpu").tolist())
        assert got == ([0, 1, 2, 3, 4, 5], 15, True, 2, [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5])
        assert torch.equal(x, x)
    syncs = counter.take()
    assert kinds(syncs) == [
        ("read", "Tensor.tolist"), ("read", "Tensor.item"), ("read", "Tensor.__bool__"), ("read", "Tensor.__int__"),
        ("read", "Tensor.cpu"), ("read", "Tensor.to"), ("read", "torch.equal"),
    ]  # fmt: skip
    # The .tolist() of a tensor already on the host is free: .cpu() was the read.
    assert {(s.file, s.function) for s in syncs} == {(f"tests/{HERE}", "test_reads_of_device_values")}


def test_data_dependent_shapes():
    counter = DeviceSyncCounter()
    counter.counting = True
    with counter:
        x = torch.arange(6, device=DEV)
        repeats = upload([1, 2, 0, 0, 0, 3], torch.int64, DEV)
        a = x[x > 3]
        b = x.nonzero()
        c = x.repeat_interleave(repeats)
        d = x.repeat_interleave(repeats, output_size=6)  # the size is known: no wait
        e = torch.where(x > 4)
    assert kinds(counter.take()) == [("shape", "Tensor.__getitem__"), ("shape", "Tensor.nonzero"),
                                     ("shape", "Tensor.repeat_interleave"), ("shape", "torch.where")]  # fmt: skip
    assert a.tolist() == [4, 5] and b.view(-1).tolist() == [1, 2, 3, 4, 5]
    assert c.tolist() == d.tolist() == [0, 1, 1, 5, 5, 5] and e[0].tolist() == [5]


def test_blocking_copies_up_and_down():
    counter = DeviceSyncCounter()
    counter.counting = True
    with counter:
        x = torch.zeros(3, dtype=torch.int64, device=DEV)
        h = torch.tensor([7, 8, 9])
        made = torch.tensor([1, 2], device=DEV)  # built on the host, copied up, waited for
        moved = h.to(DEV)
        x.copy_(h)
        by_list = x[[0, 2]]  # the list goes up as a host tensor first
        by_host = x[h - 7]
        back = torch.empty(3, dtype=torch.int64)
        back.copy_(x)  # a device value into host memory
        assert kinds(counter.take()) == [("copy", "torch.tensor"), ("copy", "Tensor.to"), ("copy", "Tensor.copy_"),
                                         ("copy", "Tensor.__getitem__"), ("copy", "Tensor.__getitem__"),
                                         ("read", "Tensor.copy_")]  # fmt: skip
        assert counter.is_device(made) and counter.is_device(moved) and not counter.is_device(back)
        # The same moves without a wait: non_blocking from the host, indices already up.
        quiet = h.to(DEV, non_blocking=True)
        x.copy_(h, non_blocking=True)
        up = upload([0, 2], torch.int64, DEV)
        picked = x[up]
        floats = x.float()  # a dtype change stays on the device
    assert counter.take() == []
    assert counter.is_device(quiet) and counter.is_device(up) and counter.is_device(floats)
    assert by_list.tolist() == [7, 9] and by_host.tolist() == [7, 8, 9] and back.tolist() == [7, 8, 9]
    assert picked.tolist() == [7, 9] and up.dtype == torch.int64


def test_writing_a_python_number_into_one_element_or_through_indices_copies_it_up():
    """Found by the GPU twin on an H100: ``t[i] = 5`` and ``t[rows, cols] = 1.0`` make the
    number a one-element host tensor and copy it up, blocking, where a slice is filled in
    place; a host tensor written into a device one is a copy up too."""
    counter = DeviceSyncCounter()
    counter.counting = True
    with counter:
        x = torch.zeros(2, 3, device=DEV)
        at = upload([0, 1], torch.int64, DEV)
        x[1, 2] = 5.0  # one element: a blocking copy of the number
        x[at, at] = 1.0  # through indices: index_put_ takes the number up first
        x[0, 1] = torch.tensor(2.0)  # a host tensor
        x[0] = 3.0  # a row: filled on the device
        x[:, 0] = 4.0
        x[at, at] = torch.full((), 6.0, device=DEV)  # the value already up
        fill_at(x, (at, at), 7.0)
    assert kinds(counter.take()) == [("copy", "Tensor.__setitem__")] * 3
    assert x.tolist() == [[7.0, 3.0, 3.0], [4.0, 7.0, 5.0]]


def test_host_buffers_are_pinned_for_cuda_only():
    """The engine hands the processors ``is_pin_memory`` from the same rule ``upload`` uses."""
    assert pin_memory_for("cuda") and pin_memory_for(torch.device("cuda", 0))
    assert not pin_memory_for("cpu") and not pin_memory_for(torch.device("cpu"))


def test_upload_of_a_host_tensor_is_a_new_tensor():
    h = torch.tensor([0.5, 2.0])
    up = upload(h, torch.float64, DEV)
    h[0] = 9.0  # the copy does not follow the host tensor
    assert up.tolist() == [0.5, 2.0] and up.dtype == torch.float64


def test_nothing_is_counted_until_counting():
    counter = DeviceSyncCounter()
    with counter:
        x = torch.arange(3, device=DEV)
        x.tolist()
        counter.counting = True
        x.sum().item()
    assert kinds(counter.take()) == [("read", "Tensor.item")]


# -- the engine ----------------------------------------------------------------------------

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


# --8<-- [start:recorder]
def cuda_wait_recorder(sites: list[str]):
    """A ``warnings.showwarning`` that appends, for each of CUDA's "synchronizing CUDA
    operation" warnings, the line that made the call (``call_site``, as the counter places
    its own), so a wait the counter missed is named. Other warnings (the debug mode's own
    notice that it is a prototype) are dropped."""

    def show(message, *_args, **_kwargs) -> None:
        if "called a synchronizing CUDA operation" in str(message):
            site = call_site(sys._getframe(1))
            sites.append("?" if site is None else "{}:{} {}".format(*site))

    return show
# --8<-- [end:recorder]


def sites(syncs: list[Sync]) -> list[str]:
    return [f"{s.file}:{s.line} {s.function}" for s in syncs]


def tensors_in(value) -> list[torch.Tensor]:
    """Every tensor in ``value``, a tensor or a tuple or list of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for item in value for t in tensors_in(item)] if isinstance(value, (tuple, list)) else []


# --8<-- [start:counted_steps]
def counted_steps(folder, requests: list[tuple[list[int], SamplingParams]], device: torch.device = DEV,
                  cuda_waits: list[list[str]] | None = None, counter: DeviceSyncCounter | None = None, **kw):
    """Build an engine under a counter, add ``requests``, and step it to the end; the
    syncs of each step, and the outputs. With ``cuda_waits``, each step also runs under
    ``torch.cuda.set_sync_debug_mode("warn")`` and the warnings it gave are appended."""
    counter = counter or DeviceSyncCounter()
    kw = {"max_model_len": 96, "block_size": 16, "attention_backend": "triton", **kw}
    with counter:
        llm = LLM(str(folder), device=str(device), **kw)
        runner = llm.engine.model_runner
        for proposer in (llm.engine.proposer, runner.proposer):  # the runner's under async scheduling
            if proposer is not None:
                proposer.min_batch_tokens = 0  # the batched n-gram search, as on a big batch
        # One tensor on the CPU, the device's twin of a pinned buffer on a GPU (NOTE 1).
        counter.mark([runner.buffers.device])
        # What a captured graph returns lives in its pool on a GPU; made at start-up, before the marks.
        wrappers = [w for w in (runner.full_graph, *runner.model.pieces) if hasattr(w, "entries")]
        counter.mark([t for w in wrappers for e in w.entries.values() for t in tensors_in(e.output)])
        for i, (prompt, params) in enumerate(requests):
            llm.engine.add_request(f"r{i}", prompt, params)
        counter.counting = True
        steps, outputs = [], {}
        while llm.engine.has_unfinished_requests():
            caught: list[str] = []
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                if cuda_waits is not None:
                    warnings.showwarning = cuda_wait_recorder(caught)
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    for out in llm.engine.step():
                        outputs[out.request_id] = out
                finally:
                    if cuda_waits is not None:
                        torch.cuda.set_sync_debug_mode("default")
            steps.append(counter.take())
            if cuda_waits is not None:
                cuda_waits.append(caught)
    counter.check_invariants()
    return steps, outputs, llm
# --8<-- [end:counted_steps]


# --8<-- [start:waits_once]
def assert_waits_once(steps: list[list[Sync]], first: tuple[str, str], most: int) -> None:
    """Every sync of every step is a read, the first one at ``first`` (file's end, function)
    and at most ``most`` of them: the step waits for the device once, then reads what it
    already has."""
    for i, syncs in enumerate(steps):
        shown = "\n".join(map(str, syncs))
        assert syncs, f"step {i} read nothing: its tokens must come from somewhere"
        assert all(s.kind == "read" for s in syncs), f"step {i} waits for more than its tokens:\n{shown}"
        assert (syncs[0].file.split("/")[-1], syncs[0].function) == first, f"step {i} first waits at\n{shown}"
        assert len(syncs) <= most, f"step {i}:\n{shown}"
# --8<-- [end:waits_once]


def test_a_greedy_step_reads_its_tokens_once(tiny_model_dirs):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    steps, outputs, _ = counted_steps(tiny_model_dirs["qwen3"], [(PROMPT, params), (PROMPT[:5], params)])
    assert len(steps) == 6 and all(len(o.outputs[0].token_ids) == 6 for o in outputs.values())
    for syncs in steps:
        assert [(s.kind, s.op, s.file.split("/")[-1], s.function) for s in syncs] == [
            ("read", "Tensor.tolist", "sampler.py", "sampled_to_host")
        ]


ASKING_EVERYTHING = [
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=5, presence_penalty=0.5, frequency_penalty=0.2,
                   repetition_penalty=1.2, logprobs=2, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.9, min_p=0.1, min_tokens=3, logit_bias={3: 2.0}, bad_words=["the", "an item"],
                   allowed_token_ids=list(range(3, 40)), max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=4, ignore_eos=True),
    SamplingParams(temperature=0, thinking_token_budget=3, max_tokens=6, ignore_eos=True),
]  # fmt: skip
THINKING = [1, 5]  # <think> (id 1 in the tiny models) and one token: one of the budget is spent


def prompts_for(params: list[SamplingParams]) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of different lengths (the requests finish in different steps), and one that thinks."""
    return [(THINKING if p.thinking_token_budget else PROMPT[: 4 + i], p) for i, p in enumerate(params)]


@pytest.mark.parametrize("mode", [CUDAGraphMode.NONE, CUDAGraphMode.FULL_AND_PIECEWISE])
@pytest.mark.slow
def test_every_sampling_feature_waits_once_a_step(tiny_model_dirs, mode):
    """Requests join and leave the batch (different lengths), so metadata is rebuilt too."""
    steps, outputs, llm = counted_steps(
        tiny_model_dirs["qwen3"], prompts_for(ASKING_EVERYTHING), compilation_config={"cudagraph_mode": mode},
        max_num_batched_tokens=16,
    )  # fmt: skip
    assert len(outputs) == 6 and all(o.finished for o in outputs.values())
    assert set(outputs["r3"].outputs[0].token_ids) <= set(range(3, 40))
    assert outputs["r5"].outputs[0].token_ids[2] == 2  # </think> (id 2) forced after two more thinking tokens
    # the sampled ids, then at most the sample logprobs and the prompt logprobs
    assert_waits_once(steps, ("sampler.py", "sampled_to_host"), most=3)
    llm.engine.check_invariants()


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "speculative"])
def test_prompt_logprobs_are_computed_before_the_step_waits(tiny_model_dirs, monkeypatch, spec):
    """The step's one wait should find every computation already queued: the prompt
    logprobs are computed (logits over the prompt positions, log-softmax, top-k) before the
    sampled ids are read, and only brought over after it."""
    from tinyvllm.sample import logprobs as logprob_ops

    counter = DeviceSyncCounter()
    reads_before: list[int] = []  # at each log-softmax of a step: how many syncs came before it in the step
    original = logprob_ops.compute_logprobs

    def spy(logits):
        if counter.counting:
            reads_before.append(len(counter.syncs))
        return original(logits)

    monkeypatch.setattr(logprob_ops, "compute_logprobs", spy)
    params = SamplingParams(temperature=0, prompt_logprobs=2, max_tokens=3, ignore_eos=True)
    steps, outputs, _ = counted_steps(tiny_model_dirs["qwen3"], [(PROMPT, params)], speculative_config=spec,
                                      max_num_batched_tokens=4, counter=counter)  # fmt: skip
    assert len(outputs["r0"].prompt_logprobs) == len(PROMPT) and len(steps) >= 3  # three chunks of prompt
    assert reads_before and all(n == 0 for n in reads_before), reads_before


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "speculative"])
@pytest.mark.slow
def test_preemption_chunking_and_prefix_hits_wait_once_a_step(tiny_model_dirs, spec):
    """The scheduler's paths through the runner's state update: requests preempted (their
    rows leave, their block tables are replaced on return), prompts cut into chunks, prompts
    that share cached blocks, and two samples of one prompt."""
    shared = list(range(10, 26))  # one block every prompt shares: a prefix hit after the first
    prompts = [shared + list(range(30 + 32 * i, 62 + 32 * i)) for i in range(5)]  # 3 blocks; a 4th while decoding
    params = [SamplingParams(temperature=0.7, seed=i, presence_penalty=0.2 * i, logprobs=1, max_tokens=10,
                             ignore_eos=True) for i in range(3)]  # fmt: skip
    params.append(SamplingParams(temperature=0.5, min_tokens=4, stop_token_ids=[9], max_tokens=10, ignore_eos=True))
    if spec is None:
        params.append(SamplingParams(temperature=0, n=2, max_tokens=10, ignore_eos=True))
    steps, outputs, llm = counted_steps(
        tiny_model_dirs["qwen3"], list(zip(prompts, params)), speculative_config=spec,
        num_gpu_blocks_override=12, max_num_seqs=4, max_num_batched_tokens=32, enable_prefix_caching=True,
    )  # fmt: skip
    assert llm.engine.scheduler.num_preemptions > 0 and all(o.finished for o in outputs.values())
    assert llm.engine.scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
    assert_waits_once(steps, ("sampler.py", "sampled_to_host"), most=3)  # plain and speculative alike


def test_greedy_speculative_steps_read_once(tiny_model_dirs):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    thinking = SamplingParams(temperature=0, max_tokens=12, thinking_token_budget=5, ignore_eos=True)
    requests = [(PROMPT, params), (PROMPT[2:], params), (THINKING, thinking)]
    steps, outputs, llm = counted_steps(tiny_model_dirs["qwen3"], requests, speculative_config=NGRAM)
    assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
    assert outputs["r2"].outputs[0].token_ids[4] == 2  # </think> forced, on a draft row or not
    assert_waits_once(steps, ("sampler.py", "sampled_to_host"), most=1)


def test_random_speculative_steps_wait_once(tiny_model_dirs):
    requests = [
        (PROMPT, SamplingParams(temperature=0.8, seed=3, prompt_logprobs=2, max_tokens=12, ignore_eos=True)),
        (PROMPT[1:], SamplingParams(temperature=0.6, top_k=4, presence_penalty=0.3, logprobs=1, max_tokens=12,
                                    allowed_token_ids=list(range(2, 60)), bad_words=["the"], ignore_eos=True)),
        (PROMPT[2:], SamplingParams(temperature=0, min_tokens=8, stop_token_ids=[7], max_tokens=12)),
    ]  # fmt: skip
    steps, outputs, llm = counted_steps(tiny_model_dirs["qwen3"], requests, speculative_config=NGRAM)
    assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0 and len(outputs) == 3
    # every row's token (argmax or draw) with its no-token verdict, then the kept tokens' and the
    # prompt's logprobs: one wait fewer than when the drafts' verdicts came before the draws
    assert_waits_once(steps, ("sampler.py", "sampled_to_host"), most=3)


# --8<-- [start:careless]
class CarelessBan(LogitsProcessor):
    """Bans token 3, but first asks the device whether any row would pick it: that
    ``bool()`` makes every step wait for the forward before sampling is even queued."""

    def __init__(self, config, device, is_pin_memory):
        self.device = device

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        if bool((logits.argmax(dim=-1) == 3).any()):  # the careless line: a read
            logits[:, 3] = float("-inf")  # banning it in every row, unasked, would need no read
        return logits


def test_a_custom_processor_that_reads_the_device_is_named(tiny_model_dirs):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    steps, outputs, _ = counted_steps(tiny_model_dirs["qwen3"], [(PROMPT, params)], logits_processors=[CarelessBan])
    for syncs in steps:  # the processor's read comes first, before the sampled ids'
        first = syncs[0]
        assert (first.kind, first.op, first.file, first.function) == ("read", "Tensor.__bool__", f"tests/{HERE}", "apply")
        assert [(s.file.split("/")[-1], s.function) for s in syncs[1:]] == [("sampler.py", "sampled_to_host")]
    assert len(steps) == 4 and 3 not in outputs["r0"].outputs[0].token_ids
# --8<-- [end:careless]


def test_a_cuda_warning_is_placed_at_the_line_that_made_it():
    """The GPU twin's recorder names the caller's line, as the counter does, and drops the
    debug mode's notice about itself."""
    placed: list[str] = []
    counter = DeviceSyncCounter()
    with warnings.catch_warnings(record=True), counter:
        warnings.simplefilter("always")
        warnings.showwarning = cuda_wait_recorder(placed)
        warnings.warn("Synchronization debug mode is a prototype feature")
        line = sys._getframe().f_lineno + 1
        warnings.warn("called a synchronizing CUDA operation")
    assert placed == [f"tests/{HERE}:{line} test_a_cuda_warning_is_placed_at_the_line_that_made_it"]


# -- the GPU twin --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", [None, NGRAM])
def test_gpu_counter_matches_cuda_sync_debug_mode(tiny_model_dirs, spec):
    """On a GPU the waits CUDA itself reports, step by step, are the ones the counter names."""
    requests = prompts_for(ASKING_EVERYTHING)
    if spec is not None:  # min_p and logit_bias are refused under speculation
        requests = [(p, params) for p, params in requests if params.min_p == 0]
    cuda_waits: list[list[str]] = []
    steps, outputs, _ = counted_steps(
        tiny_model_dirs["qwen3"], requests, device=torch.device("cuda"), cuda_waits=cuda_waits,
        speculative_config=spec, max_num_seqs=8, compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16]},
    )  # fmt: skip
    assert len(outputs) == len(requests)
    assert_waits_once(steps, ("sampler.py", "sampled_to_host"), most=3 if spec is None else 4)
    assert [sorted(w) for w in cuda_waits] == [sorted(sites(s)) for s in steps], "\n".join(
        f"step {i}: CUDA {w}, counter {sites(c)}" for i, (w, c) in enumerate(zip(cuda_waits, steps))
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_min_p_host_buffer_is_pinned(tiny_model_dirs):
    """MinP copies its host values up with ``non_blocking``: from pinned memory, or the
    driver stages the copy on the host first."""
    from tinyvllm.sample.logits_processors.builtin import MinPLogitsProcessor

    llm = LLM(str(tiny_model_dirs["qwen3"]), device="cuda", max_model_len=64)
    (min_p,) = [p for p in llm.engine.model_runner.input_batch.logitsprocs.all if isinstance(p, MinPLogitsProcessor)]
    assert min_p.min_p_cpu_tensor.is_pinned()
