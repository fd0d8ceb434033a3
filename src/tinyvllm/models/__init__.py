"""Models: the decoder (Llama / Qwen2 / Qwen3) and loading it from a Hugging Face folder.

The small model shipped with the package, the one ``tinyvllm generate`` and ``LLM()`` use
when none is named, lives one layer up, in ``tinyvllm.stdlib_tiny`` (``STDLIB_TINY``, its
folder, and ``tinyvllm train-tiny``, which trained it): nothing here imports it.
"""
