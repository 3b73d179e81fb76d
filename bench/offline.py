"""pdserve bench offline: continuous vs static batching throughput. (not built yet)."""

import typer


def command() -> None:
    """pdserve bench offline: continuous vs static batching throughput."""
    raise typer.Exit(1)
