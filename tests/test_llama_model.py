"""The decoder against transformers on the same tiny folders, through the paged KV cache.

Every case fills the caches with NaN first, so a read of a slot nobody wrote (a wrong block
id, a wrong slot, an off-by-one in seq_lens) turns the logits into NaN and fails. Block ids
are shuffled and interleaved between requests, so nothing depends on contiguous blocks."""

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tinyvllm.models.llama import compute_inv_freq, kv_cache_shape, load_model
from tinyvllm.models.tiny import TINY_FAMILIES, build_tiny_model
from tinyvllm.worker.attention_metadata import build_attention_metadata

ATOL = 1e-4
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: TRITON_INTERPRET=1 (conftest.py)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    return {fam: build_tiny_model(root / fam, fam) for fam in TINY_FAMILIES}


@pytest.fixture(scope="module")
def hf_models(folders):
    from transformers import AutoModelForCausalLM

    return {fam: AutoModelForCausalLM.from_pretrained(str(f), dtype=torch.float32).eval() for fam, f in folders.items()}


def hf_logits(hf_model, token_ids) -> torch.Tensor:
    """transformers' logits at every position of one full sequence: [T, V]."""
    with torch.inference_mode():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def new_caches(model, num_blocks, block_size, device="cpu"):
    shape = kv_cache_shape(model.spec, num_blocks, block_size)
    return [torch.full(shape, float("nan"), device=device) for _ in range(model.spec.num_hidden_layers)]


def run_step(model, caches, token_ids, num_computed, num_scheduled, block_ids, block_size, pad=0, device="cpu"):
    """One engine-like step: the scheduled tokens of each request back to back -> logits of
    every row [N, V] and the rows of each request's last token."""
    ids = [t for toks, c, n in zip(token_ids, num_computed, num_scheduled) for t in toks[c : c + n]]
    meta = build_attention_metadata(
        num_computed, num_scheduled, block_ids, block_size, num_padded_tokens=len(ids) + pad, device=device
    )
    input_ids = torch.tensor(ids + [0] * pad, device=device)
    with torch.inference_mode():
        hidden = model(input_ids, meta.positions, caches, meta)
        return model.compute_logits(hidden).cpu(), meta.logits_indices.cpu()


def prompt(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_full_prefill_matches_transformers_at_every_position(folders, hf_models, family):
    model = load_model(folders[family])
    tokens = prompt(21, seed=1)
    caches = new_caches(model, num_blocks=9, block_size=4)
    blocks = [6, 1, 8, 3, 0, 5]  # 21 tokens need 6 blocks of 4, in no particular order
    logits, _ = run_step(model, caches, [tokens], [0], [21], [blocks], block_size=4)
    assert logits.dtype == torch.float32 and logits.shape == (21, 512)
    torch.testing.assert_close(logits, hf_logits(hf_models[family], tokens), atol=ATOL, rtol=0)
    unused = [b for b in range(9) if b not in blocks]
    assert all(c[:, unused].isnan().all() for c in caches), "the forward wrote outside the request's blocks"


@pytest.mark.seed("002:opening", "003:memory")
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_chunked_prefill_and_decode_in_one_batch_match_transformers(folders, hf_models, family):
    model = load_model(folders[family])
    a, b = prompt(16, seed=2), prompt(13, seed=3)  # full sequences; a's prompt is 13, b's 6
    ref_a, ref_b = hf_logits(hf_models[family], a), hf_logits(hf_models[family], b)
    block_size = 4
    block_ids = [[9, 2, 7, 4], [5, 0, 10, 1]]  # interleaved between the two requests
    caches = new_caches(model, num_blocks=11, block_size=block_size)
    # (num_computed, num_scheduled) per step: a is prefilled in chunks of 8 and 5, then
    # decodes; b is prefilled in one step, then decodes alone after a finishes.
    steps = [
        ([0, 0], [8, 6]),
        ([8, 6], [5, 1]),
        ([13, 7], [1, 1]),
        ([14, 8], [1, 1]),
        ([None, 9], [None, 1]),
        ([None, 10], [None, 1]),
        ([None, 11], [None, 1]),
    ]
    for computed, scheduled in steps:
        live = [r for r in range(2) if scheduled[r] is not None]
        logits, rows = run_step(
            model, caches, [[a, b][r] for r in live], [computed[r] for r in live], [scheduled[r] for r in live],
            [block_ids[r] for r in live], block_size,
        )  # fmt: skip
        for row, r in zip(rows.tolist(), live):
            last = computed[r] + scheduled[r] - 1
            torch.testing.assert_close(
                logits[row], [ref_a, ref_b][r][last], atol=ATOL, rtol=0, msg=lambda m: f"request {r} pos {last}: {m}"
            )


def test_triton_backend_prefill_and_decode_match_transformers(folders, hf_models):
    model = load_model(folders["qwen3"], device=TRITON_DEVICE, attention_backend="triton")
    assert model.attention_backend == "triton"
    tokens = prompt(22, seed=4)
    ref = hf_logits(hf_models["qwen3"], tokens)
    caches = new_caches(model, num_blocks=4, block_size=16, device=TRITON_DEVICE)
    blocks = [[3, 1]]
    logits, _ = run_step(model, caches, [tokens], [0], [20], blocks, 16, device=TRITON_DEVICE)
    torch.testing.assert_close(logits, ref[:20], atol=ATOL, rtol=0)
    for pos in (20, 21):
        logits, _ = run_step(model, caches, [tokens], [pos], [1], blocks, 16, device=TRITON_DEVICE)
        torch.testing.assert_close(logits[0], ref[pos], atol=ATOL, rtol=0)


def test_padding_rows_change_nothing(folders):
    model = load_model(folders["qwen2"])
    tokens = [prompt(7, seed=5), prompt(5, seed=6)]
    blocks = [[0, 3], [2, 1]]
    plain_caches, padded_caches = new_caches(model, 4, 4), new_caches(model, 4, 4)
    plain, _ = run_step(model, plain_caches, tokens, [0, 0], [7, 5], blocks, 4)
    padded, rows = run_step(model, padded_caches, tokens, [0, 0], [7, 5], blocks, 4, pad=4)
    assert padded.shape == (16, 512) and rows.tolist() == [6, 11]
    # Not bit-exact in general: a matmul over 16 rows may block differently from one over 12.
    torch.testing.assert_close(padded[:12], plain, atol=1e-5, rtol=0)
    for p, q in zip(plain_caches, padded_caches):  # NaN where unwritten: padding wrote no slot
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, equal_nan=True)
    # and a decode step on top of the padded prefill still matches the unpadded one
    plain, _ = run_step(model, plain_caches, [t + [9] for t in tokens], [7, 5], [1, 1], blocks, 4)
    padded, _ = run_step(model, padded_caches, [t + [9] for t in tokens], [7, 5], [1, 1], blocks, 4, pad=6)
    torch.testing.assert_close(padded[:2], plain, atol=1e-5, rtol=0)


def test_load_model_dtype_tied_weights_and_float32_rotary(folders):
    model = load_model(folders["qwen3"], dtype=torch.bfloat16)
    assert model.lm_head.weight is model.embed_tokens.weight  # tie survives the meta -> device move
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in model.parameters())
    assert model.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(model.rotary.inv_freq, compute_inv_freq(model.spec))
    assert not model.training
    llama = load_model(folders["llama"])
    assert llama.lm_head.weight is not llama.embed_tokens.weight  # the tiny llama is untied
    hidden = torch.zeros(3, model.spec.hidden_size, dtype=torch.bfloat16)
    assert model.compute_logits(hidden).dtype == torch.float32


@pytest.mark.seed("003:memory")
def test_kv_cache_shape(folders):
    model = load_model(folders["qwen3"])
    assert kv_cache_shape(model.spec, 10, 16) == (2, 10, 16, 2, 16)
    with pytest.raises(ValueError, match="num_blocks = 0"):
        kv_cache_shape(model.spec, 0, 16)


def test_load_model_rejects_an_unknown_backend(folders):
    with pytest.raises(ValueError, match="'flash'"):
        load_model(folders["qwen3"], attention_backend="flash")


def _rewrite_weights(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_load_model_names_a_tensor_of_the_wrong_shape(folders, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    folder = _rewrite_weights(folders["qwen2"], tmp_path / "bad", lambda t: t.update({name: t[name][:, :63].clone()}))
    with pytest.raises(ValueError, match=rf"{name}.*\(128, 63\).*\(128, 64\)"):
        load_model(folder)


def test_load_model_names_a_missing_tensor(folders, tmp_path):
    name = "model.layers.0.self_attn.k_proj.bias"
    folder = _rewrite_weights(folders["qwen2"], tmp_path / "bad", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name):
        load_model(folder)


def test_load_model_rejects_a_tensor_it_would_ignore(folders, tmp_path):
    name = "model.layers.0.self_attn.o_proj.bias"  # attention_bias on o_proj: not supported
    folder = _rewrite_weights(folders["llama"], tmp_path / "bad", lambda t: t.update({name: torch.zeros(64)}))
    with pytest.raises(ValueError, match=name):
        load_model(folder)


def test_forward_rejects_inputs_that_disagree_with_the_metadata(folders):
    model = load_model(folders["qwen3"])
    meta = build_attention_metadata([0], [4], [[0]], 4)
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long), new_caches(model, 1, 4), meta)
    with pytest.raises(ValueError, match="kv_caches has 1"):
        model(meta.positions, meta.positions, new_caches(model, 1, 4)[:1], meta)


def test_llama3_rope_scaling_is_applied(folders):
    spec = load_model(folders["llama"]).spec
    assert spec.rope_scaling is not None
    plain = compute_inv_freq(spec.__class__(**{**spec.__dict__, "rope_scaling": None}))
    scaled = compute_inv_freq(spec)
    # high frequencies untouched, the lowest divided by the factor, the band between blended
    assert scaled[0] == plain[0]
    torch.testing.assert_close(scaled[-1], plain[-1] / spec.rope_scaling.factor)
    assert plain[1] / spec.rope_scaling.factor < scaled[1] < plain[1]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])
def test_compute_logits_small_batches_use_the_column_copy_and_agree(folders, rows):
    """NOTE 6 of models/llama.py: up to three rows on the CPU go through a column-major copy
    of the LM head; the logits equal the Linear path's to float rounding."""
    model = load_model(folders["qwen3"])
    hidden = torch.randn(rows, model.spec.hidden_size, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
        expected = model.lm_head(hidden).float()
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert hasattr(model, "_columns") == (rows <= 3)


def test_compute_logits_column_copy_follows_a_changed_weight(folders):
    model = load_model(folders["llama"])
    hidden = torch.randn(1, model.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    before = model.compute_logits(hidden)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # an in-place change: the copy is remade
    torch.testing.assert_close(model.compute_logits(hidden), 2 * before, atol=1e-5, rtol=1e-5)


def test_torch_backend_plans_once_per_forward(folders, monkeypatch):
    """NOTE 8: the torch backend's host-side plan is made once per step for all layers,
    and the logits equal the reference backend's."""
    from tinyvllm.attention import torch_sdpa

    calls = []
    real = torch_sdpa.plan_step
    monkeypatch.setattr(torch_sdpa, "plan_step", lambda *a: calls.append(1) or real(*a))
    logits = {}
    for backend in ("torch", "reference"):
        model = load_model(folders["qwen3"], attention_backend=backend)
        assert model.spec.num_hidden_layers > 1
        caches = new_caches(model, 16, 4)
        tokens = [prompt(9, 1), prompt(5, 2)]
        logits[backend], _ = run_step(model, caches, tokens, [0, 0], [9, 5], [[3, 0, 7], [5, 1]], 4)
        assert len(calls) == 1  # the reference backend has no plan
    torch.testing.assert_close(logits["torch"], logits["reference"], atol=ATOL, rtol=1e-4)


def test_triton_backend_plans_its_launch_once_per_forward(folders, monkeypatch):
    """triton_attention NOTE 4 / llama NOTE 8: the launch plan (checks, tiles, grid, buffers)
    is made once per step and every layer launches with it; the logits equal the reference's."""
    from tinyvllm.attention import triton_attention

    plans, launches = [], []
    real_plan, real_attention = triton_attention.plan_step, triton_attention.paged_attention
    monkeypatch.setattr(triton_attention, "plan_step", lambda *a, **k: plans.append(1) or real_plan(*a, **k))
    model = load_model(folders["qwen3"], device=TRITON_DEVICE, attention_backend="triton")
    assert model.spec.num_hidden_layers > 1
    for layer in model.layers:
        attn = layer.self_attn
        attn.backend = dataclasses.replace(
            attn.backend, paged_attention=lambda *a, **k: launches.append(k["plan"]) or real_attention(*a, **k)
        )
    tokens = [prompt(9, 1), prompt(5, 2)]
    caches = new_caches(model, 4, 16, device=TRITON_DEVICE)
    logits, _ = run_step(model, caches, tokens, [0, 0], [9, 5], [[3], [1]], 16, pad=2, device=TRITON_DEVICE)
    assert len(plans) == 1 and len(launches) == model.spec.num_hidden_layers
    assert all(plan is launches[0] for plan in launches) and launches[0].num_tokens == 16  # 14 tokens + 2 padding
    reference = load_model(folders["qwen3"], device=TRITON_DEVICE)
    expected, _ = run_step(reference, new_caches(reference, 4, 16, device=TRITON_DEVICE), tokens, [0, 0], [9, 5],
                           [[3], [1]], 16, pad=2, device=TRITON_DEVICE)  # fmt: skip
    torch.testing.assert_close(logits[:14], expected[:14], atol=ATOL, rtol=1e-4)
