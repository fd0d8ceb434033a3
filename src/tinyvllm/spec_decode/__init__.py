"""Speculative decoding: draft proposers (``ngram_proposer.py``)."""
