"""The worker side (torch): the persistent input batch, attention metadata, KV cache memory and the model runner."""
