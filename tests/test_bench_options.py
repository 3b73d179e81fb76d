"""bench/options.py: the benchmarks' comma-separated integer and name options (pure logic)."""

import pytest

from bench.options import int_list, name_list
from engine.errors import UserError


def test_int_list_keeps_order_and_skips_empty_items():
    assert int_list("16,1,,32", "--batch-sizes") == [16, 1, 32]


@pytest.mark.parametrize("text", ["x", "", "1,x", "0", "1,-4"])
def test_int_list_refuses_bad_values_naming_the_option(text):
    with pytest.raises(UserError, match="--rows"):
        int_list(text, "--rows")


def test_int_list_distinct_refuses_repeats():
    assert int_list("1,16", "--concurrency", distinct=True) == [1, 16]
    with pytest.raises(UserError, match="at most once"):
        int_list("1,1", "--concurrency", distinct=True)


def test_name_list_keeps_order_once_each_and_refuses_unknown_or_empty_naming_the_option():
    assert name_list(" int8, none,,int8", "--methods", ("none", "int8", "fp8")) == ["int8", "none"]
    with pytest.raises(UserError, match="--methods 'none,int4': unknown method 'int4'; choose one of none, int8"):
        name_list("none,int4", "--methods", ("none", "int8"), what="method")
    with pytest.raises(UserError, match="--methods ',': give at least one of none, int8"):
        name_list(",", "--methods", ("none", "int8"))
