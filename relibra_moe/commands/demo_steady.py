"""The demo's steady-state section (``relibra demo``): consecutive batches planned one after another.

The cases (``demo_steady_cases``), their batches (``case_batches``), the targets (``steady_targets``) and the
section itself (``demo_steady_state``), each case run through ``relibra_moe.steady.run_steady`` and printed
with ``steady.steady_table``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..specs import ClusterSpec, ModelSpec, cluster_preset, model_preset
from ..steady import consecutive_batches, drifting_batches, run_steady, steady_table
from ..trace import TraceBatch

DEMO_STRATEGIES = ("static", "eplb", "lplb", "eplb-history", "online", "relibra")


def demo_steady_cases(quick: bool = False) -> list[dict[str, Any]]:
    """The demo's steady-state runs, each tied to the single-batch scenario (``after``) whose run enables it.

    Default: the whole GPT-OSS-20B trace in 4 consecutive batches of 4 micro-batches x 44 requests on EP8 = 2 x 4
    (all 24 layers), and 4 qwen3-235b-a22b batches of 256 prompts x 4 responses with a drifting domain mix on
    EP32 = 4 x 8 (4 of its 94 MoE layers, as the single-batch demo, to stay within the 2-core budget).
    ``quick``: small versions of both for tests. A case's ``strategies`` (default ``DEMO_STRATEGIES``) are those
    it runs.
    """
    if quick:
        return [
            {"name": "gpt-oss-ep8/steady", "after": "gpt-oss-ep8", "model": "gpt-oss-20b", "nodes": 2,
             "gpus_per_node": 4, "data": "real", "num_requests": 64, "micro_batch_size": 16, "num_batches": 2,
             "layers": 4},
            {"name": "qwen3-30b-a3b/drift/steady", "after": "qwen3-30b-a3b/mixed", "model": "qwen3-30b-a3b",
             "nodes": 2, "gpus_per_node": 8, "data": "synthetic", "num_prompts": 16, "micro_batch_size": 16,
             "num_batches": 2, "layers": 2, "drift": 0.25},
        ]
    return [
        {"name": "gpt-oss-ep8/steady", "after": "gpt-oss-ep8", "model": "gpt-oss-20b", "nodes": 2, "gpus_per_node": 4,
         "data": "real", "num_requests": 0, "micro_batch_size": 44, "num_batches": 4, "layers": None},
        # without lplb: its per-cell LP takes about 2/3 of this case's time (bench/steady.py has the row)
        {"name": "qwen3-235b-a22b/drift/steady", "after": "qwen3-235b-a22b/mixed", "model": "qwen3-235b-a22b",
         "nodes": 4, "gpus_per_node": 8, "data": "synthetic", "num_prompts": 256, "micro_batch_size": 32,
         "num_batches": 4, "layers": 4, "drift": 0.25,
         "strategies": tuple(s for s in DEMO_STRATEGIES if s != "lplb")},
    ]


def case_batches(case: dict[str, Any], seed: int = 0, overlap: str = "none"
                 ) -> tuple[list[TraceBatch], ModelSpec, ClusterSpec]:
    """``(batches, model restricted to the case's layers, cluster)`` of a ``demo_steady_cases`` entry; the cluster
    with the trainer's compute / all-to-all ``overlap`` (``specs.OVERLAPS``)."""
    full = model_preset(case["model"])
    model = full.with_(num_layers=case["layers"]) if case.get("layers") else full
    cluster = cluster_preset("hopper-rail", nodes=case["nodes"], gpus_per_node=case["gpus_per_node"], overlap=overlap)
    if case["data"] == "real":
        from ..datasets import gpt_oss_batch

        batch = gpt_oss_batch(num_requests=case.get("num_requests") or None, seed=seed)
        batch = batch.with_micro_batch_size(case["micro_batch_size"]).restrict_layers(case.get("layers"))
        return consecutive_batches(batch, case["num_batches"]), model, cluster
    return (drifting_batches(model, case["num_batches"], case["num_prompts"],
                             micro_batch_size=case["micro_batch_size"], drift=case.get("drift", 0.25), seed=seed),
            model, cluster)


def steady_targets(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's steady-state targets on the runs present: relibra's steady throughput over each baseline's."""
    out = []
    for name, need in (("qwen3-235b-a22b/drift/steady", {"eplb-history": 1.10, "online": 1.05}),
                       ("gpt-oss-ep8/steady", None)):
        res = results.get(name)
        if not res or "speedup" not in res or res.get("reference") != "relibra":
            continue
        for s, v in res["speedup"].items():
            if s == "relibra" or (need is not None and s not in need):
                continue
            th = 1.05 if need is None else need[s]
            out.append({"target": f"{name}: relibra vs {s} per step", "value": v, "threshold": th, "unit": "x",
                        "met": bool(v >= th)})
    return out


def demo_steady_state(ran: Sequence[str], *, quick: bool = False, seed: int = 0, workers: int = 1,
                      console: Any = None, sample_owner: str = "planner", overlap: str = "none") -> dict[str, Any]:
    """The demo's steady-state section: the cases of ``demo_steady_cases`` whose single-batch scenario is in
    ``ran``, each through ``run_steady`` with its strategies (and ``sample_owner``: "planner", "trainer" or
    "both"; the trainer's ``overlap``); prints a table per case and the targets; returns ``{"cases": {name:
    run_steady result + case}, "targets": [...]}`` (JSON-ready)."""
    results: dict[str, dict[str, Any]] = {}
    for case in demo_steady_cases(quick):
        if case["after"] not in ran:
            continue
        t0 = time.perf_counter()
        batches, model, cluster = case_batches(case, seed, overlap)
        res = run_steady(batches, model, cluster, case.get("strategies", DEMO_STRATEGIES), replica_slots=2, seed=seed,
                         workers=workers, sample_owner=sample_owner)
        res.update({"case": case, "layers_total": _layers_total(case["model"]), "wall_s": time.perf_counter() - t0,
                    "data": "real (GPT-OSS-20B routing trace, arrival order)" if case["data"] == "real"
                    else "synthetic (relibra_moe.synthetic, not real routing; drifting domain mix)"})
        results[case["name"]] = res
        if console is not None:
            console.print(steady_table(res, title=f"steady state {case['name']} [{res['data']}]: "
                                                  f"{res['num_batches']} consecutive batches, "
                                                  f"{model.num_layers} MoE layers, r = 2 (first step apart)"))
    targets = [] if quick else steady_targets(results)  # the quick cases are not the targets' batches
    if console is not None:
        for t in targets:
            mark = "[green]met[/]" if t["met"] else "[red]NOT met[/]"
            console.print(f"target {t['target']}: {t['value']:.3f}{t['unit']} (>= {t['threshold']}{t['unit']}) "
                          f"{mark}")
    return {"cases": results, "targets": targets}


def _layers_total(model_name: str) -> int:
    return model_preset(model_name).num_layers
