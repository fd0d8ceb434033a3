"""The central test of the engine: greedy generation is token-for-token what transformers'
``generate`` produces from the same folder (float32, CPU), whatever the engine does on
the way: prefix caching on or off, chunked prefill forced by a small token budget,
preemption forced by a small pool, and every attention backend. Plus reproducible
sampling and bad input."""

import pytest
import torch

from tinyvllm import LLM, SamplingParams

PREFIX = [(37 * i + 11) % 500 + 5 for i in range(20)]  # 20 shared tokens: 5 blocks of 4
PROMPTS = [
    PREFIX + [300, 301, 302, 303, 304],
    PREFIX + [(7 * i) % 400 + 50 for i in range(13)],
    [401, 402, 403],
    PREFIX[:9] + [77, 78],
    [9],
    PREFIX + [300, 301, 302, 303, 304, 305, 306],
]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def hf_greedy(tiny_model_dirs):
    """Each prompt's greedy continuation by transformers' generate, EOS ignored."""
    from transformers import AutoModelForCausalLM

    results = {}
    for family, folder in tiny_model_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # generate exactly NEW_TOKENS, like ignore_eos
        outs = []
        for ids in PROMPTS:
            with torch.no_grad():
                seq = model.generate(
                    torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                )
            outs.append(seq[0, len(ids):].tolist())
        results[family] = outs
    return results


def _generate(folder, **llm_kwargs):
    llm = LLM(str(folder), device="cpu", max_model_len=64, **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs], outputs


CONFIGS = {
    "prefix_caching_on": dict(block_size=4),
    "prefix_caching_off": dict(block_size=4, enable_prefix_caching=False),
    "chunked_prefill": dict(block_size=4, max_num_batched_tokens=7),
    "preemption": dict(block_size=4, num_gpu_blocks_override=16, max_num_seqs=4),
}


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_generate_greedy_matches_transformers(tiny_model_dirs, hf_greedy, family, config):
    llm, tokens, outputs = _generate(tiny_model_dirs[family], attention_backend="reference", **CONFIGS[config])
    assert tokens == hf_greedy[family]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    scheduler = llm.engine.scheduler
    if config == "preemption":
        assert scheduler.num_preemptions > 0, "the small pool did not force a preemption"
    if config == "prefix_caching_on":
        assert sum(o.num_cached_tokens for o in outputs) > 0, "no prompt hit the prefix cache"
    if config == "prefix_caching_off":
        assert all(o.num_cached_tokens == 0 for o in outputs)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == scheduler.kv_cache_manager.num_gpu_blocks
    scheduler.check_invariants()


TORCH_BACKEND_CASES = [("qwen3", c) for c in CONFIGS] + [("qwen2", "chunked_prefill"), ("llama", "chunked_prefill")]


@pytest.mark.seed("003:memory")
@pytest.mark.parametrize("family, config", TORCH_BACKEND_CASES)
def test_generate_torch_backend_matches_transformers(tiny_model_dirs, hf_greedy, family, config):
    """The batched torch backend (the CPU default): every engine configuration on Qwen3, and
    chunked prefill, where decodes and prefill chunks share steps, on every family."""
    llm, tokens, outputs = _generate(tiny_model_dirs[family], attention_backend="torch", **CONFIGS[config])
    assert llm.model.attention_backend == "torch"
    assert tokens == hf_greedy[family]
    if config == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0, "the small pool did not force a preemption"


def test_generate_auto_backend_is_torch_on_the_cpu(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["qwen3"]), device="cpu", max_model_len=16, block_size=4)
    assert llm.model.attention_backend == "torch"


def test_generate_triton_backend_matches_transformers(tiny_model_dirs, hf_greedy):
    """The Triton kernels (under the interpreter on the CPU) give the same tokens."""
    llm = LLM(str(tiny_model_dirs["qwen3"]), device="cpu", max_model_len=64, block_size=16, attention_backend="triton")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [t[:3] for t in hf_greedy["qwen3"][:2]]


def test_generate_sampling_with_a_seed_is_reproducible(tiny_model_dirs):
    folder = str(tiny_model_dirs["qwen3"])
    seeded = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    unseeded = SamplingParams(temperature=0.9, max_tokens=10, ignore_eos=True)
    runs = []
    for budget in (None, 5):  # a second run with chunked prefill: seeded tokens must not change
        llm = LLM(folder, device="cpu", max_model_len=64, block_size=4, seed=7, max_num_batched_tokens=budget)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], [seeded, seeded, unseeded], use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1]
    assert runs[0][0] != runs[0][1]  # different prompts, same seed: different tokens
    again = LLM(folder, device="cpu", max_model_len=64, block_size=4, seed=7)
    outs = again.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], [seeded, seeded, unseeded], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == runs[0]  # the engine seed makes unseeded rows repeat too


def test_generate_text_prompts_and_outputs(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), device="cpu", max_model_len=64)
    [out] = llm.generate("def add(a, b):", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    tok = llm.get_tokenizer()
    assert out.prompt == "def add(a, b):" and out.prompt_token_ids == tok("def add(a, b):").input_ids
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert out.finished and out.metrics.time_to_first_token is not None and out.metrics.latency >= 0


def test_generate_bad_input_runs_nothing(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["qwen3"]), device="cpu", max_model_len=16, block_size=4)
    with pytest.raises(ValueError, match="prompt 1 has 17 tokens, more than max_model_len 16"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": list(range(17))}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt 1 has token id 512, outside the vocabulary \[0, 512\)"):
        llm.generate([{"prompt_token_ids": [1]}, {"prompt_token_ids": [3, 512]}], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["x"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0, got -1"):
        SamplingParams(temperature=-1)
    assert not llm.engine.has_unfinished_requests()
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_gpu_blocks


def test_generate_start_up_errors(tiny_model_dirs, tmp_path):
    folder = str(tiny_model_dirs["qwen3"])
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="one request of max_model_len=64 tokens needs 16"):
        LLM(folder, device="cpu", max_model_len=64, block_size=4, num_gpu_blocks_override=8)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        LLM(folder, device="cpu", attention_backend="flash")
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 512"):
        LLM(folder, device="cpu", max_model_len=100_000)


def test_generate_ids_skip_ids_already_in_the_engine(tiny_model_dirs):
    """generate numbers its requests "0", "1", ...; a request queued through the engine
    under one of those ids must not make generate fail with a duplicate id."""
    llm = LLM(str(tiny_model_dirs["qwen3"]), device="cpu", max_model_len=32, block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.engine.add_request("0", [5, 6, 7], greedy)
    llm.engine.add_request("2", [8, 9], greedy)
    outs = llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3, 4]}], greedy, use_tqdm=False)
    assert [o.request_id for o in outs] == ["1", "3"]
    assert [o.prompt_token_ids for o in outs] == [[1, 2], [3, 4]]
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    assert not llm.engine.has_unfinished_requests()  # the engine's own requests ran too
    [again] = llm.generate({"prompt_token_ids": [1, 2]}, greedy, use_tqdm=False)
    assert again.request_id == "4" and again.outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.seed("004:computed", "003:memory")
def test_torch_backend_attends_a_shared_cached_prefix_once_with_the_reference_tokens(tiny_model_dirs, monkeypatch):
    """Sixteen prompts share 144 tokens; with prefix caching they decode over the same cache
    blocks, and the torch backend attends to those once per step for all of them (cascade
    attention, ``attention/torch_sdpa.py`` NOTE 7). Greedy tokens equal the reference's."""
    from tinyvllm.attention import torch_sdpa

    calls = []
    real = torch_sdpa.cascade_decode
    monkeypatch.setattr(torch_sdpa, "cascade_decode", lambda *a: calls.append(a[-2].prefix_blocks.numel()) or real(*a))
    shared = [(7 * i) % 500 + 3 for i in range(144)]
    prompts = [{"prompt_token_ids": shared + [100 + r, 200 + r, 300 + r]} for r in range(16)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "reference"):
        folder = str(tiny_model_dirs["qwen3"])
        llm = LLM(folder, device="cpu", max_model_len=160, block_size=16, attention_backend=backend)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert tokens["torch"] == tokens["reference"]
    assert calls and set(calls) == {9}  # 9 shared blocks of 16: 15 * 144 keys saved, over CASCADE_MIN_SAVED_KEYS
