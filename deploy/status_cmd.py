"""pdserve status: workers with their KV usage and queues. (not built yet)."""

import typer


def command() -> None:
    """pdserve status: workers with their KV usage and queues."""
    raise typer.Exit(1)
