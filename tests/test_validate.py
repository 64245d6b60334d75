"""The shared argument checks of relibra_moe.validate: bool is never an int, errors name the field and value."""

from __future__ import annotations

import numpy as np
import pytest

from relibra_moe.errors import PlanError, TraceError
from relibra_moe.validate import (
    check_choice,
    check_index_range,
    check_int,
    check_nonnegative,
    check_optional_int,
    check_positive,
    check_token_counts,
    is_int,
)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 1.0, "1", None, np.float64(2.0)])
def test_non_ints_are_rejected(value):
    assert not is_int(value)
    with pytest.raises(PlanError, match=r"x=.* must be an int >= 0"):
        check_int("x", value, 0)


@pytest.mark.parametrize("value", [0, 3, np.int64(3), np.int32(0), np.uint8(7)])
def test_ints_pass_and_come_back_as_int(value):
    got = check_int("x", value, 0)
    assert got == int(value) and type(got) is int


def test_int_bounds_and_error_type():
    with pytest.raises(PlanError, match="n=0 must be an int >= 1"):
        check_int("n", 0, 1)
    with pytest.raises(PlanError, match=r"n=5 must be an int in \[0, 4\]"):
        check_int("n", 5, 0, 4)
    with pytest.raises(TraceError, match="n=-1 must be an int >= 0"):
        check_int("n", -1, error=TraceError)
    assert check_optional_int("n", None) is None
    with pytest.raises(PlanError, match="n=True"):
        check_optional_int("n", True)


@pytest.mark.parametrize("value", [True, 0, -1.0, float("nan"), float("inf"), "2"])
def test_positive_rejects(value):
    with pytest.raises(PlanError, match=r"beta=.* must be a finite number > 0"):
        check_positive("beta", value)


def test_nonnegative_and_positive_accept_numbers():
    assert check_positive("b", np.float32(0.5)) == 0.5
    assert check_nonnegative("t", 0) == 0.0
    with pytest.raises(PlanError, match="t=False must be a finite number >= 0"):
        check_nonnegative("t", False)


def test_choice():
    assert check_choice("mode", "a", ("a", "b")) == "a"
    with pytest.raises(PlanError, match=r"mode='c' is not one of \('a', 'b'\)"):
        check_choice("mode", "c", ("a", "b"))
    with pytest.raises(PlanError, match="is not one of"):
        check_choice("flag", True, (1, 0))  # True == 1, but a bool is not a choice of ints


def test_token_counts_and_index_range_name_the_first_bad_entry():
    x = np.zeros((2, 3))
    x[1, 2] = -1.0
    with pytest.raises(PlanError, match=r"x\[1, 2\] = -1.0: token counts must be finite and >= 0"):
        check_token_counts("x", x)
    x[1, 2] = np.nan
    with pytest.raises(PlanError, match=r"x\[1, 2\] = nan"):
        check_token_counts("x", x)
    check_token_counts("x", np.zeros(0))
    with pytest.raises(PlanError, match=r"gpu\[2\] = 4 is outside \[0, 4\)"):
        check_index_range("gpu", np.array([0, 3, 4, 5]), 0, 4)
