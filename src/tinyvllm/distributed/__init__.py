"""Tensor parallelism's process group and the arithmetic of splitting a model over it."""
