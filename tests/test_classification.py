"""Classifiers and cross-encoders: ``*ForSequenceClassification`` models, ``LLM.classify`` and a
cross-encoder's ``LLM.score``, against transformers' own ``AutoModelForSequenceClassification``.

The models are tiny random classifiers built here (``build_tiny_model(num_labels=...)``): a
three-label Qwen3 and a one-label Llama (a cross-encoder). transformers runs each prompt (or
pair, through the tokenizer's pair encoding) alone and its logits are the reference; the
engine must give the same numbers through chunked prefill, the prefix cache and async
scheduling, and refuse by name what such a model cannot do.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tinyvllm import LLM, ClassificationRequestOutput, PoolingParams, SamplingParams
from tinyvllm.models.tiny import build_tiny_model

PROMPTS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nprint(os.getcwd())",
    "x = 1",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
]
QUERY = "how do I add two numbers"
DOCS = ["def add(a, b): return a + b", "import os", "class Stack: pass"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("classifiers")
    return {"three": build_tiny_model(root / "qwen3-cls", "qwen3", num_labels=3),
            "one": build_tiny_model(root / "llama-ce", "llama", num_labels=1)}  # fmt: skip


def hf_logits(folder, texts: list, pair: bool = False) -> list[tuple[list[int], torch.Tensor]]:
    """Each text's (or pair's) token ids and transformers' logits [num_labels], run alone."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for text in texts:
        ids = (tokenizer(text[0], text_pair=text[1]) if pair else tokenizer(text)).input_ids
        with torch.no_grad():
            out.append((ids, model(torch.tensor([ids])).logits[0]))
    return out


@pytest.fixture(scope="module")
def classifier(folders):
    return LLM(str(folders["three"]), max_num_batched_tokens=8, max_num_seqs=4)  # runner "auto": pooling


def close(values, reference: torch.Tensor, tol: float = 2e-5) -> bool:
    return torch.allclose(torch.tensor(values, dtype=torch.float32), reference, atol=tol, rtol=0)


# -- classify ------------------------------------------------------------------------


def test_classify_is_the_softmax_of_transformers_logits_through_chunked_prefill(classifier, folders):
    outputs = classifier.classify(PROMPTS, use_tqdm=False)
    reference = hf_logits(folders["three"], PROMPTS)
    assert [type(o) for o in outputs] == [ClassificationRequestOutput] * len(PROMPTS)
    assert max(len(ids) for ids, _ in reference) > 8  # chunked: the budget is 8 tokens a step
    for output, (ids, logits) in zip(outputs, reference):
        assert output.prompt_token_ids == ids and output.outputs.num_classes == 3
        assert close(output.outputs.probs, torch.softmax(logits, dim=-1))
        assert abs(sum(output.outputs.probs) - 1) < 1e-5


def test_use_activation_false_returns_the_raw_logits(classifier, folders):
    outputs = classifier.classify(PROMPTS[:2], PoolingParams(use_activation=False), use_tqdm=False)
    for output, (_, logits) in zip(outputs, hf_logits(folders["three"], PROMPTS[:2])):
        assert close(output.outputs.probs, logits)


def test_encode_runs_the_models_first_task_and_the_prefix_cache_is_read(classifier):
    first, again = classifier.encode([PROMPTS[3], PROMPTS[3]], use_tqdm=False)  # one batch: no hit between them
    [later] = classifier.encode(PROMPTS[3], use_tqdm=False)
    assert first.outputs.data.shape == (3,) and later.num_cached_tokens > 0  # LAST pooling reads hits
    assert torch.allclose(later.outputs.data, first.outputs.data, atol=1e-6)


def test_async_scheduling_classifies_as_the_synchronous_engine(folders, classifier):
    expected = [o.outputs.probs for o in classifier.classify(PROMPTS, use_tqdm=False)]
    engine = LLM(str(folders["three"]), max_num_batched_tokens=8, max_num_seqs=4, async_scheduling=True)
    got = [o.outputs.probs for o in engine.classify(PROMPTS, use_tqdm=False)]
    assert all(close(g, torch.tensor(e), 1e-6) for g, e in zip(got, expected))


def test_the_folder_says_the_activation(folders, tmp_path):
    """``problem_type`` multi_label_classification: independent sigmoids (pooling_spec.py NOTE 1)."""
    folder = shutil.copytree(folders["three"], tmp_path / "multi")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "problem_type": "multi_label_classification"}))
    [output] = LLM(str(folder)).classify(PROMPTS[0], use_tqdm=False)
    [(_, logits)] = hf_logits(folders["three"], PROMPTS[:1])
    assert close(output.outputs.probs, torch.sigmoid(logits))


def test_reward_is_each_tokens_label_distribution(classifier, folders):
    """``LLM.reward`` (``token_classify``): the score head on every prompt position, a softmax
    per row, equal to transformers' head applied to its decoder's every hidden state."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folders["three"], dtype=torch.float32).eval()
    outputs = classifier.reward(PROMPTS, use_tqdm=False)
    for output in outputs:
        with torch.no_grad():
            states = model.model(torch.tensor([output.prompt_token_ids])).last_hidden_state[0]  # [T, hidden]
            want = torch.softmax(model.score(states), dim=-1)  # [T, 3]
        assert output.outputs.data.shape == want.shape and output.num_cached_tokens == 0
        assert torch.allclose(output.outputs.data, want, atol=2e-5)
    last = classifier.classify(PROMPTS, use_tqdm=False)
    assert all(close(c.outputs.probs, r.outputs.data[-1]) for c, r in zip(last, outputs))  # LAST: the last row


def test_step_tag_id_keeps_the_rows_of_the_tagged_prompt_positions(classifier, folders):
    """``PoolingParams.step_tag_id`` (``pooling_params.py`` NOTE 6, vLLM's ``STEP`` pooling): a
    process reward model's scores at each step's tag, the full ``reward``'s rows at exactly the
    positions holding the tag, in order; through chunks of 8 tokens (the tags split across them),
    with none (``[0, 3]``), and as the engine's ``pooler_config`` default, which a request's own
    overrides and which ``classify`` does not read."""
    tag = 7
    prompts = [[5, 9, tag, 11, 12, 13, tag, 20, 21, 22, 23, 24, tag, 30, 31, 32, 33, 34, tag],  # tags in 3 chunks
               [tag, 40, 41], [50, 51, 52, 53]]  # fmt: skip
    inputs = [{"prompt_token_ids": p} for p in prompts]
    whole = classifier.reward(inputs, use_tqdm=False)
    tagged = classifier.reward(inputs, PoolingParams(step_tag_id=tag), use_tqdm=False)
    for prompt, full, out in zip(prompts, whole, tagged):
        at = [i for i, t in enumerate(prompt) if t == tag]
        assert out.outputs.data.shape == (len(at), 3)
        assert torch.allclose(out.outputs.data, full.outputs.data[at], atol=1e-6, rtol=0)
    assert tagged[0].outputs.data.shape[0] == 4 and tagged[2].outputs.data.shape == (0, 3)

    engine = LLM(str(folders["three"]), max_num_batched_tokens=8, pooler_config={"step_tag_id": tag})
    by_default = engine.reward(inputs, use_tqdm=False)
    assert all(torch.equal(a.outputs.data, b.outputs.data) for a, b in zip(by_default, tagged))
    [other] = engine.reward(inputs[:1], PoolingParams(step_tag_id=11), use_tqdm=False)  # the request's own
    assert torch.allclose(other.outputs.data, whole[0].outputs.data[[3]], atol=1e-6, rtol=0)
    assert all(close(a.outputs.probs, torch.tensor(b.outputs.probs)) for a, b in
               zip(engine.classify(inputs, use_tqdm=False), classifier.classify(inputs, use_tqdm=False)))  # fmt: skip


def test_a_bad_step_tag_id_is_refused_by_name(classifier, folders):
    with pytest.raises(ValueError, match=r"step_tag_id=7 is for the token tasks \('token_embed', 'token_classify'\), not task='classify'"):
        classifier.classify(PROMPTS[0], PoolingParams(step_tag_id=7), use_tqdm=False)
    with pytest.raises(ValueError, match="step_tag_id must be an int >= 0, got -1"):
        PoolingParams(step_tag_id=-1)
    with pytest.raises(TypeError, match="step_tag_id must be an int"):
        PoolingParams(step_tag_id=True)
    with pytest.raises(TypeError, match="pooler_config step_tag_id must be an int"):
        LLM(str(folders["three"]), pooler_config={"step_tag_id": "7"})
    with pytest.raises(ValueError, match="unknown"):
        LLM(str(folders["three"]), pooler_config={"returned_token_ids": [1, 2]})


# -- what a classifier cannot do, refused by name --------------------------------------


def test_a_classifier_refuses_generation_and_embedding(classifier, folders):
    with pytest.raises(ValueError, match=r"runner='generate': Qwen3ForSequenceClassification has a score head and no LM head"):
        LLM(str(folders["three"]), runner="generate")
    with pytest.raises(ValueError, match="this engine pools"):
        classifier.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"task='embed' is not one of this model's tasks \('classify', 'token_classify'\)"):
        classifier.embed(PROMPTS[0], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions=2 is for embeddings, not task='classify'"):
        classifier.classify(PROMPTS[0], PoolingParams(dimensions=2), use_tqdm=False)
    with pytest.raises(ValueError, match="score needs a classifier with one label"):
        classifier.encode(PROMPTS[0], PoolingParams(task="score"), use_tqdm=False)
    assert not classifier.engine.has_unfinished_requests()


def test_the_generate_command_refuses_a_classifier_before_loading_it(folders):
    """``tinyvllm generate`` always generates (its engine args say runner "generate"), so a
    classifier's folder is refused from its config, with the reason, before any weight is read."""
    from tinyvllm import cli
    from tinyvllm.engine.engine_args import EngineArgs

    args = cli.build_parser().parse_args(["generate", "--model", str(folders["three"]), "--prompt", "x"])
    with pytest.raises(ValueError, match="runner='generate': .* no LM head"):
        EngineArgs.from_cli_args(args).create_engine_config()
    serve = cli.build_parser().parse_args(["serve", "--model", str(folders["three"])])
    assert EngineArgs.from_cli_args(serve).create_engine_config().model_config.runner_type == "pooling"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(id2label={"0": "a", "2": "b"}), "field 'id2label' must map the ids 0..n-1"),
        (lambda c: c.update(problem_type="ranking"), "field 'problem_type' must be one of"),
        (lambda c: c.update(sentence_transformers={"activation_fn": "torch.nn.Tanh"}), "cross-encoder activation 'torch.nn.Tanh'"),
    ],
)
def test_a_config_the_engine_cannot_honour_is_refused_before_start_up(folders, tmp_path, edit, message):
    folder = shutil.copytree(folders["three"], tmp_path / "bad")
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(folder))


def test_the_loader_reads_labels_and_wants_the_score_head(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    from tinyvllm.models.classifier import load_classifier
    from tinyvllm.models.llama import load_model
    from tinyvllm.models.loader import check_model_folder

    assert check_model_folder(folders["three"]).labels == ("LABEL_0", "LABEL_1", "LABEL_2")
    assert load_classifier(folders["one"]).score.weight.shape == (1, 64)
    with pytest.raises(ValueError, match="holds a Qwen3ForSequenceClassification: classifier.load_classifier loads classifiers"):
        load_model(folders["three"])
    folder = shutil.copytree(folders["three"], tmp_path / "lm-head")
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()}, folder / "model.safetensors")
    assert check_model_folder(folder).labels is not None  # a converted causal LM's head: skipped
    del tensors["score.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="tensor 'score.weight' is missing"):
        check_model_folder(folder)


# -- the cross-encoder -------------------------------------------------------------------


@pytest.fixture(scope="module")
def cross_encoder(folders):
    return LLM(str(folders["one"]), max_num_batched_tokens=16)


def test_a_cross_encoder_scores_each_pair_read_as_one_prompt(cross_encoder, folders):
    scores = cross_encoder.score(QUERY, DOCS, use_tqdm=False)  # 1-to-N
    reference = hf_logits(folders["one"], [(QUERY, d) for d in DOCS], pair=True)
    for output, (ids, logits) in zip(scores, reference):
        assert output.prompt_token_ids == ids
        assert abs(output.outputs.score - torch.sigmoid(logits[0]).item()) < 2e-5
    pairs = cross_encoder.score(DOCS, list(reversed(DOCS)), use_tqdm=False)  # N-to-N
    reference = hf_logits(folders["one"], list(zip(DOCS, reversed(DOCS))), pair=True)
    assert [round(p.outputs.score, 5) for p in pairs] == [round(torch.sigmoid(r[0]).item(), 5) for _, r in reference]
    assert len({p.request_id for p in pairs}) == len(DOCS)
    [raw] = cross_encoder.score(QUERY, DOCS[0], use_tqdm=False, pooling_params=PoolingParams(use_activation=False))
    [(_, logits)] = hf_logits(folders["one"], [(QUERY, DOCS[0])], pair=True)
    assert abs(raw.outputs.score - logits[0].item()) < 2e-5  # the logit itself
    [cut] = cross_encoder.score(QUERY, DOCS[0], use_tqdm=False, truncate_prompt_tokens=4)  # the pair's last 4
    assert cut.prompt_token_ids == hf_logits(folders["one"], [(QUERY, DOCS[0])], pair=True)[0][0][-4:]


def test_use_pad_token_false_concatenates_the_texts(folders, tmp_path):
    folder = shutil.copytree(folders["one"], tmp_path / "llm-reranker")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "use_pad_token": False}))
    [output] = LLM(str(folder)).score(QUERY, DOCS[0], use_tqdm=False)
    [(ids, logits)] = hf_logits(folders["one"], [QUERY + DOCS[0]])
    assert output.prompt_token_ids == ids and abs(output.outputs.score - torch.sigmoid(logits[0]).item()) < 2e-5


def test_a_cross_encoder_names_the_pair_at_fault(cross_encoder):
    with pytest.raises(ValueError, match=r"data_2\[1\]: a cross-encoder reads the two texts of a pair as one prompt"):
        cross_encoder.score(QUERY, ["fine", {"prompt_token_ids": [1, 2]}], use_tqdm=False)
    with pytest.raises(ValueError, match="data_1 has 2 items and data_2 has 3"):
        cross_encoder.score(DOCS[:2], DOCS, use_tqdm=False)
    with pytest.raises(ValueError, match=r"the pair \(data_1, data_2\[1\]\) has \d+ tokens"):
        cross_encoder.score(QUERY, ["short", "word " * 5000], use_tqdm=False)
    assert not cross_encoder.engine.has_unfinished_requests()
    [one] = cross_encoder.classify(QUERY, use_tqdm=False)  # a one-label classifier classifies too: a sigmoid
    assert one.outputs.num_classes == 1 and 0 < one.outputs.probs[0] < 1


@pytest.mark.slow
def test_two_ranks_classify_as_one(folders):
    """A classifier on two ranks (gloo): each rank holds the whole ``score`` head (replicated,
    read whole) over its shard of the decoder; rank 0's scores equal one rank's."""
    probs = {}
    for size in (1, 2):
        llm = LLM(str(folders["three"]), tensor_parallel_size=size, device="cpu", max_model_len=64, block_size=4,
                  max_num_batched_tokens=8)  # fmt: skip
        try:
            probs[size] = [o.outputs.probs for o in llm.classify(PROMPTS, use_tqdm=False)]
        finally:
            llm.engine.model_executor.shutdown()
    assert all(close(two, torch.tensor(one), 1e-5) for one, two in zip(probs[1], probs[2]))


def test_truncate_prompt_tokens_keeps_each_prompts_last_tokens(classifier, folders):
    """vLLM's ``truncate_prompt_tokens`` (``pooling_params.py`` NOTE 5): a prompt cut to its last
    k tokens classifies as those k tokens do; -1 keeps the last ``max_model_len``, so a text
    longer than the context is classified from its end instead of refused."""
    [(ids, _)] = hf_logits(folders["three"], PROMPTS[3:])
    [cut] = classifier.classify(PROMPTS[3], use_tqdm=False, truncate_prompt_tokens=5)
    [alone] = classifier.classify({"prompt_token_ids": ids[-5:]}, use_tqdm=False)
    assert cut.prompt_token_ids == ids[-5:] and cut.outputs.probs == alone.outputs.probs
    max_len = classifier.engine.scheduler.max_model_len
    long = "x = 1\n" * max_len
    with pytest.raises(ValueError, match=f"more than max_model_len {max_len}"):
        classifier.classify(long, use_tqdm=False)
    [whole] = classifier.classify(long, PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)
    assert len(whole.prompt_token_ids) == max_len
    with pytest.raises(ValueError, match=f"truncate_prompt_tokens={max_len + 1} is more than max_model_len"):
        classifier.classify("x", use_tqdm=False, truncate_prompt_tokens=max_len + 1)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be None, -1 or an int >= 1, got 0"):
        PoolingParams(truncate_prompt_tokens=0)


# -- a causal LM read as a reranker (loader.py NOTE 8) ---------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "llama"])  # tied embeddings, and an LM head of its own
def test_a_causal_lm_read_as_a_two_way_reranker_scores_as_its_softmax(tiny_model_dirs, family):
    """``hf_overrides`` naming a classifier architecture and two tokens (Qwen3-Reranker's
    recipe): the score is the causal LM's next-token softmax over the two, at the second."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_model_dirs[family]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    no, yes = tokenizer.convert_ids_to_tokens([40, 41])
    overrides = {"architectures": [f"{'Qwen3' if family == 'qwen3' else 'Llama'}ForSequenceClassification"],
                 "classifier_from_token": [no, yes], "method": "from_2_way_softmax"}  # fmt: skip
    reranker = LLM(str(folder), hf_overrides=overrides, max_num_batched_tokens=8)
    assert reranker.config.model_config.runner_type == "pooling"
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for output in reranker.score(QUERY, DOCS, use_tqdm=False):
        with torch.no_grad():
            logits = lm(torch.tensor([output.prompt_token_ids])).logits[0, -1]
        assert abs(output.outputs.score - torch.softmax(logits[[40, 41]], dim=-1)[1].item()) < 2e-5
    both = LLM(str(folder), hf_overrides={**overrides, "method": None})  # a label per token, a softmax over them
    [output] = both.classify(QUERY, use_tqdm=False)
    with torch.no_grad():
        logits = lm(torch.tensor([output.prompt_token_ids])).logits[0, -1]
    assert close(output.outputs.probs, torch.softmax(logits[[40, 41]], dim=-1))


def test_hf_overrides_are_checked_and_reach_the_command_line(tiny_model_dirs):
    from tinyvllm import cli
    from tinyvllm.engine.engine_args import EngineArgs

    folder = str(tiny_model_dirs["qwen3"])
    arch = {"architectures": ["Qwen3ForSequenceClassification"]}
    with pytest.raises(ValueError, match="classifier_from_token: 'no such token' is not one token"):
        LLM(folder, hf_overrides={**arch, "classifier_from_token": ["no such token", "x"]})
    with pytest.raises(ValueError, match="from_2_way_softmax takes two tokens"):
        LLM(folder, hf_overrides={**arch, "classifier_from_token": ["x"], "is_original_qwen3_reranker": True})
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        EngineArgs(folder, hf_overrides="{oops").create_engine_config()
    flags = json.dumps({**arch, "classifier_from_token": ["a", "b"], "method": "from_2_way_softmax"})
    args = cli.build_parser().parse_args(["serve", "--model", folder, "--hf-overrides", flags])
    config = EngineArgs.from_cli_args(args).create_engine_config().model_config
    assert config.pooling_model.tasks == ("classify", "score", "token_classify") and config.spec.two_way


def test_a_two_way_head_from_a_bfloat16_checkpoint_is_exact_in_float32():
    """The shipped checkpoint is bfloat16: the head's row is the difference of the two rows
    taken in float32 (the engine's dtype on the CPU), not rounded to bfloat16 first."""
    from tinyvllm.stdlib_tiny import STDLIB_TINY

    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                 "method": "from_2_way_softmax"}  # fmt: skip
    llm = LLM(STDLIB_TINY, hf_overrides=overrides, device="cpu")
    model = llm.engine.model_runner.model
    no, yes = llm.get_tokenizer().convert_tokens_to_ids(["no", "yes"])
    assert torch.equal(model.score.weight[0], model.embed_tokens.weight[yes] - model.embed_tokens.weight[no])
