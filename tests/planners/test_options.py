"""PlanOptions: one place for every plan option's default and check; plan_batch and Planner build it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from relibra_moe.cost import DEFAULT_BETA
from relibra_moe.errors import PlanError
from relibra_moe.plan import Placement
from relibra_moe.planners.options import DEFAULT_ROUNDS, DEFAULT_TOL, PlanOptions
from relibra_moe.timing import DEFAULT_OPTIMIZER_BYTES_PER_PARAM


def test_defaults_are_the_documented_constants():
    o = PlanOptions()
    assert (o.rounds, o.tol, o.beta, o.optimizer_bytes_per_param) == (DEFAULT_ROUNDS, DEFAULT_TOL, DEFAULT_BETA,
                                                                      DEFAULT_OPTIMIZER_BYTES_PER_PARAM)
    assert (o.rounds, o.tol, o.optimizer_bytes_per_param) == (2, 0.05, 12.0)
    assert o.migration and o.price_replicas and not o.repack and o.rank_balance == (False, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.iters = 3  # type: ignore[misc]


@pytest.mark.parametrize("name", ["replica_slots", "seed", "workers", "iters", "locality_iters", "num_seeds",
                                  "rounds", "num_groups", "final_iters", "cell_chunk"])
def test_bool_is_never_an_int_option(name):
    with pytest.raises(PlanError, match=f"{name}=True must be an int"):
        PlanOptions(**{name: True})


@pytest.mark.parametrize("kw, match", [
    ({"objective": "fast"}, "objective='fast' is not one of"),
    ({"migration": 1}, "migration must be a bool, got 1"),
    ({"smooth": "yes"}, "smooth must be a bool, got 'yes'"),
    ({"node_comp": np.int64(0)}, "node_comp must be a bool, got"),
    ({"beta": -1}, "beta=-1 must be a finite number > 0"),
    ({"skew_cap": -0.5}, "skew_cap=-0.5 must be a finite number >= 0"),
    ({"skew_cap": 0.05, "node_comp": False}, "needs node_comp=True"),
    ({"token_cap": 100}, "token_cap=100 only applies with repack=True"),
    ({"replicate": 3}, "replicate=3 must be a dict"),
    ({"previous": "plan.npz"}, "previous must be a Placement"),
    ({"optimizer_bytes_per_param": float("nan")}, "optimizer_bytes_per_param=nan"),
])
def test_bad_values_name_the_option(kw, match):
    with pytest.raises(PlanError, match=match):
        PlanOptions(**kw)


def test_unknown_option_lists_the_known_ones():
    with pytest.raises(PlanError, match="unknown plan option itres=3; known: .*'iters'"):
        PlanOptions.from_kwargs(itres=3)


def test_rank_balance_and_final_iters():
    assert PlanOptions(skew_cap=0.05).rank_balance == (True, 0.05)
    assert PlanOptions(node_comp=True).rank_balance == (True, None)
    assert PlanOptions().final_iters_for(100) == 800
    assert PlanOptions(final_iters=7).final_iters_for(100) == 7


def test_check_for_strategy():
    PlanOptions(skew_cap=0.1).check_for("relibra")
    with pytest.raises(PlanError, match="skew_cap=0.1 only applies to relibra and relibra-inter, not strategy 'eplb'"):
        PlanOptions(skew_cap=0.1).check_for("eplb")


def test_strategy_options_records_what_differs_from_the_defaults():
    assert PlanOptions(replica_slots=2, seed=3, workers=2).strategy_options() == {}
    assert PlanOptions(rounds=2, tol=0.05).strategy_options() == {}
    assert PlanOptions(iters=300, migration=False).strategy_options() == {"iters": 300, "migration": False}
    homes = Placement.static(2, 4, 2)
    rec = PlanOptions(previous=homes).strategy_options()["previous"]
    assert rec == PlanOptions(previous=np.asarray(homes.expert_gpu)).strategy_options()["previous"]
    assert rec.startswith("sha1:") and len(rec) == 45


def test_sample_placement_defaults_per_strategy_and_owner():
    """None: relibra* planning the samples start from verl's length-balanced placement, every baseline (and a
    trainer that gives no ranks) runs on round-robin; a set value holds for every strategy."""
    o = PlanOptions()
    assert [o.placement_for(s) for s in ("static", "online", "eplb-history", "relibra", "relibra-inter")] == \
        ["round-robin", "round-robin", "round-robin", "length-balanced", "length-balanced"]
    assert PlanOptions(sample_owner="trainer").placement_for("relibra") == "round-robin"
    lf = PlanOptions(sample_placement="longest-first")
    assert {lf.placement_for(s) for s in ("static", "relibra")} == {"longest-first"}
    assert "sample_placement" not in o.strategy_options()
    assert lf.strategy_options()["sample_placement"] == "longest-first"


@pytest.mark.parametrize("kw, match", [
    ({"sample_placement": "packed"}, "sample_placement='packed' is not one of"),
    ({"sample_placement": "length-balanced", "sample_owner": "trainer", "sample_gpu": np.zeros(4, np.int64)},
     "sample_placement='length-balanced' computes the trainer's ranks, sample_gpu= gives them"),
])
def test_bad_sample_placement_names_the_option(kw, match):
    with pytest.raises(PlanError, match=match):
        PlanOptions(**kw)


def test_replicate_options_from_a_dict_and_a_typo_names_the_field():
    from relibra_moe.planners.options import ReplicateOptions

    o = PlanOptions(replicate={"candidates": 2, "polish": False})
    assert o.replicate == ReplicateOptions(candidates=2, polish=False)
    assert PlanOptions().replicate == ReplicateOptions()
    assert PlanOptions(replicate=None).replicate == ReplicateOptions()
    with pytest.raises(PlanError, match=r"unknown replicate option candidats=2; known: \['candidates', "):
        PlanOptions(replicate={"candidats": 2})
    with pytest.raises(PlanError, match="candidates=0 must be an int >= 1"):
        PlanOptions(replicate={"candidates": 0})
    with pytest.raises(PlanError, match="polish_tol=-1 must be a finite number >= 0"):
        ReplicateOptions(polish_tol=-1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.replicate.passes = 3  # type: ignore[misc]
    assert "replicate" not in PlanOptions(replicate={"candidates": 2}).strategy_options()  # not in the plan's stats


def test_replicate_options_are_replicate_cells_keywords_with_its_defaults():
    """The fields of ReplicateOptions are exactly replicate_cell_greedy's keyword-only parameters, with the same
    defaults: a default changed on one side only fails here."""
    import inspect

    from relibra_moe.planners.options import ReplicateOptions
    from relibra_moe.planners.replicate import replicate_cell_greedy

    params = {n: p.default for n, p in inspect.signature(replicate_cell_greedy).parameters.items()
              if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert params == ReplicateOptions().kwargs()
    assert params == {"candidates": None, "comm_candidates": True, "passes": 0, "polish": None, "polish_tol": 0.005}


@pytest.mark.parametrize("kw, match", [
    ({"move_horizon": 0}, "move_horizon=0 must be an int >= 1"),
    ({"move_horizon": True}, "move_horizon=True must be an int"),
    ({"move_horizon": 4, "migration": False}, "move_horizon=4 credits expert moves .* migration=False"),
    ({"move_horizon": 4, "step_objective": False}, "move_horizon=4 credits .* step_objective=False"),
    ({"previous_loads": np.zeros((1, 2, 2, 4))}, r"previous_loads \(shape \(1, 2, 2, 4\)\) only informs "
                                                  "move_horizon > 1"),
    ({"move_horizon": 2, "previous_loads": np.zeros((2, 2, 4))}, r"previous_loads must be \[M, L, G, E\]"),
    ({"move_horizon": 2, "previous_loads": np.full((1, 1, 2, 2), -1.0)},
     r"previous_loads\[0, 0, 0, 0\] = -1.0: token counts must be finite and >= 0"),
])
def test_bad_horizon_options_name_the_option(kw, match):
    with pytest.raises(PlanError, match=match):
        PlanOptions(**kw)


def test_horizon_options_apply_to_relibra_only_and_are_recorded():
    PlanOptions(move_horizon=4).check_for("relibra-inter")
    with pytest.raises(PlanError, match="move_horizon=4 only applies to relibra and relibra-inter .* not strategy "
                                        "'eplb-history'"):
        PlanOptions(move_horizon=4).check_for("eplb-history")
    rec = PlanOptions(move_horizon=4, previous_loads=np.ones((1, 2, 2, 4))).strategy_options()
    assert rec["move_horizon"] == 4 and rec["previous_loads"].startswith("sha1:")
    assert rec["previous_loads"].endswith("shape [1, 2, 2, 4]")
    assert "move_horizon" not in PlanOptions().strategy_options()
