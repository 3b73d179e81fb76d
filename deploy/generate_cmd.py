"""pdserve generate: offline generation with the bundled model. (not built yet)."""

import typer


def command() -> None:
    """pdserve generate: offline generation with the bundled model."""
    raise typer.Exit(1)
