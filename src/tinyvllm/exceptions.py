"""The engine's own exceptions, in a module every layer may import.

Concept: ``EngineDeadError`` says that the engine can serve no request any more: its
background task stopped (``engine/async_llm.py``), it was shut down, or a worker process of a
multiprocess executor died or failed in a step (``executor/multiproc_executor.py``). The
executor raises it and the engine's front ends pass it on, so it lives below both: the
executor must not import ``engine/`` (``tests/test_import_layers.py``).

Mirrors: ``vllm/v1/engine/exceptions.py`` (``EngineDeadError``).

Invariants: no imports of tinyvllm or torch; ``engine/async_llm.py`` re-exports the class, so
``from tinyvllm.engine.async_llm import EngineDeadError`` names the same class.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine can serve no request any more (module header); every later call raises it too."""
