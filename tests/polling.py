"""Waiting for a condition in async tests: poll it instead of sleeping a fixed time and asserting,
so a loaded host (CI) gets the whole bound, and a quick one does not wait it out."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import pytest


async def until(pred: Callable[[], bool], timeout_s: float, what: str = "condition") -> float:
    """Seconds until pred() holds (checked every 20 ms); fails the test after timeout_s."""
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"{what}: not met in {timeout_s}s")
        await asyncio.sleep(0.02)
    return time.monotonic() - start
