"""pdserve bench engine: prefill tokens/s and decode ms/step, ours vs transformers. (not built yet)."""

import typer


def command() -> None:
    """pdserve bench engine: prefill tokens/s and decode ms/step, ours vs transformers."""
    raise typer.Exit(1)
