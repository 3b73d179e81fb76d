"""Quality evaluations of the runtime (perplexity)."""
