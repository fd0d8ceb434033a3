"""The worker side of tinyvllm: torch tensors, attention metadata, the model runner."""
