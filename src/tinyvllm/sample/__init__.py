"""Sampling (seed 001): batch updates, logits processors, the thinking budget, the sampler."""
