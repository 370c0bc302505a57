"""Model descriptions and weight sources (GGUF files, Hugging Face directories, random weights)."""
