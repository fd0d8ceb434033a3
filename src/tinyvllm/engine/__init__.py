"""The engine: ``LLMEngine`` (one step = schedule, execute, update), ``LLM`` on top, ``AsyncLLM`` for concurrent callers, and the incremental detokenizer."""
