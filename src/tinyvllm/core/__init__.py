"""The scheduler side of tinyvllm: block hashing, the free queue, the block pool, the KV
cache manager and the scheduler. Pure Python: this package never imports torch,
so every mechanism here runs under Hypothesis at CPU speed (a test enforces it)."""
