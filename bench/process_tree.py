"""A server's process tree, labelled and totalled by label: what bench peers' memory sampler
(bench/peers.py RssSampler) and CPU window (bench/cpu_usage.py) both walk every 0.25 s."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable


def process_tree(root) -> list:
    """``root`` (a psutil.Process) and all its descendants; [] once root is gone."""
    import psutil

    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def label_totals(pairs: Iterable[tuple[str, float]]) -> list[tuple[str, int, float]]:
    """(label, value) per process -> (label, processes, summed value), largest sum first."""
    totals: dict[str, list] = {}
    for label, value in pairs:
        entry = totals.setdefault(label, [0, 0])
        entry[0] += 1
        entry[1] += value
    return sorted(((k, n, v) for k, (n, v) in totals.items()), key=lambda x: -x[2])


def process_label(name: str, cmdline: list[str]) -> str:
    """A short label for a server's process: Ray's process titles as they are ("ray::WorkerActor",
    "raylet"), a Python process by its module (-m X) or script file, anything else by its name."""
    if not name.startswith("python") or name.startswith("ray::"):
        return name
    args = cmdline[1:]
    for i, a in enumerate(args):
        if a == "-m" and i + 1 < len(args):
            return args[i + 1]
        if a.endswith(".py"):
            return Path(a).name
    return name
