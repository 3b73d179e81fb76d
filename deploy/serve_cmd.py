"""pdserve serve: start the router and workers on Ray. (not built yet)."""

import typer


def command() -> None:
    """pdserve serve: start the router and workers on Ray."""
    raise typer.Exit(1)
