"""Tutorial 06: generate with ``LLM`` from a Hugging Face folder, watch the prefix cache at
work, and check every token against transformers.

Run: ``PYTHONPATH=src python tutorials/06_generate.py`` (CPU only; about ten seconds).

1. Build a tiny Qwen3 model in a temporary folder: a real Hugging Face folder
   (config.json, model.safetensors, a byte-level BPE tokenizer) with RANDOM weights, so
   the text it writes is gibberish by construction.
2. Text in, text out: ``generate`` on a text prompt. The prompt goes through the folder's
   tokenizer and the completion comes back as token ids and as text.
3. Four prompts given as token ids, greedy, in one ``generate`` call. Three share a
   30-token prefix: the later ones find its blocks in the prefix cache
   (``num_cached_tokens``). A second call repeats one of them and hits every full block
   the cache may serve.
4. transformers' ``generate`` on the same folder, one prompt at a time, greedy, EOS
   ignored: the token ids must be the same (the central test, ``tests/test_generate.py``,
   does this for three architectures and every engine path).

The output is the same on every machine, so the docs embed it
(``docs/generated/06_generate.txt``) and a test compares the two. That is why the script
prints no token ids and no text: the tokenizer is trained when the folder is built, and
its ids differ between ``tokenizers`` builds and Python versions (the training text is
the standard library's source). Step 3's prompts are token ids, so their lengths and
cache hits do not depend on the tokenizer; every request asks for exactly ``MAX_TOKENS``
tokens (``ignore_eos``), so no count depends on the random weights. What the script
prints about ids and text is whether they agree: with the tokenizer, and with
transformers. Regenerate it with ``python tutorials/regenerate_golden.py 06``.
"""

import os
import tempfile

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.models.tiny import build_tiny_model  # noqa: E402

BLOCK_SIZE = 4  # small, so that a short shared prefix already fills whole blocks
MAX_TOKENS = 12
TEXT_PROMPT = "def hello():\n"
SHARED_PREFIX = [(37 * i + 11) % 500 + 5 for i in range(30)]  # 7 full blocks of 4, and 2 tokens
ID_PROMPTS = [
    [401, 402, 403, 404, 405],  # shares nothing
    SHARED_PREFIX + [300, 301, 302, 303],
    SHARED_PREFIX + [77, 78],
    SHARED_PREFIX + [(7 * i) % 400 + 50 for i in range(9)],
]
FOLDER_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]


def yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def transformers_greedy(model, prompt_token_ids: list[int]) -> list[int]:
    """transformers' greedy continuation of one prompt: exactly MAX_TOKENS tokens."""
    with torch.no_grad():
        seq = model.generate(
            torch.tensor([prompt_token_ids]),
            attention_mask=torch.ones(1, len(prompt_token_ids), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return seq[0, len(prompt_token_ids) :].tolist()


def shared_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(build_tiny_model(os.path.join(tmp, "tiny-qwen3"), "qwen3"))
        print("model: tiny Qwen3 with RANDOM weights (its text is gibberish by construction)")
        present = [name for name in FOLDER_FILES if os.path.exists(os.path.join(folder, name))]
        print(f"a Hugging Face folder with {', '.join(present)}")

        llm = LLM(folder, device="cpu", max_model_len=256, block_size=BLOCK_SIZE)
        cache = llm.config.cache_config
        print(f"KV cache: {cache.num_gpu_blocks} blocks of {cache.block_size} tokens")
        # Greedy, and exactly MAX_TOKENS tokens each: EOS does not stop a request.
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

        print(f"\ntext in, text out: generate({TEXT_PROMPT!r})")
        [text_out] = llm.generate(TEXT_PROMPT, params, use_tqdm=False)
        tokenizer = llm.get_tokenizer()
        completion = text_out.outputs[0]
        print(f"  prompt_token_ids are the tokenizer's encoding of the prompt: {yes(text_out.prompt_token_ids == tokenizer(TEXT_PROMPT).input_ids)}")
        print(f"  {len(completion.token_ids)} new tokens, finish_reason {completion.finish_reason}")
        print(f"  text is the tokenizer's decoding of token_ids: {yes(completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True))}")

        print("\nfour prompts as token ids in one generate() call, then request 2's prompt again:")
        outputs = llm.generate([{"prompt_token_ids": p} for p in ID_PROMPTS], params, use_tqdm=False)
        outputs += llm.generate([{"prompt_token_ids": ID_PROMPTS[1]}], params, use_tqdm=False)
        first = outputs[1]  # the first prompt with the shared prefix
        print("  request | prompt tokens | shared with request 2 | num_cached_tokens | new tokens | finish_reason")
        for out in outputs:
            shared = "-" if out is first else str(shared_length(first.prompt_token_ids, out.prompt_token_ids))
            print(
                f"  {out.request_id:>7} | {len(out.prompt_token_ids):13} | {shared:>21} | {out.num_cached_tokens:17} | "
                f"{len(out.outputs[0].token_ids):10} | {out.outputs[0].finish_reason}"
            )

        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        hf_model.generation_config.eos_token_id = None  # like ignore_eos: exactly MAX_TOKENS tokens
        everything = [text_out, *outputs]
        theirs = [transformers_greedy(hf_model, out.prompt_token_ids) for out in everything]
        ours = [out.outputs[0].token_ids for out in everything]
        print(f"\ntoken ids equal transformers' greedy generate for all {len(everything)} requests: {yes(ours == theirs)}")


if __name__ == "__main__":
    main()
