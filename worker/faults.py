"""Fault hooks in a worker's engine, for tests: an engine step that wedges on demand.

``WorkerConfig.engine_wedge_file`` (ClusterSpec's too) names a path, ``{worker_id}`` replaced by
the worker's id. When it is set, the engine's step is wrapped once at start: before each step,
while a file exists at that path, the engine thread waits (polling every ``POLL_S``). To the
worker the step is in progress: its gRPC server keeps answering (Stats reports the requests
running and waiting, and ``engine_steps`` stands still), Aborts and new requests queue behind the
step, nothing is computed — an engine wedged inside one step, as a hung kernel or a deadlocked
collective would leave it. Removing the file lets the step run. Unset (the default), nothing is
wrapped: the hot path is untouched.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger(__name__)

POLL_S = 0.05


def wedge_path(template: str, worker_id: str) -> str:
    return template.replace("{worker_id}", worker_id)


def install_step_wedge(async_engine, path: str) -> bool:
    """Wrap ``async_engine.engine.step`` (an AsyncEngine's LLMEngine) to wait while ``path`` exists;
    False when the engine has no such step (a test double)."""
    engine = getattr(async_engine, "engine", None)
    step = getattr(engine, "step", None)
    if step is None:
        return False

    def wedgeable_step():
        if os.path.exists(path):
            log.warning("engine step wedged while %s exists (test fault)", path)
            while os.path.exists(path):
                time.sleep(POLL_S)
        return step()

    engine.step = wedgeable_step
    return True
