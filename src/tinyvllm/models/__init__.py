"""Models: the decoder (Llama / Qwen2 / Qwen3) and loading it from a Hugging Face folder.

``STDLIB_TINY`` is the folder of the small model shipped with the package (trained by
``tinyvllm train-tiny`` on the standard library's sources; see ``train_tiny.py``): the
model ``tinyvllm generate`` and ``LLM()`` use when none is named.
"""

from pathlib import Path

STDLIB_TINY = str(Path(__file__).resolve().parent / "stdlib_tiny")
