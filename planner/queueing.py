"""Queueing estimates for sizing a prefill pool: how many workers keep the wait for a prefill
within a TTFT budget at a Poisson arrival rate. Pure.

The pool is modelled as M/M/n (Erlang C): n workers, offered load ``a = λ × s`` (workers' worth
of work; λ requests/s, s seconds of prefill per request), and the waiting time's tail

    P(W > t) = C(n, a) × exp(-(n - a) × t / s)

(e.g. Kleinrock, *Queueing Systems* vol. 1, §3.4; Harchol-Balter, *Performance Modeling and
Design of Computer Systems*, ch. 14). A prefill's service time for one ISL is nearly constant
(M/D/n), whose waits are shorter than M/M/n's, so the estimate errs on the side of one worker too
many, never one too few.
"""

from __future__ import annotations

import math


def erlang_c(n: int, a: float) -> float:
    """Probability that an arrival waits, with n servers and offered load a (< n; 1 when a >= n).

    Computed from the Erlang B recursion B(k) = a B(k-1) / (k + a B(k-1)), stable for large n."""
    if n < 1:
        raise ValueError(f"need n >= 1 servers, got {n}")
    if a <= 0:
        return 0.0
    if a >= n:
        return 1.0
    b = 1.0
    for k in range(1, n + 1):
        b = a * b / (k + a * b)
    return b / (1 - (a / n) * (1 - b))


def wait_tail(n: int, a: float, service_s: float, t_s: float) -> float:
    """P(wait > t_s) for n servers, offered load a, mean service time service_s (seconds)."""
    if a >= n:
        return 1.0
    return erlang_c(n, a) * math.exp(-(n - a) * max(0.0, t_s) / service_s)


def servers_for_wait(a: float, service_s: float, budget_s: float, tail: float) -> int:
    """Fewest servers (>= 1) with P(wait > budget_s) <= tail at offered load a.

    Raises ValueError for service_s <= 0 or tail outside (0, 1)."""
    if service_s <= 0 or not 0 < tail < 1:
        raise ValueError(f"need service_s > 0 and 0 < tail < 1, got {service_s}, {tail}")
    n = max(1, math.floor(a) + 1)
    while wait_tail(n, a, service_s, budget_s) > tail:
        n += 1
    return n
