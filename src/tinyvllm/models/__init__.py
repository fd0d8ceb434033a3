"""Models: the decoder (Llama / Qwen2 / Qwen3) and loading it from a Hugging Face folder."""
