"""Tutorial 06: generate text with ``LLM`` from a Hugging Face folder, and check it against
transformers.

Run: ``PYTHONPATH=src python tutorials/06_generate.py`` (CPU only; about ten seconds).

1. Build a tiny Qwen3 model in a temporary folder: a real Hugging Face folder
   (config.json, model.safetensors, a byte-level BPE tokenizer) with RANDOM weights, so
   the text it writes is gibberish by construction.
2. ``LLM(folder, device="cpu")`` and greedy ``generate`` on four prompts, three of which
   share a long prefix: the later ones find its blocks in the prefix cache
   (``num_cached_tokens``).
3. transformers' ``generate`` on the same folder, one prompt at a time, greedy: the token
   ids must be the same (the central test, ``tests/test_generate.py``, does this for three
   architectures and every engine path).

The printed token ids depend on the tokenizer, whose BPE training is not bit-reproducible
across ``tokenizers`` builds, so this script has no golden output; the test checks its
key lines instead (``tests/test_tutorial_06_generate.py``).
"""

import os
import tempfile

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.models.tiny import build_tiny_model  # noqa: E402

SHARED_PREFIX = (
    "import string\n"
    "import textwrap\n"
    "\n"
    "def wrap(text, width=70):\n"
    '    """Wrap a paragraph of text."""\n'
)
PROMPTS = [
    "def hello():\n",
    SHARED_PREFIX + "    return textwrap.fill(text, width)\n",
    SHARED_PREFIX + "    lines = []\n",
    SHARED_PREFIX + "    if not text:\n",
]
MAX_TOKENS = 12


def transformers_greedy(model, prompt_token_ids: list[int]) -> list[int]:
    """transformers' greedy continuation of one prompt (EOS from generation_config.json)."""
    with torch.no_grad():
        seq = model.generate(
            torch.tensor([prompt_token_ids]),
            attention_mask=torch.ones(1, len(prompt_token_ids), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return seq[0, len(prompt_token_ids) :].tolist()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(build_tiny_model(os.path.join(tmp, "tiny-qwen3"), "qwen3"))
        print("model: tiny Qwen3 with RANDOM weights (its text is gibberish by construction)")
        print(f"files: {sorted(os.listdir(folder))}")

        # block_size 4 so that a short shared prefix already fills whole blocks.
        llm = LLM(folder, device="cpu", max_model_len=256, block_size=4)
        print(f"KV cache: {llm.config.cache_config.num_gpu_blocks} blocks of {llm.config.cache_config.block_size} tokens")
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)  # greedy
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)

        first = outputs[1].prompt_token_ids  # the first prompt with the shared prefix
        for out in outputs:
            completion = out.outputs[0]
            shared = next((i for i, (a, b) in enumerate(zip(first, out.prompt_token_ids)) if a != b), len(first))
            print(f"\nrequest {out.request_id}: prompt of {len(out.prompt_token_ids)} tokens ending {out.prompt[-24:]!r}")
            if out is not outputs[1]:
                print(f"  shares {shared} leading prompt tokens with request {outputs[1].request_id}")
            print(f"  token_ids         {completion.token_ids}")
            print(f"  text              {completion.text!r}")
            print(f"  num_cached_tokens {out.num_cached_tokens}")
            print(f"  finish_reason     {completion.finish_reason}")

        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        theirs = [transformers_greedy(hf_model, out.prompt_token_ids) for out in outputs]
        ours = [out.outputs[0].token_ids for out in outputs]
        print("\nrequests 2 and 3 reuse the whole blocks of the prefix that request 1 computes in the same")
        print("step (a hit is whole blocks only, so num_cached_tokens is a multiple of the block size)")
        print(f"matches transformers: {ours == theirs}")


if __name__ == "__main__":
    main()
