"""Errors the engine raises to its callers (CLI, workers). Pure Python.

A client error in a request is proto.sampling.InvalidRequest (shared with the router).
"""


class UserError(Exception):
    """Bad user input outside a request (unknown model, unreadable path, unsupported architecture).

    The CLI prints the message on one line and exits with status 2.
    """


class EngineDeadError(RuntimeError):
    """The engine loop stopped; every pending request fails with this."""

