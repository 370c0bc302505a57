"""Built-in authenticators: API keys, JWT bearer tokens, TLS client certificates."""
