"""Entry points over the network: the OpenAI-compatible server (``tinyvllm serve``), its request models, its metrics."""
