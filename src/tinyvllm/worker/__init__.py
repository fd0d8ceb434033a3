"""The worker side (torch): the persistent input batch and, later, the model runner."""
