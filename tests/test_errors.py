"""errors: every library error is a RelibraError and a ValueError, so callers catching ValueError keep working."""

from __future__ import annotations

import pytest

from relibra_moe.errors import PlanError, RelibraError, ReplayError, TraceError


@pytest.mark.parametrize("cls", [TraceError, PlanError, ReplayError])
def test_every_error_is_a_relibra_error_and_a_value_error(cls):
    assert cls.__mro__[1] is RelibraError and issubclass(RelibraError, ValueError)
    with pytest.raises(ValueError, match="replica_slots=3 is over"):
        raise cls("replica_slots=3 is over the ceiling")


def test_the_errors_are_distinct():
    kinds = (TraceError, PlanError, ReplayError)
    for a in kinds:
        for b in kinds:
            assert issubclass(a, b) == (a is b)


def test_the_cli_reports_a_relibra_error_with_its_type(tmp_path, capsys):
    from relibra_moe.cli import main

    missing = tmp_path / "none.npz"
    assert main(["score", str(missing), str(missing), "--model", "no-such-model"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("relibra score: error: PlanError: ") and "no-such-model" in err
