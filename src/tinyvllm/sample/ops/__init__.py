"""Shared sampling ops (vLLM's ``vllm/v1/sample/ops/``): the tensor functions more than one
module of ``sample/`` uses, so that none of them imports the sampler to reach one."""
