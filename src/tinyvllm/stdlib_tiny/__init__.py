"""The shipped model, ``stdlib_tiny``: its folder, how it was trained, its loss curve.

Concept: tinyvllm carries one small trained model so that ``tinyvllm generate``,
``tinyvllm serve`` and ``LLM()`` have something real to run when no model is named. This
package owns it. Its folder is the Hugging Face folder itself (``config.json``,
``model.safetensors``, the tokenizer, ``generation_config.json``, ``chat_template.jinja``)
plus the training record (``training.json``, ``loss_curve.json``, ``loss_curve.svg``);
``train.py`` is ``tinyvllm train-tiny``, which wrote it; ``plot.py`` draws the loss curve.

Mirrors: nothing in vLLM (it runs checkpoints from the hub; it ships none).

Invariant: importing this package imports nothing but ``pathlib``: the engine and the CLI
read ``STDLIB_TINY`` for their default model without loading torch or the training code,
which only ``tinyvllm train-tiny`` imports (``tests/test_import_layers.py``).

NOTE 1 (code beside the data): the folder holds this package's ``.py`` files too. Every
reader of a model folder opens the files it names (``config.json``, ``*.safetensors``, the
tokenizer files), so the Python files are never read as part of the model, and the
wheel's package data ships the data files (``pyproject.toml``) beside the modules.
"""

from pathlib import Path

STDLIB_TINY = str(Path(__file__).resolve().parent)
