"""Shared test helpers: tiny models and GGUF writers."""
