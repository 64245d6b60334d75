"""The TRL override list (relibra_moe/integrations/upstream_trl.py) against the installed trl: the version it was
written for, and every overridden private method present with the parameters ReplayGRPOTrainer keeps."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("trl")

from relibra_moe.integrations.upstream_trl import OVERRIDES, TESTED  # noqa: E402
from relibra_moe.layers.upstream_torch import version_in_range  # noqa: E402


def test_installed_trl_is_a_tested_version():
    import trl

    assert version_in_range(trl.__version__, TESTED), (
        f"trl {trl.__version__} is outside the range upstream_trl.py was tested against {TESTED}: check each "
        "override of ReplayGRPOTrainer against it, then widen TESTED")


@pytest.mark.parametrize("name", sorted(OVERRIDES))
def test_each_overridden_method_exists_upstream_with_its_parameters(name):
    from trl import GRPOTrainer

    from relibra_moe.integrations.trl import ReplayGRPOTrainer

    assert tuple(inspect.signature(getattr(GRPOTrainer, name)).parameters) == OVERRIDES[name]
    mine = getattr(ReplayGRPOTrainer, name)
    assert mine is not getattr(GRPOTrainer, name)  # the trainer overrides it
    assert tuple(inspect.signature(mine).parameters) == OVERRIDES[name]


def test_the_list_is_every_private_override():
    from trl import GRPOTrainer

    from relibra_moe.integrations.trl import ReplayGRPOTrainer

    overridden = {n for n, v in vars(ReplayGRPOTrainer).items()
                  if n.startswith("_") and not n.startswith("__") and callable(v) and hasattr(GRPOTrainer, n)}
    assert overridden == set(OVERRIDES)
