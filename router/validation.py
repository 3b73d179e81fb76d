"""Router-only request checks, before any worker work starts. Pure Python, no torch.

The sampling and prompt rules are proto/sampling.py's (SamplingParams validates itself,
check_prompt checks the prompt), shared with the workers; what only the router can check
(which model it serves) is here, raising the same InvalidRequest naming the field.
"""

from __future__ import annotations

from proto.sampling import InvalidRequest


def validate_model(requested: str, served: str) -> None:
    """An empty name means the only served model; any other name must be the served one."""
    if requested and requested != served:
        raise InvalidRequest("model", f"unknown model {requested!r}; this server serves {served!r}")
