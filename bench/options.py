"""Parsing of the benchmarks' comma-separated options (``--batch-sizes 1,16,32``): one rule and one
message for every ``pdserve bench`` command, so a bad value is a one-line error naming the option
(exit status 2), never a traceback."""

from __future__ import annotations

from typing import Sequence

from engine.errors import UserError


def int_list(text: str, option: str, *, min_value: int = 1, distinct: bool = False,
             example: str = "1,16,32") -> list[int]:
    """``"1,16,32"`` -> [1, 16, 32], in the order given (empty items skipped).

    Raises UserError naming ``option`` when an item is not an integer, the list is empty, a value
    is below ``min_value``, or (``distinct``) a value repeats."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < min_value:
        raise UserError(f"{option} {text!r}: expected comma-separated integers >= {min_value}, e.g. {example}")
    if distinct and len(set(values)) != len(values):
        raise UserError(f"{option} {text!r}: each value at most once")
    return values


def name_list(text: str, option: str, allowed: Sequence[str], *, what: str = "value") -> list[str]:
    """``"none, int8"`` -> ["none", "int8"], in the order given, each once (empty items skipped).

    Raises UserError naming ``option`` when the list is empty or a name is not in ``allowed``."""
    names = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not names:
        raise UserError(f"{option} {text!r}: give at least one of {', '.join(allowed)}")
    for name in names:
        if name not in allowed:
            raise UserError(f"{option} {text!r}: unknown {what} {name!r}; choose one of {', '.join(allowed)}")
    return names
