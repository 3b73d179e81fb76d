"""pdserve bench serve: serving benchmark against pdserve or any OpenAI-compatible server. (not built yet)."""

import typer


def command() -> None:
    """pdserve bench serve: serving benchmark against pdserve or any OpenAI-compatible server."""
    raise typer.Exit(1)
