"""pdserve bench kv-transfer: GiB/s of each KV transport vs memcpy, and overlap. (not built yet)."""

import typer


def command() -> None:
    """pdserve bench kv-transfer: GiB/s of each KV transport vs memcpy, and overlap."""
    raise typer.Exit(1)
