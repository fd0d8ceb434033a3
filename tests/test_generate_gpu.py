# --8<-- [start:criterion]
"""The engine on a GPU (``gpu`` marker; skipped without CUDA): the Triton backend against
transformers' generate from the same folder.

float32: token-for-token identical, as on the CPU (transformers' matmuls run in true fp32
by default, our kernels use IEEE fp32 dots).

bfloat16 — the criterion and why: with 8-bit mantissas, our kernels and transformers'
round differently, so two greedy paths can split at a near-tie and never rejoin; exact
equality would test rounding, not correctness. We require that wherever the two paths first
split, the first token included, the two candidate tokens are a near-tie in the float32
model's logits (within 2% of the logit range), i.e. a place where the rounding of either
engine could legitimately decide. The first token gets no exemption: our first step runs
every prompt in one batch and transformers runs each alone, and cuBLAS tiles different
GEMM shapes differently, so a near-tie can flip at position 0 too.
"""
# --8<-- [end:criterion]

import functools

import pytest
import torch

from tinyvllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[(31 * i + 7) % 500 + 3 for i in range(n)] for n in (5, 17, 40, 63, 100)]
PROMPTS.append(PROMPTS[3][:30] + [11, 12, 13])  # shares a prefix with the 63-token prompt
NEW_TOKENS = 16


def _hf(folder, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).cuda().eval()
    model.generation_config.eos_token_id = None
    return model


def _hf_greedy(model, ids):
    with torch.no_grad():
        seq = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"))
    return seq[0, len(ids):].tolist()


@functools.cache
def hf_float32_greedy(folder) -> list[list[int]]:
    """transformers' greedy tokens for every prompt, once per model (three configurations of
    ours compare with them)."""
    model = _hf(folder, torch.float32)
    return [_hf_greedy(model, p) for p in PROMPTS]


def _ours(folder, dtype, **kw):
    # max_num_seqs=8: the six prompts fit, and start-up captures graphs for 5 sizes, not 51
    # (the GPU check's pytest step has 150 s for every gpu test)
    llm = LLM(str(folder), dtype=dtype, device="cuda", max_model_len=256, attention_backend="triton",
              gpu_memory_utilization=0.3, max_num_seqs=8, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                          use_tqdm=False)]


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("kw", [{}, {"enable_prefix_caching": False}, {"max_num_batched_tokens": 32}])
def test_gpu_generate_float32_matches_transformers(tiny_model_dirs, family, kw):
    folder = tiny_model_dirs[family]
    assert _ours(folder, "float32", **kw) == hf_float32_greedy(folder)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_gpu_generate_bfloat16_agrees_up_to_near_ties(tiny_model_dirs, family):
    folder = tiny_model_dirs[family]
    hf16, ref32 = _hf(folder, torch.bfloat16), _hf(folder, torch.float32)
    ours = _ours(folder, "bfloat16")
    for prompt, mine in zip(PROMPTS, ours):
        theirs = _hf_greedy(hf16, prompt)
        split = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if split is None:
            continue
        with torch.no_grad():
            logits = ref32(torch.tensor([prompt + mine[:split]], device="cuda")).logits[0, -1].float()
        gap = abs(logits[mine[split]] - logits[theirs[split]]).item()
        spread = (logits.max() - logits.min()).item()
        assert gap <= 0.02 * spread, (
            f"a prompt of {len(prompt)} tokens: paths split at step {split} on a gap of {gap:.4f} (range {spread:.2f})"
        )
