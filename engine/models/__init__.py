"""Model definitions (own forward passes over the paged KV cache)."""
