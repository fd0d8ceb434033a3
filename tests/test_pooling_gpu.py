"""The pooling engine on a GPU (``gpu`` marker; skipped without CUDA): its default graphs
(PIECEWISE, seed 000's rule for pooling models) and the Triton backend against transformers'
base model on the same device, float32 and bfloat16, through chunked prefill and the prefix
cache; a classifier's label scores likewise. The CPU twins are ``tests/test_pooling.py``'s and
``tests/test_classification.py``'s."""

import pytest
import torch

from tinyvllm import LLM
from tinyvllm.config import CUDAGraphMode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[(31 * i + 7) % 500 + 3 for i in range(n)] for n in (5, 17, 40, 63, 100)]
PROMPTS.append(PROMPTS[3][:48] + [11, 12, 13])  # shares three blocks with the 63-token prompt


def hf_last_normalised(folder, dtype) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(folder), dtype=dtype).cuda().eval()
    with torch.no_grad():
        states = [model(torch.tensor([ids], device="cuda")).last_hidden_state[0, -1].float() for ids in PROMPTS]
    return [torch.nn.functional.normalize(s, dim=-1).cpu() for s in states]


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_pooling_on_cuda_matches_transformers(tiny_model_dirs, dtype, tol):
    folder = tiny_model_dirs["qwen3"]
    llm = LLM(str(folder), device="cuda", dtype=dtype, runner="pooling", max_num_batched_tokens=64, max_num_seqs=8)
    try:
        assert llm.startup_report.cudagraph_mode == CUDAGraphMode.PIECEWISE.name
        outputs = llm.encode([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
        reference = hf_last_normalised(folder, getattr(torch, dtype))
        for output, ref in zip(outputs, reference):
            assert (output.outputs.data - ref).abs().max().item() < tol
        assert outputs[-1].num_cached_tokens == 48  # LAST pooling reads the prefix cache
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_a_classifier_on_cuda_matches_transformers(tmp_path, dtype, tol):
    """A three-label classifier's softmax on CUDA (PIECEWISE graphs, Triton attention) against
    transformers' ``AutoModelForSequenceClassification`` on the same device and dtype."""
    from transformers import AutoModelForSequenceClassification

    from tinyvllm.models.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path / "cls", "qwen3", num_labels=3)
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=getattr(torch, dtype)).cuda().eval()
    with torch.no_grad():
        reference = [torch.softmax(model(torch.tensor([ids], device="cuda")).logits[0].float(), -1).cpu() for ids in PROMPTS]
    llm = LLM(str(folder), device="cuda", dtype=dtype, max_num_batched_tokens=64, max_num_seqs=8)  # runner "auto": pooling
    try:
        outputs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
        for output, ref in zip(outputs, reference):
            assert (torch.tensor(output.outputs.probs) - ref).abs().max().item() < tol
    finally:
        llm.shutdown()


def test_cls_pooling_on_cuda_graphs_keeps_its_first_row(tiny_model_dirs):
    """CLS in float32 under the default PIECEWISE graphs, prompts longer than the token budget:
    the first chunk's row must outlive the graph replays of the chunks after it (pooler.py
    NOTE 4), so the vectors equal transformers' first hidden states."""
    from transformers import AutoModel

    folder = tiny_model_dirs["qwen3"]
    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        reference = [model(torch.tensor([ids], device="cuda")).last_hidden_state[0, 0].cpu() for ids in PROMPTS]
    llm = LLM(str(folder), device="cuda", dtype="float32", runner="pooling", max_num_batched_tokens=16,
              pooler_config={"pooling_type": "CLS", "normalize": False})  # fmt: skip
    try:
        outputs = llm.encode([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
        for output, ref in zip(outputs, reference):
            assert (output.outputs.data - ref).abs().max().item() < 1e-4
    finally:
        llm.shutdown()


def test_token_tasks_on_cuda_graphs_keep_every_row_or_the_tagged_ones(tmp_path):
    """``reward`` (``token_classify``) on CUDA under the default PIECEWISE graphs, prompts longer
    than the token budget: every row equals transformers' head on its decoder's hidden states,
    and with a step tag (``pooling_params.py`` NOTE 6) the rows kept are those at the tag, copied
    out of the graph's buffer before the next replay rewrites it (``pooler.py`` NOTE 4, 6)."""
    from transformers import AutoModelForSequenceClassification

    from tinyvllm import PoolingParams
    from tinyvllm.models.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path / "prm", "qwen3", num_labels=2)
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32).cuda().eval()
    tag = PROMPTS[2][5]  # a token of the 40-token prompt; wherever it occurs, a step ends
    with torch.no_grad():
        reference = [torch.softmax(model.score(model.model(torch.tensor([ids], device="cuda")).last_hidden_state[0]), -1).cpu()
                     for ids in PROMPTS]  # fmt: skip
    llm = LLM(str(folder), device="cuda", dtype="float32", max_num_batched_tokens=16, max_num_seqs=8)
    try:
        inputs = [{"prompt_token_ids": p} for p in PROMPTS]
        every = llm.reward(inputs, use_tqdm=False)
        tagged = llm.reward(inputs, PoolingParams(step_tag_id=tag), use_tqdm=False)
        for prompt, whole, out, ref in zip(PROMPTS, every, tagged, reference):
            at = [i for i, t in enumerate(prompt) if t == tag]
            assert (whole.outputs.data - ref).abs().max().item() < 1e-4
            assert out.outputs.data.shape == (len(at), 2) and torch.allclose(out.outputs.data, ref[at], atol=1e-4)
        assert tagged[2].outputs.data.shape[0] >= 1
    finally:
        llm.shutdown()
