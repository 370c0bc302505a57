"""Speculative decoding in the engine: asking proposers for tokens, verifying them in one target pass, and adapting
how many each request proposes (see :mod:`rtxcore.contracts.proposer` for the method)."""
