"""Tutorial 09: the shipped model, ``stdlib_tiny``: what it is, how well it learned, and
what it writes.

Run: ``PYTHONPATH=src python tutorials/09_stdlib_tiny.py`` (CPU only; a few seconds).

1. Read the training record the folder carries (``training.json``): the shape, the
   data, the time, the held-out loss against the unigram baseline.
2. Five completions, greedy, by the engine (``LLM()`` with no model loads this one).
   Each stops at ``<|endoftext|>`` or after 48 tokens.

Greedy decoding on shipped weights and a shipped tokenizer: the output is the same on
every run, so the model card embeds it (``docs/generated/09_stdlib_tiny.txt``) and a test
compares the two. Regenerate it with ``python tutorials/regenerate_golden.py 08``.
"""

import json
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.stdlib_tiny import STDLIB_TINY  # noqa: E402

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_python_files(root):\n",
    "class Stack:\n    def __init__(self):\n",
    "    def __repr__(self):\n",
    "if __name__ == '__main__':\n",
]


def main() -> None:
    with open(os.path.join(STDLIB_TINY, "training.json"), encoding="utf-8") as f:
        record = json.load(f)
    model, data, time, results = record["model"], record["data"], record["time"], record["results"]
    print("the training record (training.json):")
    print(
        f"  {model['architecture']}: {model['parameters']:,} parameters, {model['num_hidden_layers']} layers, "
        f"hidden size {model['hidden_size']}, vocabulary {model['vocab_size']}, context {model['max_position_embeddings']}"
    )
    print(
        f"  data: Python {data['python_version']} standard library, {len(data['train_modules'])} modules, "
        f"{data['train_tokens']:,} tokens; {data['tokens_seen']:,} tokens seen in training"
    )
    print(f"  held out: {', '.join(data['held_out_modules'])} ({data['held_out_tokens']:,} tokens)")
    print(f"  time: {time['steps']} steps in {time['train_seconds'] / 60:.1f} minutes on {time['threads']} CPU threads")
    print(
        f"  held-out loss {results['held_out_loss']:.3f} nats/token; unigram entropy {results['held_out_unigram_entropy']:.3f}; "
        f"ratio {results['held_out_ratio']:.2f}"
    )

    llm = LLM(device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=48)
    print("\nfive greedy completions (prompt, then the model's text):")
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        completion = out.outputs[0]
        print(f"\n--- {len(completion.token_ids)} tokens, finish_reason {completion.finish_reason}")
        for line in (prompt + completion.text).splitlines():
            print(f"| {line}")


if __name__ == "__main__":
    main()
