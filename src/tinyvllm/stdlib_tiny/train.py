"""Train ``stdlib_tiny``: a small Qwen3 model that writes Python, from the standard library.

Concept: no model hub is reachable from the machines this project runs on, yet a learner
wants to see real text come out of the engine. Every Python installation carries a few
megabytes of good Python: the standard library's own ``.py`` sources. This module trains,
on the CPU and from scratch, a byte-level BPE tokenizer and a Qwen3-architecture decoder
on that text, and writes a Hugging Face folder that both transformers and tinyvllm load
as it is. The folder the project ships is this package's own folder
(``src/tinyvllm/stdlib_tiny/``, ``STDLIB_TINY``), made by ``tinyvllm train-tiny``;
``tinyvllm generate`` and ``LLM()`` use it when no model is named. The loss curve's SVG is
drawn by ``plot.py``.

Mirrors: nothing in vLLM (an inference engine does not train). The folder layout is the
one ``save_pretrained`` writes, so any Hugging Face tool reads it.

NOTE 1 (data): every ``.py`` file under the running Python's standard library directory
except tests (``test``/``tests`` folders and ``test_*.py``), GUI and tooling packages
(``idlelib``, ``tkinter``, ``turtledemo``, ``lib2to3``, ``ensurepip``), installed
packages (``site-packages``) and generated tables (``encodings``: one codec table per
file; ``pydoc_data``: 750 kB of help text in a string). Files are joined with
``<|endoftext|>`` between them. The modules in ``HELD_OUT_MODULES`` are never trained on,
not even by the tokenizer: their loss measures how well the model writes code it has not
seen.
NOTE 2 (weights): the model trains in float32 and is stored in bfloat16, which halves the
folder. ``config.json`` still says ``"dtype": "float32"``: transformers then casts the
bfloat16 tensors up to float32 when it loads them, and tinyvllm's loader runs float32 on
the CPU. The cast is exact (every bfloat16 is a float32), so both compute from the same
numbers.
NOTE 3 (schedule): AdamW, a linear warm-up, then a cosine decay to a tenth of the peak
learning rate. The schedule's progress is the larger of ``step / max_steps`` and
``elapsed / budget`` (``--minutes``), so a run on a busy machine still ends on time with
its learning rate decayed; the steps actually taken are recorded.
NOTE 4 (record): beside the weights, ``training.json`` holds the configuration, the data
(Python version, modules trained on and held out, token counts), the time taken, the
held-out loss of the stored weights and the unigram entropy of the held-out tokens;
``loss_curve.json`` and ``loss_curve.svg`` hold the loss curve.
NOTE 5 (seeds): one seed drives the weight initialisation and the choice of training
windows. The tokenizer's training is deterministic on the same text. A run bounded by
``--max-steps`` alone repeats; one cut short by ``--minutes`` stops where the clock says.
NOTE 6 (short windows first): at a fixed number of tokens, many small steps beat a few
large ones here (the model card's table: held-out loss and speed per window shape). So
most of the run trains on windows of ``seq_len`` = 128 tokens; the last
``long_fraction`` of it trains on windows of ``context_len`` = 512 with the same tokens
per step, so the model also learns the positions it will be asked to use
(``max_position_embeddings`` is ``context_len``, and held-out loss is measured on windows
of that length).
NOTE 7 (precision): the weights and AdamW's state stay float32; ``bfloat16`` runs the
forward and backward under ``torch.autocast``, whose matrix products use the CPU's native
bfloat16 instructions (AVX512-BF16 or AMX): faster per step at the same held-out loss
(the model card's table). ``auto`` picks it when the CPU has those instructions and
float32 otherwise, where bfloat16 would only be emulated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
from pathlib import Path

from tinyvllm.models.tiny import EOS_TOKEN, bpe_tokenizer, stdlib_dir
from tinyvllm.stdlib_tiny.plot import loss_curve_svg

# --8<-- [start:held_out]
HELD_OUT_MODULES = (
    "bisect", "calendar", "colorsys", "fnmatch", "fractions", "getopt",
    "glob", "heapq", "queue", "sched", "shlex", "textwrap",
)  # fmt: skip
SKIPPED_DIRS = ("test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
                "site-packages", "dist-packages", "encodings", "pydoc_data", "__pycache__")  # fmt: skip
# --8<-- [end:held_out]

# --8<-- [start:sizes]
SIZES = {
    # name: (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, intermediate_size)
    "test": (32, 1, 2, 1, 16, 64),  # seconds, for the CI test
    "small": (256, 6, 4, 2, 64, 640),  # about 5.7M parameters with a 6k vocabulary (the shipped model)
    "base": (256, 8, 4, 2, 64, 768),  # about 7.9M parameters: 1.4x slower per token
}
# --8<-- [end:sizes]


@dataclasses.dataclass
class TrainConfig:
    """Everything that decides a run (recorded in ``training.json``)."""

    size: str = "small"
    vocab_size: int = 6144
    seq_len: int = 128  # training window (NOTE 6)
    context_len: int = 512  # max_position_embeddings, the held-out windows, the last phase's windows
    long_fraction: float = 0.15  # the last part of the run trains on context_len windows (NOTE 6)
    batch_size: int = 8  # rows of seq_len tokens per step
    max_steps: int = 11000
    minutes: float | None = None  # NOTE 3
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_every: int = 250
    eval_windows: int = 16
    seed: int = 0
    threads: int = 2
    precision: str = "auto"  # "auto", "bfloat16" (autocast) or "float32" (NOTE 7)
    modules: tuple[str, ...] | None = None  # None: the whole standard library (NOTE 1)


# -- data -----------------------------------------------------------------------------------


def module_name(rel: Path) -> str:
    """``json/decoder.py`` -> ``json.decoder``; ``json/__init__.py`` -> ``json``."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def stdlib_sources(root: Path | None = None) -> dict[str, str]:
    """Module name -> source text of every standard-library module kept by NOTE 1, sorted."""
    root = stdlib_dir() if root is None else root
    sources = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIPPED_DIRS for part in rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        try:
            sources[module_name(rel)] = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a file that is not UTF-8 text is not training material
    return sources


def split_sources(sources: dict[str, str], modules: tuple[str, ...] | None = None):
    """(train, held_out): held-out modules are those of ``HELD_OUT_MODULES``; ``modules``
    restricts training to the named ones (each must exist)."""
    held = {name: sources[name] for name in HELD_OUT_MODULES if name in sources}
    if modules is None:
        train = {name: text for name, text in sources.items() if name not in held}
    else:
        missing = [m for m in modules if m not in sources]
        if missing:
            raise ValueError(f"--modules names modules not in the standard library sources: {missing}")
        clash = [m for m in modules if m in held]
        if clash:
            raise ValueError(f"--modules names held-out modules {clash}; they are never trained on")
        train = {name: sources[name] for name in modules}
    if not train:
        raise ValueError("no training modules")
    return train, held


def train_tokenizer(texts: list[str], vocab_size: int):
    """``bpe_tokenizer`` on ``texts`` with ``<|endoftext|>`` as BOS too: ``<|endoftext|>``,
    ``<think>`` and ``</think>`` are ids 0-2."""
    return bpe_tokenizer(texts, vocab_size, bos_token=EOS_TOKEN)


def encode_stream(tokenizer, texts: list[str]):
    """One int64 tensor: every text's ids, each followed by ``<|endoftext|>``."""
    import torch

    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False).input_ids:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def windows(stream, seq_len: int, limit: int | None = None):
    """Non-overlapping windows of ``seq_len`` tokens, (n, seq_len), evenly spread when
    ``limit`` is smaller than their number."""
    n = len(stream) // seq_len
    rows = stream[: n * seq_len].view(n, seq_len)
    if limit is not None and n > limit:
        rows = rows[[i * n // limit for i in range(limit)]]
    return rows


def unigram_entropy(ids) -> float:
    """Entropy in nats of the tokens' own frequencies: the loss of the best model that
    ignores context, fitted to this very text (a baseline that flatters the unigram)."""
    import torch

    counts = torch.bincount(ids.flatten()).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def mean_loss(model, rows, batch: int = 8) -> float:
    """Mean next-token cross-entropy (nats/token) of a causal LM over the windows."""
    import torch

    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            x = rows[i : i + batch]
            logits = model(input_ids=x).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
            )
            total += float(loss)
            count += x[:, 1:].numel()
    return total / count


# -- model and schedule ----------------------------------------------------------------------


def model_config(size: str, vocab_size: int, max_position_embeddings: int, eos_id: int):
    from transformers import Qwen3Config

    hidden, layers, heads, kv_heads, head_dim, inter = SIZES[size]
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def resolve_precision(precision: str) -> str:
    """``"bfloat16"`` or ``"float32"``: ``auto`` is bfloat16 only on a CPU with native support (NOTE 7)."""
    import torch

    if precision not in ("auto", "bfloat16", "float32"):
        raise ValueError(f"precision must be auto, bfloat16 or float32, got {precision!r}")
    if precision != "auto":
        return precision
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "bfloat16" if native else "float32"


def window_shape(cfg: "TrainConfig", done: float) -> tuple[int, int]:
    """(rows, window) of the training batch at progress ``done`` (NOTE 6): ``batch_size``
    windows of ``seq_len`` tokens, then, for the last ``long_fraction`` of the run, windows
    of ``context_len`` tokens holding as many tokens in all (at least one window)."""
    if done < 1.0 - cfg.long_fraction or cfg.context_len <= cfg.seq_len:
        return cfg.batch_size, cfg.seq_len
    return max(1, cfg.batch_size * cfg.seq_len // cfg.context_len), cfg.context_len


def learning_rate(cfg: TrainConfig, step: int, progress: float) -> float:
    """Warm-up over ``warmup_steps``, then cosine from ``lr`` to ``lr * min_lr_ratio`` as
    ``progress`` goes from 0 to 1 (NOTE 3)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


# -- training ----------------------------------------------------------------------------------


def train(out_dir: str | Path, cfg: TrainConfig, progress: bool = True) -> dict:
    """Train the tokenizer and the model, write the folder (NOTE 2, NOTE 4); return the record."""
    import torch
    import tokenizers
    import transformers
    from tqdm import tqdm
    from transformers import GenerationConfig, Qwen3ForCausalLM

    if cfg.size not in SIZES:
        raise ValueError(f"unknown size {cfg.size!r}; choose one of {sorted(SIZES)}")
    for name in ("vocab_size", "seq_len", "context_len", "batch_size", "max_steps", "eval_every", "eval_windows", "threads"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if not 0.0 <= cfg.long_fraction <= 1.0:
        raise ValueError(f"long_fraction must be in [0, 1], got {cfg.long_fraction}")
    precision = resolve_precision(cfg.precision)
    start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)

    train_src, held_src = split_sources(stdlib_sources(), cfg.modules)
    tokenizer = train_tokenizer(list(train_src.values()), cfg.vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    train_ids = encode_stream(tokenizer, list(train_src.values()))
    held_ids = encode_stream(tokenizer, list(held_src.values()))
    held_rows = windows(held_ids, cfg.context_len)
    eval_rows = windows(held_ids, cfg.context_len, cfg.eval_windows)
    longest = max(cfg.seq_len, cfg.context_len)
    if len(train_ids) <= longest or len(held_rows) == 0:
        raise ValueError(f"too little text for windows of {longest} tokens")

    config = model_config(cfg.size, len(tokenizer), longest, eos_id)
    model = Qwen3ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=cfg.betas,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(cfg.seed)
    curve: dict = {"step": [], "train_loss": [], "lr": [], "eval": []}
    budget = None if cfg.minutes is None else cfg.minutes * 60
    train_start, cpu_start = time.perf_counter(), time.process_time()
    bar = tqdm(total=cfg.max_steps, desc="train-tiny", disable=not progress, file=sys.stderr)
    step = 0
    tokens_seen = 0
    held_loss = None
    while True:
        elapsed = time.perf_counter() - train_start
        done = max(step / cfg.max_steps, 0.0 if budget is None else elapsed / budget)  # NOTE 3
        if done >= 1.0:
            break
        lr = learning_rate(cfg, step, done)
        for group in opt.param_groups:
            group["lr"] = lr
        rows, window = window_shape(cfg, done)  # NOTE 6
        starts = torch.randint(0, len(train_ids) - window, (rows,), generator=gen)
        x = torch.stack([train_ids[s : s + window] for s in starts.tolist()])  # [rows, window]
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):  # NOTE 7
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        tokens_seen += x.numel()
        curve["step"].append(step)
        curve["train_loss"].append(round(loss.item(), 4))
        curve["lr"].append(float(f"{lr:.6g}"))
        if step % cfg.eval_every == 0:
            held_loss = mean_loss(model, eval_rows)
            curve["eval"].append({"step": step, "held_out_loss": round(held_loss, 4)})
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", held_out="-" if held_loss is None else f"{held_loss:.3f}")
    bar.close()
    train_seconds = time.perf_counter() - train_start
    cpu_seconds = time.process_time() - cpu_start
    if not curve["eval"] or curve["eval"][-1]["step"] != step:
        curve["eval"].append({"step": step, "held_out_loss": round(mean_loss(model, eval_rows), 4)})

    # Store in bfloat16, declare float32 (NOTE 2).
    loss_float32 = mean_loss(model, held_rows)
    model.to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    config_path = out / "config.json"
    saved = json.loads(config_path.read_text())
    saved["dtype"] = "float32"
    saved.pop("torch_dtype", None)
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))

    stored = Qwen3ForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    loss_stored = mean_loss(stored, held_rows)
    unigram = unigram_entropy(held_rows)
    record = {
        "command": "tinyvllm train-tiny " + " ".join(_flags(cfg)) + " OUT_DIR",
        "config": dataclasses.asdict(cfg),
        "model": {
            "architecture": "Qwen3ForCausalLM",
            "parameters": n_params,
            "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "intermediate_size": config.intermediate_size,
            "vocab_size": config.vocab_size,
            "max_position_embeddings": config.max_position_embeddings,
            "tie_word_embeddings": True,
            "stored_dtype": "bfloat16",
        },
        "data": {
            "python_version": platform.python_version(),
            "python_implementation": platform.python_implementation(),
            "skipped_dirs": list(SKIPPED_DIRS),
            "skipped_files": "test_*.py",
            "held_out_modules": list(held_src),
            "train_modules": list(train_src),
            "train_characters": sum(len(t) for t in train_src.values()),
            "train_tokens": len(train_ids),
            "held_out_tokens": int(held_rows.numel()),
            "tokens_seen": tokens_seen,
        },
        "time": {
            "steps": step,
            "train_seconds": round(train_seconds, 1),
            "train_cpu_seconds": round(cpu_seconds, 1),
            "total_seconds": round(time.perf_counter() - start, 1),
            "threads": cfg.threads,
            "precision": precision,
            "machine": platform.machine(),
        },
        "results": {
            "final_train_loss": curve["train_loss"][-1],
            "held_out_loss_float32": round(loss_float32, 4),
            "held_out_loss": round(loss_stored, 4),
            "held_out_unigram_entropy": round(unigram, 4),
            "held_out_ratio": round(loss_stored / unigram, 4),
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "loss_curve.json").write_text(json.dumps(curve) + "\n")
    (out / "loss_curve.svg").write_text(loss_curve_svg(curve, unigram))
    return record


# -- command line -------------------------------------------------------------------------------

DESCRIPTION = (
    "Train a small Qwen3-architecture model from scratch, on the CPU, on the Python standard "
    "library's own sources, and write it as a Hugging Face folder (weights, tokenizer, "
    "generation config) that transformers and tinyvllm load, with its training record "
    "(training.json) and loss curve (loss_curve.json, loss_curve.svg)."
)


def _flags(cfg: TrainConfig) -> list[str]:
    default = TrainConfig()
    flags = []
    for field in dataclasses.fields(TrainConfig):
        value = getattr(cfg, field.name)
        if value != getattr(default, field.name) and field.name != "betas":
            shown = ",".join(value) if field.name == "modules" else value
            flags.append(f"--{field.name.replace('_', '-')} {shown}")
    return flags


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("out_dir", metavar="OUT_DIR", help="the folder to write (created if missing)")
    p.add_argument("--size", default=d.size, choices=sorted(SIZES), help=f"model shape (default {d.size})")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len, help=f"training window (default {d.seq_len}; NOTE 6)")
    p.add_argument("--context-len", type=int, default=d.context_len,
                   help=f"max_position_embeddings, held-out and last-phase window (default {d.context_len})")
    p.add_argument("--long-fraction", type=float, default=d.long_fraction,
                   help=f"last part of the run on context-len windows (default {d.long_fraction})")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help=f"windows of seq-len per step (default {d.batch_size})")
    p.add_argument("--max-steps", type=int, default=d.max_steps)
    p.add_argument("--minutes", type=float, default=None, help="stop after this many minutes of training")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-windows", type=int, default=d.eval_windows)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    p.add_argument("--precision", default=d.precision, choices=("auto", "bfloat16", "float32"),
                   help="bfloat16 autocast or float32 (default auto: bfloat16 where the CPU has it natively; NOTE 7)")
    p.add_argument("--modules", default=None, help="comma-separated modules to train on (default: all; NOTE 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    modules = None if args.modules is None else tuple(m.strip() for m in args.modules.split(",") if m.strip())
    return TrainConfig(
        size=args.size, vocab_size=args.vocab_size, seq_len=args.seq_len, context_len=args.context_len,
        long_fraction=args.long_fraction, batch_size=args.batch_size, max_steps=args.max_steps,
        minutes=args.minutes, lr=args.lr, warmup_steps=args.warmup_steps, eval_every=args.eval_every,
        eval_windows=args.eval_windows, seed=args.seed, threads=args.threads, precision=args.precision,
        modules=modules,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    record = train(args.out_dir, config_from_args(args), progress=not args.no_progress)
    r = record["results"]
    print(
        f"{args.out_dir}: {record['model']['parameters']:,} parameters, {record['time']['steps']} steps in "
        f"{record['time']['train_seconds']:.0f} s; held-out loss {r['held_out_loss']:.3f} nats/token, "
        f"unigram entropy {r['held_out_unigram_entropy']:.3f} (ratio {r['held_out_ratio']:.2f})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tinyvllm.stdlib_tiny.train", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
