"""The shared argument checks of relibra_moe.validate: bool is never an int, errors name the field and value."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from relibra_moe.errors import PlanError, TraceError
from relibra_moe.validate import (
    check_bool,
    check_choice,
    check_count,
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


def test_check_count_messages_name_the_field_and_value():
    assert check_count("n", np.int64(3)) == 3 and type(check_count("n", np.int64(3))) is int
    assert check_count("n", 0, 0) == 0
    with pytest.raises(TraceError, match=r"^n must be a positive int, got 0$"):
        check_count("n", 0, error=TraceError)
    with pytest.raises(PlanError, match=r"^max_len must be an int >= 2, got 1$"):
        check_count("max_len", 1, 2)
    for bad in (True, 1.0, "2", None):
        with pytest.raises(PlanError, match=f"n must be a positive int, got {bad!r}"):
            check_count("n", bad)


def test_check_bool():
    assert check_bool("flag", np.bool_(True)) is True and check_bool("flag", False) is False
    for bad in (1, 0, "yes", None):
        with pytest.raises(TraceError, match=f"flag must be a bool, got {bad!r}"):
            check_bool("flag", bad, error=TraceError)


# ----------------------------------------------------------------------------------- no hand-written checks
PKG = Path(__file__).resolve().parents[1] / "relibra_moe"

HAND_CHECKS_ALLOWED: set[str] = set()
"""Files (a trailing ``/``: a folder) that may still hold hand-written ``isinstance(..., int / bool)`` argument
checks. Empty: every module checks its arguments through validate.py; keep it so."""


def allowed(rel: str, allow: set[str]) -> bool:
    """Whether the package-relative file ``rel`` is in ``allow`` (itself, or under a folder entry)."""
    return any(rel == a or (a.endswith("/") and rel.startswith(a)) for a in allow)


def hand_written_int_checks(root: Path) -> dict[str, list[int]]:
    """``{file: [lines]}`` of ``isinstance`` calls naming the builtin ``int`` or ``bool`` under ``root``
    (validate.py excluded: it is where those checks live)."""
    out: dict[str, list[int]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "validate.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
                    and len(node.args) == 2
                    and {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & {"int", "bool"}):
                out.setdefault(rel, []).append(node.lineno)
    return out


def test_argument_checks_go_through_validate():
    found = hand_written_int_checks(PKG)
    assert {f: lines for f, lines in found.items() if not allowed(f, HAND_CHECKS_ALLOWED)} == {}


def test_the_check_finder_sees_each_spelling(tmp_path):
    (tmp_path / "validate.py").write_text("def f(x):\n    return isinstance(x, int)\n")
    (tmp_path / "a.py").write_text("def f(x):\n    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):\n"
                                   "        raise ValueError(x)\n")
    (tmp_path / "b.py").write_text("def f(o):\n    return isinstance(o, np.integer) or isinstance(o, float)\n")
    assert hand_written_int_checks(tmp_path) == {"a.py": [2, 2]}
    assert allowed("planners/x.py", {"planners/"}) and allowed("sim.py", {"sim.py"})
    assert not allowed("simulate.py", {"sim.py"}) and not allowed("layers/sim.py", {"sim.py"})
