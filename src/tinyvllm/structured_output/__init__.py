"""Structured outputs: a grammar per request, a token mask per step (vLLM's ``v1/structured_output/``).

Concept: ``backend_xgrammar.py`` turns a request's ``StructuredOutputsParams`` into a compiled
grammar and a matcher; ``request.py`` is one request's grammar state; ``manager.py`` compiles off
the step's thread, keeps the cache and builds each step's bitmask; ``bitmask.py`` is the worker's
half, which applies the mask to the logits. Only the engine side imports xgrammar, and only when a
request asks for a constraint, so the package imports without it.
"""
