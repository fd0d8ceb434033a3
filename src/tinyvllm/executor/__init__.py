"""The executor: how the engine reaches its worker(s) (``Executor``, the one-process ``UniProcExecutor``)."""
