"""Outputs of the public API, for a bit-identical check across the issue-37 refactor."""
import json, sys, tempfile
from pathlib import Path
import torch
torch.set_num_threads(1)
from tinyvllm import LLM, SamplingParams
from tinyvllm.models.tiny import build_tiny_model
from tinyvllm.stdlib_tiny import STDLIB_TINY

prompts = ["def main(", "import os\nimport sys\n", "class Parser:\n    def", "the quick brown fox " * 6]
params = {
    "greedy": SamplingParams(max_tokens=24, temperature=0.0, logprobs=2),
    "seeded": SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=20, seed=7, logprobs=1),
    "pen": SamplingParams(max_tokens=24, temperature=0.7, seed=3, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, min_tokens=4),
    "n2": SamplingParams(max_tokens=16, temperature=1.0, seed=11, n=2, stop=["\n\n"]),
}
out = {}
root = Path(tempfile.mkdtemp())
models = {"stdlib": STDLIB_TINY, **{f: str(build_tiny_model(root / f, f)) for f in ("qwen3", "qwen2", "llama")}}
for name, model in models.items():
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}):
        llm = LLM(model, num_gpu_blocks_override=256, max_model_len=256, speculative_config=spec, block_size=16)
        for pname, p in params.items():
            if spec is not None and pname == "pen":
                pass
            res = llm.generate(prompts, p, use_tqdm=False)
            key = f"{name}/{'spec' if spec else 'plain'}/{pname}"
            out[key] = [[(c.text, list(c.token_ids), c.finish_reason,
                          None if c.logprobs is None else [{str(k): (v.logprob, v.rank) for k, v in d.items()} for d in c.logprobs])
                         for c in r.outputs] for r in res]
        del llm
json.dump(out, open(sys.argv[1], "w"), sort_keys=True)
print(len(out), "cases")
