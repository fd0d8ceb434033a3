"""Tiny random-weight models for tests, tutorials and the README: real Hugging Face folders.

Concept: build, offline and deterministically, a small Qwen3, Qwen2 or Llama checkpoint
(config.json, model.safetensors, generation_config.json) plus a byte-level BPE
tokenizer trained on text every Python install has (a few standard-library sources).
The weights are random: the text they generate is gibberish, which is fine for checking
that an engine computes what transformers computes.

Mirrors: nothing in vLLM (its tests download real checkpoints; we cannot, and a fake of
the right shape checks the same arithmetic).

NOTE 1 (peaked logits): the weights are drawn with a larger ``initializer_range`` than
transformers' default, so the next-token distribution is not nearly flat and greedy
choices are not decided by rounding noise.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

TINY_FAMILIES = ("qwen3", "qwen2", "llama")
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<think>", "</think>"]
_CORPUS_FILES = ("textwrap.py", "string.py", "shlex.py", "difflib.py", "heapq.py")


def stdlib_dir() -> Path:
    """The running Python's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus() -> list[str]:
    """Source text of a few standard-library modules, present on every Python."""
    return [(stdlib_dir() / name).read_text(encoding="utf-8") for name in _CORPUS_FILES]


def bpe_tokenizer(texts: list[str], vocab_size: int, bos_token: str | None = None):
    """A byte-level BPE tokenizer (transformers' fast tokenizer) trained on ``texts``, with
    ``SPECIAL_TOKENS`` as ids 0-2 and ``<|endoftext|>`` as EOS and padding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=bos_token, pad_token=EOS_TOKEN)


# The SentencePiece-style tokenizer families (as Hugging Face's converters write them):
# "llama2": Llama 2, TinyLlama, Mistral v0.1: a BPE with byte fallback (<0x00>..<0xFF>), a
#   normalizer that turns spaces into "▁" and prepends one, and the decoder
#   Replace("▁", " ") -> ByteFallback -> Fuse -> Strip(one leading space).
# "metaspace": T5, ALBERT and other Unigram models: the Metaspace pre-tokenizer and
#   decoder (each "▁" is a space; the first token's is dropped), no byte fallback.
SENTENCEPIECE_STYLES = ("llama2", "metaspace")
SPM_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def sentencepiece_tokenizer(texts: list[str], vocab_size: int, style: str = "llama2"):
    """A SentencePiece-style tokenizer (transformers' fast tokenizer) trained on ``texts``:
    ``<unk>``, ``<s>``, ``</s>`` are ids 0-2 and, for ``"llama2"``, the 256 byte tokens
    ``<0x00>``..``<0xFF>`` ids 3-258, as in Llama 2's vocabulary."""
    import json

    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if style == "llama2":
        normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(Regex(" "), "▁")])
        trained = Tokenizer(models.BPE(unk_token="<unk>"))
        trained.normalizer = normalizer
        trained.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")  # "▁def", as Llama's
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPM_SPECIAL_TOKENS, show_progress=False)
        trained.train_from_iterator(texts, trainer=trainer)
        model = json.loads(trained.to_str())["model"]
        vocab = {token: i for i, token in enumerate(SPM_SPECIAL_TOKENS + [f"<0x{b:02X}>" for b in range(256)])}
        for token in sorted(model["vocab"], key=model["vocab"].get):
            vocab.setdefault(token, len(vocab))
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tok.normalizer = normalizer
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    elif style == "metaspace":
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        trainer = trainers.UnigramTrainer(
            vocab_size=vocab_size, special_tokens=SPM_SPECIAL_TOKENS, unk_token="<unk>", show_progress=False
        )
        tok.train_from_iterator(texts, trainer=trainer)
    else:
        raise ValueError(f"unknown sentencepiece style {style!r}; choose one of {SENTENCEPIECE_STYLES}")
    tok.add_special_tokens(SPM_SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def train_tokenizer(folder: str | Path, vocab_size: int = 512) -> None:
    """Train a byte-level BPE tokenizer on the corpus and save it in transformers' format."""
    bpe_tokenizer(stdlib_corpus(), vocab_size).save_pretrained(str(folder))


def tiny_config(family: str, vocab_size: int, **overrides):
    """A transformers config of the family with small shapes (GQA ratio 2)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.1,  # NOTE 1
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=0,
    )
    common.update(overrides)
    if family == "qwen3":
        return Qwen3Config(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common)
    if family == "qwen2":
        return Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common)
    if family == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        common["tie_word_embeddings"] = overrides.get("tie_word_embeddings", False)
        return LlamaConfig(rope_parameters=rope, **common)
    raise ValueError(f"unknown tiny model family {family!r}; choose one of {TINY_FAMILIES}")


def build_tiny_model(
    folder: str | Path,
    family: str = "qwen3",
    seed: int = 0,
    vocab_size: int = 512,
    tokenizer: str = "byte_level",
    num_labels: int | None = None,
    **overrides,
) -> Path:
    """Write a tiny random ``family`` model and its tokenizer into ``folder``; return it.

    ``tokenizer`` is ``"byte_level"`` (the default: byte-level BPE, EOS id 0) or one of
    ``SENTENCEPIECE_STYLES`` (EOS ``</s>``, id 2); the model's vocabulary grows to hold every
    token id of the tokenizer. ``num_labels``: a ``*ForSequenceClassification`` model with that
    many labels (a ``score`` head in place of the LM head) instead of a causal LM."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {TINY_FAMILIES}")
    if tokenizer not in ("byte_level", *SENTENCEPIECE_STYLES):
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose 'byte_level' or one of {SENTENCEPIECE_STYLES}")
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    eos_token_id = 0
    if tokenizer == "byte_level":
        train_tokenizer(path, vocab_size)
    else:
        tok = sentencepiece_tokenizer(stdlib_corpus(), vocab_size, tokenizer)
        tok.save_pretrained(str(path))
        vocab_size, eos_token_id = max(vocab_size, len(tok)), tok.eos_token_id
    if num_labels is not None:
        overrides = {"num_labels": num_labels, **overrides}
    config = tiny_config(family, vocab_size, **{"eos_token_id": eos_token_id, **overrides})
    torch.manual_seed(seed)
    auto = AutoModelForCausalLM if num_labels is None else AutoModelForSequenceClassification
    model = auto.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(path), safe_serialization=True)
    GenerationConfig(eos_token_id=eos_token_id, bos_token_id=None).save_pretrained(str(path))
    return path
