"""pdserve bench compare: benchmark JSON files side by side. (not built yet)."""

import typer


def command() -> None:
    """pdserve bench compare: benchmark JSON files side by side."""
    raise typer.Exit(1)
