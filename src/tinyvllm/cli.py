"""The ``tinyvllm`` command (also ``python -m tinyvllm``).

``tinyvllm generate --model DIR --prompt TEXT [...]`` prints the completion, then one line
of figures: prompt and generated tokens, seconds, generated tokens per second, and
prompt tokens served from the prefix cache. ``--cudagraph-mode`` and ``--enforce-eager``
choose how the model runs under CUDA graphs, as vLLM's ``--compilation-config`` and
``--enforce-eager`` do. ``tinyvllm tiny-model DIR`` writes a tiny
random-weight model folder (for trying the engine with no download).
"""

from __future__ import annotations

import argparse
import sys
import time

# The five CUDAGraphMode names (worker/cudagraph_dispatcher.py), spelled out so that
# `tinyvllm --help` does not import the engine.
MODE_NAMES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt")
    p.add_argument("--model", required=True, help="a local Hugging Face model folder")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "reference"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument(
        "--cudagraph-mode", default=None, choices=MODE_NAMES,
        help="CUDA graphs (default: FULL_AND_PIECEWISE on CUDA, NONE on the CPU, where other modes are emulated)",
    )  # fmt: skip
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (cudagraph mode NONE)")


def _generate(args) -> int:
    from tinyvllm import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    llm = LLM(
        args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, attention_backend=args.attention_backend,
        num_gpu_blocks_override=args.num_gpu_blocks_override, enforce_eager=args.enforce_eager,
        compilation_config={"cudagraph_mode": args.cudagraph_mode} if args.cudagraph_mode else None,
    )
    start = time.perf_counter()
    [out] = llm.generate(args.prompt, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    completion = out.outputs[0]
    print(completion.text)
    n = len(completion.token_ids)
    print(
        f"[tinyvllm] prompt {len(out.prompt_token_ids)} tokens, generated {n} tokens in {seconds:.3f} s "
        f"({n / seconds:.1f} tok/s), cached {out.num_cached_tokens} tokens, finish_reason={completion.finish_reason}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tinyvllm", description="tinyvllm: a teaching implementation of vLLM V1")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    tiny = sub.add_parser("tiny-model", help="write a tiny random-weight model folder")
    tiny.add_argument("folder")
    tiny.add_argument("--family", default="qwen3", choices=["qwen3", "qwen2", "llama"])
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        from tinyvllm.models.tiny import build_tiny_model

        print(build_tiny_model(args.folder, args.family))
        return 0
    except ValueError as e:
        print(f"tinyvllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
