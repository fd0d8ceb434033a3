"""Tutorial 14: a reranker, pair by pair (a causal LM read as a cross-encoder).

The shipped model read as Qwen3-Reranker is read: ``hf_overrides`` name a classifier
architecture and the tokens "no" and "yes", with ``from_2_way_softmax``, so the engine builds a
score head of one row, ``w_yes - w_no``, from the LM head's two rows. One query against four
documents, blocks of 4 tokens: each pair is one prompt, the query first, so every pair after
the first finds the query's full blocks in the prefix cache. At the end: each score against
the causal LM's own next-token softmax over "no" and "yes" (transformers), and the ranking
``LLM.score`` gives.

Run it from the repository root: ``python tutorials/14_reranker.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from tinyvllm import LLM, PoolingParams  # noqa: E402
from tinyvllm.stdlib_tiny import STDLIB_TINY  # noqa: E402

torch.set_num_threads(1)
OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "method": "from_2_way_softmax",
}
QUERY = "Does the code answer the question? Say yes or no.\nQuestion: how do I join two paths?\nCode: "
DOCS = ["os.path.join(a, b)", "import json", "Path(a) / b", "print(sum(values))"]


def main() -> None:
    llm = LLM(STDLIB_TINY, hf_overrides=OVERRIDES, device="cpu", block_size=4, seed=0)
    model, tok = llm.engine.model_runner.model, llm.get_tokenizer()
    pooling = llm.config.model_config.pooling_model
    print(f"runner: {llm.config.model_config.runner_type}, tasks: {pooling.tasks}, labels: {pooling.labels}")
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    rows = model.embed_tokens.weight  # tied embeddings: the LM head's rows
    head = model.score.weight  # [1, hidden]
    print(f"score head: {tuple(head.shape)}, equal to w_yes - w_no: {torch.equal(head[0], rows[yes] - rows[no])}")
    query_len = len(tok(QUERY).input_ids)
    print(f"query: {query_len} tokens, {query_len // 4} full blocks of 4\n")

    print("pair | document            | tokens | found in cache | score")
    print("-----+---------------------+--------+----------------+-------")
    pairs = [tok(QUERY, text_pair=doc).input_ids for doc in DOCS]  # the pair's one prompt
    scores = []
    for i, (doc, ids) in enumerate(zip(DOCS, pairs)):
        [out] = llm.encode({"prompt_token_ids": ids}, PoolingParams(task="score"), use_tqdm=False)
        scores.append(out.outputs.data[0].item())
        print(f"{i:4d} | {doc:19s} | {len(ids):6d} | {out.num_cached_tokens:14d} | {scores[-1]:.4f}")

    ranked = llm.score(QUERY, DOCS, use_tqdm=False)  # the same pairs through LLM.score
    order = sorted(range(len(DOCS)), key=lambda j: -ranked[j].outputs.score)
    print(f"\nLLM.score gives the same scores: {[round(r.outputs.score, 4) for r in ranked] == [round(s, 4) for s in scores]}")
    print("ranking, best first:", ", ".join(repr(DOCS[j]) for j in order))

    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(STDLIB_TINY), dtype=torch.float32).eval()
    with torch.no_grad():
        want = [torch.softmax(lm(torch.tensor([ids])).logits[0, -1, [no, yes]], dim=-1)[1].item() for ids in pairs]
    close = max(abs(a - b) for a, b in zip(scores, want)) < 1e-5
    print(f"each score is the causal LM's p(yes) / (p(no) + p(yes)) (max difference < 1e-5): {close}")


if __name__ == "__main__":
    main()
