"""Pooling (embeddings): ``LLM(runner="pooling")``, ``encode`` and ``embed`` against transformers.

The reference is transformers' own base model (``AutoModel``: the decoder without its LM head)
on the same folder: its ``last_hidden_state`` pooled by hand. Every engine feature a prompt
meets on its way (chunked prefill, the prefix cache, preemption, emulated CUDA graphs) must
give the same vector; every argument the engine cannot honour is refused by name, before
anything is queued.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tinyvllm import LLM, EmbeddingRequestOutput, PoolingParams, PoolingRequestOutput, SamplingParams
from tinyvllm.config import PoolerConfig
from tinyvllm.engine.engine_args import EngineArgs
from tinyvllm.stdlib_tiny import STDLIB_TINY

PROMPTS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nprint(os.getcwd())",
    "x = 1",
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, item):\n        self.items.append(item)\n",
]


@pytest.fixture(scope="module")
def hf_states():
    """Each prompt's token ids and transformers' final hidden states [T, hidden] (float32)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(STDLIB_TINY)
    model = AutoModel.from_pretrained(STDLIB_TINY, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out.append((ids[0].tolist(), model(ids).last_hidden_state[0]))
    return out


def reference(states: torch.Tensor, pooling_type: str, normalize: bool) -> torch.Tensor:
    vector = {"LAST": states[-1], "MEAN": states.mean(dim=0), "CLS": states[0]}[pooling_type]
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def engine(**kwargs) -> LLM:
    kwargs.setdefault("runner", "pooling")
    return LLM(**kwargs)


@pytest.fixture(scope="module")
def last_llm():
    return engine(max_num_batched_tokens=16, max_num_seqs=4)  # chunked: prompts are longer than 16 tokens


def close(a, b, tol: float = 2e-5) -> bool:
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), b, atol=tol, rtol=0)


# -- the vector ----------------------------------------------------------------------


def test_embed_is_the_last_tokens_normalised_hidden_state_through_chunked_prefill(last_llm, hf_states):
    outputs = last_llm.embed(PROMPTS, use_tqdm=False)
    assert [type(o) for o in outputs] == [EmbeddingRequestOutput] * len(PROMPTS)
    assert max(len(ids) for ids, _ in hf_states) > 16  # some prompt really was chunked
    for output, (ids, states) in zip(outputs, hf_states):
        assert output.prompt_token_ids == ids and output.finished
        assert output.outputs.hidden_size == states.shape[1]
        assert close(output.outputs.embedding, reference(states, "LAST", True))


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_mean_and_cls_pool_every_chunk_of_the_prompt(pooling_type, hf_states):
    chunked = engine(max_num_batched_tokens=16, pooler_config={"pooling_type": pooling_type})
    whole = engine(pooler_config={"pooling_type": pooling_type, "normalize": False})
    for output, (_, states) in zip(chunked.embed(PROMPTS, use_tqdm=False), hf_states):
        assert close(output.outputs.embedding, reference(states, pooling_type, True))
    raw = whole.encode(PROMPTS, use_tqdm=False)
    assert all(isinstance(o, PoolingRequestOutput) and o.outputs.data.dtype == torch.float32 for o in raw)
    for output, (_, states) in zip(raw, hf_states):
        assert close(output.outputs.data, reference(states, pooling_type, False), 1e-4)


def test_truncate_prompt_tokens_embeds_the_last_tokens(last_llm, hf_states):
    ids, _ = hf_states[3]
    [cut] = last_llm.embed(PROMPTS[3], use_tqdm=False, truncate_prompt_tokens=7)
    [alone] = last_llm.embed({"prompt_token_ids": ids[-7:]}, use_tqdm=False)
    assert cut.prompt_token_ids == ids[-7:] and cut.outputs.embedding == alone.outputs.embedding


def test_token_embed_is_every_positions_normalised_state_and_reads_no_cache(last_llm, hf_states):
    """``token_embed`` (pooling_params.py NOTE 3) keeps every prompt position through chunked
    prefill, whatever the engine's pooling type, and takes no prefix-cache hit (NOTE 4)."""
    outputs = last_llm.encode(PROMPTS, use_tqdm=False, pooling_task="token_embed")
    for output, (ids, states) in zip(outputs, hf_states):
        assert output.outputs.data.shape == (len(ids), states.shape[1]) and output.num_cached_tokens == 0
        assert torch.allclose(output.outputs.data, torch.nn.functional.normalize(states, dim=-1), atol=2e-5)
    [raw] = last_llm.encode(PROMPTS[3], PoolingParams(task="token_embed", normalize=False), use_tqdm=False)
    assert raw.num_cached_tokens == 0 and torch.allclose(raw.outputs.data, hf_states[3][1], atol=2e-5)


def test_normalize_per_request_overrides_the_engine(last_llm, hf_states):
    params = [PoolingParams(normalize=False), PoolingParams(), PoolingParams(normalize=True), PoolingParams(normalize=False)]
    outputs = last_llm.encode(PROMPTS, params, use_tqdm=False)
    for output, p, (_, states) in zip(outputs, params, hf_states):
        assert close(output.outputs.data, reference(states, "LAST", p.normalize is not False), 1e-4)


# -- the engine's mechanisms meet a pooling request -----------------------------------------


def test_last_pooling_reads_the_prefix_cache_and_mean_does_not(hf_states):
    ids, states = hf_states[3]  # the longest prompt: several full blocks
    for pooling_type, expect_hit in (("LAST", True), ("MEAN", False)):
        llm = engine(block_size=4, pooler_config={"pooling_type": pooling_type})
        first, again = llm.encode([{"prompt_token_ids": ids}] * 2, use_tqdm=False)[0], None
        again = llm.encode({"prompt_token_ids": ids}, use_tqdm=False)[0]
        assert first.num_cached_tokens == 0
        assert (again.num_cached_tokens > 0) is expect_hit, (pooling_type, again.num_cached_tokens)
        assert close(again.outputs.data, reference(states, pooling_type, True))


def test_a_request_preempted_mid_prompt_pools_its_recompute_afresh(hf_states):
    """A MEAN request preempted after its first chunk recomputes from position 0 (scheduler
    NOTE 1); the chunk that restarts at 0 restarts its sum, so the vector is transformers'."""
    ids, states = hf_states[3]
    llm = engine(max_num_batched_tokens=16, pooler_config={"pooling_type": "MEAN"})
    engine_, scheduler = llm.engine, llm.engine.scheduler
    engine_.add_request("long", ids, PoolingParams())
    assert engine_.step() == [] and scheduler.running[0].num_computed_tokens == 16  # one chunk in
    scheduler._preempt(0)  # as the scheduler does when blocks run out
    outputs = []
    while engine_.has_unfinished_requests():
        outputs += engine_.step()
    (output,) = outputs
    assert scheduler.num_preemptions == 1 and output.num_cached_tokens == 0
    assert close(output.outputs.data, reference(states, "MEAN", True))


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_async_scheduling_pools_the_synchronous_engines_vectors(pooling_type):
    """Async scheduling (core/async_scheduler.py): the step that ends a prompt gets a
    placeholder that reaches max_tokens=1, so the request is not scheduled again while its
    vector is on the way. Chunked prefill, few sequences and a shared prefix: the same vectors,
    the same prefix hits, and the engine's invariants between steps."""
    shared = [(13 * j) % 300 + 3 for j in range(32)]
    prompts = [{"prompt_token_ids": [(7 * i + j) % 400 + 3 for j in range(n)]} for i, n in enumerate([5, 40, 17, 90, 3])]
    prompts += [{"prompt_token_ids": shared + [i + 3] * i} for i in range(1, 4)]  # two full blocks shared
    runs = {}
    for async_scheduling in (False, True):
        llm = engine(pooler_config={"pooling_type": pooling_type}, max_num_batched_tokens=16, max_num_seqs=3,
                     async_scheduling=async_scheduling)  # fmt: skip
        runs[async_scheduling] = llm.encode(prompts, use_tqdm=False)
        llm.engine.check_invariants()
        assert not llm.engine.has_unfinished_requests()
    for a, b in zip(runs[False], runs[True]):
        assert torch.equal(a.outputs.data, b.outputs.data) and a.num_cached_tokens == b.num_cached_tokens
    assert (runs[True][-1].num_cached_tokens > 0) is (pooling_type == "LAST")


def test_emulated_cuda_graphs_give_the_same_vectors(last_llm):
    graphs = engine(max_num_batched_tokens=16, max_num_seqs=4, compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"})
    one_token = [{"prompt_token_ids": [t]} for t in (5, 17, 29)]  # a batch of 1-token prompts is a uniform decode batch
    for prompts in (PROMPTS, one_token):
        for a, b in zip(graphs.embed(prompts, use_tqdm=False), last_llm.embed(prompts, use_tqdm=False)):
            assert close(a.outputs.embedding, torch.tensor(b.outputs.embedding))


@pytest.mark.parametrize(("pooling_type", "normalize"), [("CLS", True), ("LAST", False), ("MEAN", False)])
def test_pooling_keeps_no_view_of_a_graphs_reused_output(pooling_type, normalize):
    """A graph's output buffer is rewritten by the next replay of its size (``cuda_graph.py``
    NOTE 5), so what the pooler keeps across steps (CLS's first row) or hands back (a vector
    not normalised: the row itself in float32) must be a copy. Capture sizes 8 and 16 make
    two 16-token steps replay one graph; the vectors must be the eager engine's."""
    config = {"pooling_type": pooling_type, "normalize": normalize}
    eager = engine(max_num_batched_tokens=16, max_num_seqs=4, pooler_config=config, enforce_eager=True)
    graphs = engine(max_num_batched_tokens=16, max_num_seqs=4, pooler_config=config,
                    compilation_config={"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [8, 16]})  # fmt: skip
    want = [o.outputs.data for o in eager.encode(PROMPTS, use_tqdm=False)]
    got = [o.outputs.data for o in graphs.encode(PROMPTS, use_tqdm=False)]
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_engine_add_request_and_step_return_the_pooling_output(last_llm, hf_states):
    ids, states = hf_states[0]
    last_llm.engine.add_request("embed-me", ids, PoolingParams())
    outputs = []
    while last_llm.engine.has_unfinished_requests():
        outputs += last_llm.engine.step()
    (output,) = outputs
    assert isinstance(output, PoolingRequestOutput) and output.request_id == "embed-me"
    assert close(output.outputs.data, reference(states, "LAST", True))


# -- what is refused, by name, before anything is queued -------------------------------------


def test_each_engine_refuses_the_other_kind_of_params(last_llm):
    with pytest.raises(ValueError, match="runner='pooling'.*LLM.embed"):
        last_llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    generator = LLM(max_num_seqs=2)
    with pytest.raises(ValueError, match=r"pooling_params: PoolingParams need a pooling engine"):
        generator.embed(PROMPTS[:1], use_tqdm=False)
    assert not last_llm.engine.has_unfinished_requests() and not generator.engine.has_unfinished_requests()


def test_a_bad_prompt_in_a_batch_queues_nothing(last_llm):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        last_llm.embed([PROMPTS[0], {"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(TypeError, match=r"pooling_params\[1\] must be PoolingParams"):
        last_llm.embed(PROMPTS[:2], [PoolingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="1 pooling params for 2 prompts"):
        last_llm.embed(PROMPTS[:2], [PoolingParams()], use_tqdm=False)
    assert not last_llm.engine.has_unfinished_requests()


def test_pooling_params_check_their_fields():
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(TypeError, match="normalize"):
        PoolingParams(normalize=1)
    with pytest.raises(ValueError, match="task must be one of"):
        PoolingParams(task="embedding")  # vLLM's old name, not taken
    with pytest.raises(ValueError, match="normalize=True and use_activation=False contradict"):
        PoolingParams(normalize=True, use_activation=False)


def test_an_embedding_model_refuses_the_classifier_tasks_by_name(last_llm):
    with pytest.raises(ValueError, match=r"task='classify' is not one of this model's tasks \('embed', 'token_embed'\)"):
        last_llm.classify("x = 1", use_tqdm=False)
    with pytest.raises(ValueError, match=r"task='embed', but this call runs task='classify'"):
        last_llm.classify("x = 1", PoolingParams(task="embed"), use_tqdm=False)
    assert not last_llm.engine.has_unfinished_requests()


def test_dimensions_need_a_matryoshka_model(last_llm, tmp_path):
    with pytest.raises(ValueError, match="dimensions=8 needs a matryoshka model"):
        last_llm.embed(PROMPTS[0], PoolingParams(dimensions=8), use_tqdm=False)
    folder = shutil.copytree(STDLIB_TINY, tmp_path / "matryoshka")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    llm = engine(model=str(folder))
    with pytest.raises(ValueError, match="dimensions=999 is more than the model's hidden size 256"):
        llm.embed(PROMPTS[0], PoolingParams(dimensions=999), use_tqdm=False)
    (cut,) = llm.encode(PROMPTS[0], PoolingParams(dimensions=8), use_tqdm=False)
    (raw,) = llm.encode(PROMPTS[0], PoolingParams(normalize=False), use_tqdm=False)
    assert cut.outputs.data.shape == (8,)
    assert close(cut.outputs.data, torch.nn.functional.normalize(raw.outputs.data[:8], dim=-1))  # cut, then normalised


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"runner": "embed"}, "runner must be one of"),
        ({"runner": "generate", "pooler_config": {"pooling_type": "MEAN"}}, "needs runner='pooling'"),
        ({"runner": "auto", "pooler_config": {"pooling_type": "MEAN"}}, "needs runner='pooling': runner='auto' chose 'generate'"),
        ({"pooler_config": {"pooling_type": "MAX"}}, "pooling_type must be one of"),
        ({"pooler_config": {"pooling": "MEAN"}}, "unknown keys"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "cannot be combined with speculative_config"),
        ({"logits_processors": ["tinyvllm.sample.logits_processors.builtin:MinPLogitsProcessor"]}, "custom logits_processors"),
    ],
)
def test_engine_arguments_a_pooling_engine_refuses(kwargs, message):
    args = {"runner": "pooling", **kwargs}
    with pytest.raises(ValueError, match=message):
        EngineArgs(**args).create_engine_config()


# -- the model folder's own pooling (sentence-transformers' files) ----------------------------


def sentence_transformers_folder(tmp_path, modes: dict, normalize: bool):
    folder = shutil.copytree(STDLIB_TINY, tmp_path / "st")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 256, **modes}))
    return folder


def test_the_folder_says_how_to_pool_unless_the_user_does(tmp_path):
    folder = sentence_transformers_folder(tmp_path, {"pooling_mode_mean_tokens": True}, normalize=False)
    config = EngineArgs(str(folder), runner="pooling").create_engine_config()
    assert config.model_config.pooler_config == PoolerConfig("MEAN", False)
    config = EngineArgs(str(folder), runner="pooling", pooler_config={"pooling_type": "CLS"}).create_engine_config()
    assert config.model_config.pooler_config == PoolerConfig("CLS", False)
    config = EngineArgs(STDLIB_TINY, runner="pooling").create_engine_config()  # no modules.json: vLLM's defaults
    assert config.model_config.pooler_config == PoolerConfig("LAST", True)
    assert EngineArgs(STDLIB_TINY).create_engine_config().model_config.pooler_config is None


def test_a_pooling_module_that_names_no_mode_built_is_refused(tmp_path):
    folder = sentence_transformers_folder(tmp_path, {"pooling_mode_max_tokens": True}, normalize=True)
    with pytest.raises(ValueError, match=r"1_Pooling/config.json: one of .* must be true"):
        EngineArgs(str(folder), runner="pooling").create_engine_config()
    (folder / "modules.json").write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match=r"modules.json: must be a list of module objects"):
        EngineArgs(str(folder), runner="pooling").create_engine_config()


@pytest.mark.seed("000:modes")
def test_a_pooling_engine_defaults_to_piecewise_graphs_on_cuda():
    """Seed 000: FULL_AND_PIECEWISE by default, "still PIECEWISE for pooling models"."""
    from tinyvllm.config import CUDAGraphMode
    from tinyvllm.worker.cudagraph_capture import default_cudagraph_mode

    assert default_cudagraph_mode("cuda", pooling=False) == CUDAGraphMode.FULL_AND_PIECEWISE
    assert default_cudagraph_mode("cuda", pooling=True) == CUDAGraphMode.PIECEWISE
    assert default_cudagraph_mode("cpu", pooling=True) == CUDAGraphMode.NONE


def test_an_aborted_pooling_request_ends_with_a_pooling_output_and_frees_its_blocks(hf_states):
    """Aborted mid-prompt, a pooling request's final output is a ``PoolingRequestOutput``
    holding no vector (not a text completion), and its blocks go back to the pool."""
    llm = engine(max_num_batched_tokens=16)
    engine_, pool = llm.engine, llm.engine.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    engine_.add_request("cut", hf_states[3][0], PoolingParams())
    assert engine_.step() == [] and pool.get_num_free_blocks() < free_before  # one chunk in
    (output,) = engine_.abort_request("cut")
    assert isinstance(output, PoolingRequestOutput) and output.outputs is None and output.finished
    assert output.prompt_token_ids == hf_states[3][0]
    assert not engine_.has_unfinished_requests() and pool.get_num_free_blocks() == free_before
    with pytest.raises(ValueError, match="aborted before its vector"):
        EmbeddingRequestOutput.from_base(output)


def test_async_llm_encode_aborted_by_id_yields_a_pooling_output_without_a_vector(hf_states):
    import asyncio

    from tinyvllm.engine.async_llm import AsyncLLM

    async def main():
        async_llm = AsyncLLM(engine(max_num_batched_tokens=4).engine)  # a long prompt: many steps

        async def consume():
            return [out async for out in async_llm.encode({"prompt_token_ids": (hf_states[3][0] * 8)[:300]}, PoolingParams(), "x")]

        task = asyncio.ensure_future(consume())
        while not async_llm.engine.has_unfinished_requests():
            await asyncio.sleep(0.001)
        await async_llm.abort("x")
        outputs = await asyncio.wait_for(task, 30)
        await async_llm.shutdown()
        return outputs

    (output,) = asyncio.run(main())
    assert isinstance(output, PoolingRequestOutput) and output.outputs is None and output.finished


def test_a_pooling_request_preempted_while_its_last_step_is_in_flight_still_finishes(last_llm):
    """Async scheduling: preempted after its last step was launched, a pooling request waits
    with no blocks; the vector that step made (its KV was all there) still ends it, from the
    waiting queue, and it is not computed again."""
    ids = [5, 6, 7, 8, 9]
    llm = engine(async_scheduling=True)
    engine_, scheduler = llm.engine, llm.engine.scheduler
    engine_.add_request("A", ids, PoolingParams())
    assert engine_.step() == []  # its one step launched, not read back
    scheduler._preempt(0)  # as the scheduler does when a request ahead of it needs blocks
    outputs = []
    while engine_.has_unfinished_requests():
        outputs += engine_.step()
    (output,) = outputs
    (want,) = last_llm.encode({"prompt_token_ids": ids}, use_tqdm=False)
    assert torch.equal(output.outputs.data, want.outputs.data)
    assert scheduler.num_preemptions == 1 and not scheduler.waiting and not scheduler.running
    engine_.check_invariants()


@pytest.mark.seed("001:11")
def test_a_pooling_engine_builds_no_logits_processors(last_llm):
    """Seed 001 ch. 11.4: ``build_logitsprocs`` in pooling mode builds none (a pooling model makes
    no logits); the worker takes that branch for ``runner="pooling"``, and custom ones are refused."""
    assert list(last_llm.engine.model_runner.input_batch.logitsprocs.all) == []
    assert len(list(LLM(max_num_seqs=2).engine.model_runner.input_batch.logitsprocs.all)) == 3  # MinP, LogitBias, MinTokens
    with pytest.raises(ValueError, match="cannot be combined with custom logits_processors"):
        EngineArgs(runner="pooling", logits_processors=["tinyvllm.sample.logits_processors.builtin:MinPLogitsProcessor"]).create_engine_config()
