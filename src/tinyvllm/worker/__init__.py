"""The worker side (torch): the persistent input batch, attention metadata and, later, the model runner."""
