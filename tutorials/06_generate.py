"""Tutorial 06: generate with ``LLM`` on the shipped model, watch the prefix cache serve a
shared file header, and check every token against transformers.

Run: ``PYTHONPATH=src python tutorials/06_generate.py`` (CPU only; about half a minute).

1. ``LLM()`` with no model loads the small model shipped with the package
   (``stdlib_tiny``: a Qwen3 trained on the standard library's sources).
2. Text in, text out: ``generate`` on a text prompt. The prompt goes through the
   folder's tokenizer and the completion comes back as token ids and as text.
3. Six prompts that start with the same real file header (a license comment and the
   same imports), then a different ``def`` line each, greedy, in one ``generate`` call.
   The later ones find the header's full blocks in the prefix cache
   (``num_cached_tokens``); the script prints each hit and the hit rate, then the same
   prompts on an engine with prefix caching off: the same text, nothing cached.
4. transformers' ``generate`` on the same folder, one prompt at a time, greedy, EOS
   ignored: the token ids must be the same (the central test, ``tests/test_generate.py``,
   does this for three architectures and every engine path).

Greedy decoding on shipped weights and a shipped tokenizer: the output is the same on
every run, so the docs embed it (``docs/generated/06_generate.txt``) and a test compares
the two. Regenerate it with ``python tutorials/regenerate_golden.py 06``.
"""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.stdlib_tiny import STDLIB_TINY  # noqa: E402

MAX_TOKENS = 40
TEXT_PROMPT = "def fibonacci(n):\n"
HEADER = '''# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0

"""Helpers for reading configuration files."""

import os
import re
import sys

'''
FUNCTIONS = [
    "def read_config(path):\n",
    "def parse_line(line):\n",
    "class ConfigError(Exception):\n",
    "def find_files(root, pattern):\n",
    "def main(argv=None):\n",
    "def split_words(text):\n",
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
            repetition_penalty=1.0,  # plain greedy, as our SamplingParams(temperature=0): not the model's default
            eos_token_id=None,
            pad_token_id=0,
        )
    return seq[0, len(prompt_token_ids) :].tolist()


def main() -> None:
    llm = LLM(device="cpu", max_model_len=512)
    present = [name for name in FOLDER_FILES if os.path.exists(os.path.join(STDLIB_TINY, name))]
    print("model: stdlib_tiny, the small Qwen3 shipped with tinyvllm (trained on Python's standard library)")
    print(f"a Hugging Face folder with {', '.join(present)}")
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
    print("  the prompt and its completion:")
    for line in (TEXT_PROMPT + completion.text).splitlines():
        print(f"  | {line}")

    prompts = [HEADER + f for f in FUNCTIONS]
    header_tokens = len(tokenizer(HEADER).input_ids)
    print(f"\nsix prompts: the same {header_tokens}-token file header, then a different def line each")
    outputs = llm.generate(prompts, params, use_tqdm=False)
    print("  request | prompt tokens | num_cached_tokens | first line of the completion")
    for out in outputs:
        first_line = out.outputs[0].text.strip("\n").split("\n")[0]
        print(f"  {out.request_id:>7} | {len(out.prompt_token_ids):13} | {out.num_cached_tokens:17} | {first_line!r}")
    cached = sum(out.num_cached_tokens for out in outputs)
    total = sum(len(out.prompt_token_ids) for out in outputs)
    print(f"  prompt tokens served from the cache: {cached} of {total} ({100 * cached / total:.0f}%)")

    no_cache = LLM(device="cpu", max_model_len=512, enable_prefix_caching=False)
    plain = no_cache.generate(prompts, params, use_tqdm=False)
    same = [a.outputs[0].token_ids for a in outputs] == [b.outputs[0].token_ids for b in plain]
    print(f"  with prefix caching off: same text {yes(same)}, cached tokens {sum(o.num_cached_tokens for o in plain)}")

    print(f"\nrequest {outputs[0].request_id} in full:")
    for line in (FUNCTIONS[0] + outputs[0].outputs[0].text).splitlines():
        print(f"  | {line}")

    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(STDLIB_TINY).eval()
    everything = [text_out, *outputs]
    theirs = [transformers_greedy(hf_model, out.prompt_token_ids) for out in everything]
    ours = [out.outputs[0].token_ids for out in everything]
    print(f"\ntoken ids equal transformers' greedy generate for all {len(everything)} requests: {yes(ours == theirs)}")


if __name__ == "__main__":
    main()
