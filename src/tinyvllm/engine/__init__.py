"""The engine: ``LLMEngine`` (one step = schedule, execute, update) and ``LLM`` on top."""
