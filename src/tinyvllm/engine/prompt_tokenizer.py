"""PromptTokenizer: prompts are tokenized on a thread of their own, by a tokenizer of their own.

Concept: turning a prompt into token ids, or rendering a chat template, takes time that
grows with the text: about 6 s for 10 MB on two CPU cores. On the engine's only thread
that time would stop every other request's stream. So ``AsyncLLM`` tokenizes on a second
single thread, with a second copy of the tokenizer, and a text that certainly cannot fit
the context is refused before any tokenizing (NOTE 2).

Mirrors: vLLM's API server tokenizes in the server process while the engine core runs
in another, through a tokenizer run in a thread pool (``serving_engine.py``,
``AsyncMicrobatchTokenizer``).

Invariants: ``self.tokenizer`` is used by the tokenizer thread alone (and by the caller
only before serving starts); ``encode`` refuses, naming the prompt's index, a prompt of
more than ``max_model_len`` tokens, with the same message the input processor gives.

NOTE 1 (one copy per thread): a Hugging Face fast tokenizer must not be used by two
threads at once (its Rust object is borrowed mutably by each call that sets truncation
or padding: "Already borrowed"). The engine's thread keeps the ``LLM``'s tokenizer for
detokenizing; this thread gets a ``copy.deepcopy`` of it, made when the ``AsyncLLM`` is
built (a chat template set on the ``LLM``'s tokenizer before that is copied too). The
Rust tokenizer releases the GIL while it encodes, so the event loop and the engine's
thread keep running while a long prompt is tokenized.
NOTE 2 (too long, without tokenizing): for a byte-level BPE tokenizer (a ``ByteLevel``
pre-tokenizer, no normalizer, every one of the 256 byte symbols in the vocabulary), every
byte of the text goes into exactly one token, and no token holds more bytes than the
longest vocabulary entry (measured once: a byte-level entry has one symbol per byte, an
added token such as ``<|endoftext|>`` its UTF-8 length). A text of
more than ``max_model_len * longest`` bytes therefore has more than ``max_model_len``
tokens, and is refused at once. GPT-2, Llama 3, the shipped model and the tests' tiny
models qualify; a tokenizer with a normalizer (Qwen's NFC, which can shorten a text) is
always tokenized in full, still on this thread.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def max_token_bytes(tokenizer) -> int | None:
    """The longest vocabulary entry in UTF-8 bytes when the text bound applies (NOTE 2), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None or backend.pre_tokenizer is None:
        return None
    state = json.loads(backend.pre_tokenizer.__getstate__())
    steps = state.get("pretokenizers", [state]) if state.get("type") == "Sequence" else [state]
    if not any(step.get("type") == "ByteLevel" for step in steps):
        return None
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = tokenizer.get_vocab()
    if not set(ByteLevel.alphabet()) <= vocab.keys():  # a byte with no token would vanish from the text
        return None
    added = tokenizer.get_added_vocab()  # literal strings, matched in the text as they are
    return max(len(token.encode("utf-8")) if token in added else len(token) for token in vocab)  # one symbol, one byte


class PromptTokenizer:
    """A tokenizer copy and the one thread that uses it (NOTE 1)."""

    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = copy.deepcopy(tokenizer)
        self.max_model_len = max_model_len
        self.max_token_bytes = max_token_bytes(self.tokenizer)  # None: no bound without tokenizing (NOTE 2)
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="tinyvllm-tokenizer")

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the tokenizer thread. RuntimeError after ``shutdown``."""
        if self._executor is None:
            raise RuntimeError("the tokenizer thread is shut down")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- what runs on the tokenizer thread ------------------------------------------------

    # --8<-- [start:encode]
    def encode(self, text: str, add_special_tokens: bool = True, index: int = 0, limit: bool = True) -> list[int]:
        """``text``'s token ids; with ``limit``, a ValueError for more than ``max_model_len`` of them,
        before tokenizing when the text bound says so (NOTE 2)."""
        if limit:
            self.check_text(text, index)
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        if limit:
            self.check_length(len(ids), index)
        return ids
    # --8<-- [end:encode]

    def check_text(self, text: str, index: int = 0) -> None:
        """ValueError when ``text`` certainly has more than ``max_model_len`` tokens (NOTE 2)."""
        if self.max_token_bytes is None or len(text) <= self.max_model_len:  # a char is at least one byte
            return
        n_bytes = len(text.encode("utf-8", errors="surrogatepass"))
        if n_bytes > self.max_model_len * self.max_token_bytes:
            at_least = -(-n_bytes // self.max_token_bytes)
            raise ValueError(
                f"prompt {index} has at least {at_least} tokens ({n_bytes} bytes, at most {self.max_token_bytes} "
                f"per token), more than max_model_len {self.max_model_len}"
            )

    def check_length(self, n_tokens: int, index: int = 0) -> None:
        if n_tokens > self.max_model_len:
            raise ValueError(f"prompt {index} has {n_tokens} tokens, more than max_model_len {self.max_model_len}")

    def shutdown(self) -> None:
        """Stop the thread; a tokenization in flight finishes on its own, unawaited."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
