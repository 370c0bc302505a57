"""Limits and delays every protocol applies alike."""

# Most inputs one request may carry (prompts of a completion, inputs of an embedding): one request runs as one batch
# of engine work, and a huge one would hold up every stream.
MAX_BATCH = 256
# Seconds a client is told to wait before retrying when the server is full, loading or draining.
RETRY_AFTER_S = 1
