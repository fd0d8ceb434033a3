"""tinyvllm."""
