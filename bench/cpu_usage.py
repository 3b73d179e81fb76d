"""Where the CPU went during a measurement: CPU seconds of a server's processes (by label), of the
benchmark's own process (the client), and of everything else on the host, over one window.

On a 2-core host a served benchmark is decided by who else runs: the engine's OpenMP threads
spin at every barrier and stall when one of them is descheduled, so another job's CPU shows up as
a slower server. ``bench peers`` prints this per server, so a row measured while something else
ran says so (``other_cpu_s``) instead of passing as the server's speed.

    usage = CpuWindow(server_pid, process_label)   # at the window's start (bench/process_tree.py)
    ... usage.sample() every so often (a process that ends between samples loses its last part)
    doc = usage.finish()               # CpuUsage.as_dict()

Times are seconds of CPU (user + system, all threads), from psutil for processes and from
/proc/stat for the host; the window is wall seconds (time.monotonic).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bench.process_tree import label_totals, process_tree

_PROC_STAT = Path("/proc/stat")
# /proc/stat "cpu" fields counted as busy: user nice system irq softirq steal (not idle, iowait;
# guest time is already inside user)
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def host_busy_seconds(text: str, ticks_per_s: int) -> float:
    """Busy CPU seconds of all CPUs since boot from /proc/stat's text (its first, aggregate "cpu" line).
    Raises ValueError if there is no such line."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            values = [int(v) for v in parts[1:]]
            return sum(values[i] for i in _BUSY_FIELDS if i < len(values)) / ticks_per_s
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def read_host_busy_seconds() -> float | None:
    """host_busy_seconds of this host now; None where /proc/stat cannot be read."""
    try:
        return host_busy_seconds(_PROC_STAT.read_text(), os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError):
        return None


def by_label(start: dict[int, tuple[str, float]], last: dict[int, tuple[str, float]]) -> list[tuple[str, int, float]]:
    """CPU seconds each label used between two views {pid: (label, cumulative CPU s)}: a pid in
    ``last`` only (born in the window) counts from 0. Returns (label, processes, seconds), most first."""
    return label_totals((label, max(0.0, cpu - start.get(pid, (label, 0.0))[1])) for pid, (label, cpu) in last.items())


@dataclass(frozen=True)
class CpuUsage:
    """One window. by_process: (label, processes, CPU s) of the server's tree; client_cpu_s: this
    process's (the benchmark client); host_busy_cpu_s: every CPU of the host; other_cpu_s: the
    host's minus the server's and the client's (None without /proc/stat); load averages: 1 minute."""

    window_s: float
    by_process: tuple[tuple[str, int, float], ...]
    client_cpu_s: float
    host_busy_cpu_s: float | None
    load_1m_start: float
    load_1m_end: float

    @property
    def server_cpu_s(self) -> float:
        return sum(s for _, _, s in self.by_process)

    @property
    def other_cpu_s(self) -> float | None:
        if self.host_busy_cpu_s is None:
            return None
        return max(0.0, self.host_busy_cpu_s - self.server_cpu_s - self.client_cpu_s)

    def as_dict(self) -> dict:
        return {"window_s": self.window_s, "server_cpu_s": self.server_cpu_s, "client_cpu_s": self.client_cpu_s,
                "host_busy_cpu_s": self.host_busy_cpu_s, "other_cpu_s": self.other_cpu_s,
                "load_1m_start": self.load_1m_start, "load_1m_end": self.load_1m_end,
                "by_process": [{"process": k, "count": n, "cpu_s": s} for k, n, s in self.by_process]}


def _self_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class CpuWindow:
    """CPU seconds of the process tree rooted at ``pid`` (labelled by ``label(name, cmdline)``),
    of this process, and of the host, from construction to finish()."""

    def __init__(self, pid: int, label: Callable[[str, list[str]], str]) -> None:
        import psutil

        self._root = psutil.Process(pid)
        self._label = label
        self._t0 = time.monotonic()
        self._load0 = os.getloadavg()[0]
        self._self0 = _self_cpu_s()
        self._host0 = read_host_busy_seconds()
        self._start = self._view()
        self._last = dict(self._start)

    def _view(self) -> dict[int, tuple[str, float]]:
        import psutil

        out = {}
        for p in process_tree(self._root):
            try:
                t = p.cpu_times()
                out[p.pid] = (self._label(p.name(), p.cmdline()), t.user + t.system)
            except psutil.Error:
                continue
        return out

    def sample(self) -> None:
        """Update each live process's cumulative CPU (a process gone since keeps its last value)."""
        self._last.update(self._view())

    def finish(self) -> CpuUsage:
        self.sample()
        host = read_host_busy_seconds()
        return CpuUsage(window_s=time.monotonic() - self._t0, by_process=tuple(by_label(self._start, self._last)),
                        client_cpu_s=_self_cpu_s() - self._self0,
                        host_busy_cpu_s=None if host is None or self._host0 is None else host - self._host0,
                        load_1m_start=self._load0, load_1m_end=os.getloadavg()[0])


def usage_line(name: str, doc: dict) -> str:
    """One line of CpuUsage.as_dict(): window, host busy, the server's processes, the client, the rest."""
    procs = ", ".join(f"{p['process']}{' x' + str(p['count']) if p['count'] > 1 else ''} {p['cpu_s']:.1f}"
                      for p in doc["by_process"] if p["cpu_s"] >= 0.05)
    host = "-" if doc["host_busy_cpu_s"] is None else f"{doc['host_busy_cpu_s']:.1f}"
    other = "-" if doc["other_cpu_s"] is None else f"{doc['other_cpu_s']:.1f}"
    return (f"  {name}: {doc['window_s']:.1f} s, host busy {host} CPU s; server {doc['server_cpu_s']:.1f} ({procs}); "
            f"client {doc['client_cpu_s']:.1f}; other {other}; load {doc['load_1m_start']:.1f} -> {doc['load_1m_end']:.1f}")
