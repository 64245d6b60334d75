"""``relibra demo``: the main job. Plans real and synthetic RL batches with every strategy, simulates the
training step of each plan, and reports tables, PNG plots and a JSON report.

Scenarios (the ReLibra paper's evaluation setup): the paper's three models on their EP groups with
synthetic RL batches for the domains math, code, instruction and mixed (clearly labelled synthetic:
``relibra_moe.synthetic``), and
the real GPT-OSS-20B routing trace (``../shared/traces``) on EP8 = 2 x 4 and EP16 = 2 x 8. Every plan
is timed by the step simulator (``relibra_moe.sim``): attention + MoE forward/backward per micro-batch
and layer, replica transfers, reorder traffic. ``balanced`` is the bound: a proven lower bound of the step (and
of the sum of T_MoE) of every plan with the scenario's replica slots (``sim.bound_step``, ``evaluate.bound_terms``;
docs/method.md, "The bound"), so "% of bound" is at most 100.

To stay within about 3 minutes on a 2-core machine the default run simulates fewer MoE layers and
micro-batches than the paper for the large synthetic scenarios; the output and the JSON say so
(``layers_simulated`` / ``layers_total``, ``num_micro_batches``). ``--quick`` runs a small subset.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import report
from ..atomic import write_text
from ..errors import PlanError, RelibraError
from ..plan import json_default
from ..specs import OVERLAPS
from .demo_steady import demo_steady_state
from .plan import add_seed_workers_flags, option_default

DOMAINS = ("math", "code", "instruction", "mixed")
DEMO_OVERLAPS = ("none", "megatron")
"""The trainer's compute / all-to-all overlaps the demo reports every step under by default (``--overlap``):
back to back and Megatron-LM's ``overlap_moe_expert_parallel_comm`` (``specs.OVERLAPS``, docs/method.md)."""
PAPER_CLUSTERS = {"qwen3-30b-a3b": (2, 8), "glm4.5-106b-a12b": (4, 8), "qwen3-235b-a22b": (4, 8)}
REPORT_VERSION = 1


@dataclass(frozen=True)
class Scenario:
    """One demo scenario: a batch (real or synthetic) on an EP group.

    Attributes:
        name: ``model/domain`` for synthetic batches, ``gpt-oss-ep8`` / ``gpt-oss-ep16`` for the real trace.
        model: model preset.
        nodes, gpus_per_node: the EP group (G = nodes x gpus_per_node).
        data: "synthetic" or "real".
        domain: synthetic domain, or "all" for the real trace.
        num_samples: sequences in the batch (synthetic: prompts x 4 responses; real: requests drawn
            with the seed, 0 = the whole trace in file order).
        micro_batch_size: samples per micro-batch.
        layers: MoE layers simulated (None: all of the model's).
        replica_slots: r replica slots per GPU (relibra, lplb; eplb gets r redundant experts per GPU).
        repack: also run ``+repack`` variants of static and relibra.
    """

    name: str
    model: str
    nodes: int
    gpus_per_node: int
    data: str
    domain: str
    num_samples: int
    micro_batch_size: int
    layers: int | None = None
    replica_slots: int = 2
    repack: bool = False

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def default_scenarios(quick: bool = False) -> list[Scenario]:
    """The demo's scenarios. ``quick``: one real and one small synthetic scenario (for tests).

    Default: the whole GPT-OSS-20B trace (703 requests, 215k decode tokens) in 16 micro-batches of 44
    (about 1.7k tokens per GPU per micro-batch at EP8, near the paper's one ~2k-token sample per GPU);
    the synthetic batches keep the paper's shape (32 micro-batches x 32 samples = 256 prompts x 4
    responses, up to 8K tokens) on 2 of the model's MoE layers (4 for the headline
    qwen3-235b-a22b/mixed), which keeps the default run within about 3 minutes on 2 cores. Per-layer
    figures do not depend on the layer count; throughput relative to static changes little with it
    (every simulated term, reorder traffic included, scales with the layers).
    """
    if quick:
        return [
            Scenario("gpt-oss-ep8", "gpt-oss-20b", 2, 4, "real", "all", 64, 16, layers=4),
            Scenario("qwen3-30b-a3b/mixed", "qwen3-30b-a3b", 2, 8, "synthetic", "mixed", 64, 16, layers=2),
        ]
    out = [
        Scenario("gpt-oss-ep8", "gpt-oss-20b", 2, 4, "real", "all", 0, 44, repack=True),
        Scenario("gpt-oss-ep16", "gpt-oss-20b", 2, 8, "real", "all", 0, 44),
    ]
    for model, (nodes, gpn) in PAPER_CLUSTERS.items():
        for domain in DOMAINS:
            layers = 4 if (model, domain) == ("qwen3-235b-a22b", "mixed") else 2
            out.append(Scenario(f"{model}/{domain}", model, nodes, gpn, "synthetic", domain, 1024, 32, layers=layers))
    return out


def select_scenarios(scenarios: list[Scenario], patterns: list[str] | None) -> list[Scenario]:
    """Scenarios whose name matches one of ``patterns`` (exact, glob, or prefix); all when None."""
    if not patterns:
        return scenarios
    chosen = [s for s in scenarios if any(s.name == p or fnmatch.fnmatch(s.name, p) or s.name.startswith(p)
                                          for p in patterns)]
    if not chosen:
        raise RelibraError(f"--scenario {patterns} matches none of {[s.name for s in scenarios]}")
    return chosen


# ---------------------------------------------------------------------------------------- batches
def build_batch(sc: Scenario, seed: int) -> Any:
    """The scenario's TraceBatch (micro-batches assigned; layers restricted as the scenario says)."""
    from ..specs import model_preset

    model = model_preset(sc.model)
    if sc.data == "real":
        from ..datasets import gpt_oss_batch

        batch = gpt_oss_batch(num_requests=sc.num_samples or None, seed=seed)
    else:
        from ..synthetic import rl_batch

        responses = 4
        batch = rl_batch(model.with_(num_layers=sc.layers) if sc.layers else model, sc.domain,
                         sc.num_samples // responses, responses_per_prompt=responses, seed=seed,
                         micro_batch_size=sc.micro_batch_size)
    batch = batch.with_micro_batch_size(sc.micro_batch_size)
    return batch.restrict_layers(sc.layers)


# --------------------------------------------------------------------------------------- planning
def _strategies_available() -> tuple[Any, list[str]]:
    """``(plan_batch, the registry's compared strategies, in report order)``."""
    from ..planners.strategies import COMPARED_STRATEGIES, STRATEGIES, plan_batch

    return plan_batch, [s for s in COMPARED_STRATEGIES if s in STRATEGIES]


SAMPLE_OWNERS = ("planner", "trainer", "both")
"""``relibra demo --sample-owner``: who places the samples (``PlanOptions.sample_owner``); "both" runs every
strategy in both modes (the trainer-owned runs labelled ``"<strategy> (trainer)"``)."""


DEMO_PLACEMENT = "length-balanced"
"""The second sample placement the demo runs every baseline on (beside round-robin): verl's ``balance_batch``,
what a verl user already has (``sample_placements``); relibra* place their own samples."""


def strategy_runs(sc: Scenario, strategies: list[str], sample_owner: str = "planner"
                  ) -> list[tuple[str, str, bool, str, str | None]]:
    """``(label, strategy, repack, sample_owner, sample_placement)`` of every plan the scenario needs. The
    ``+repack`` runs move samples between micro-batches, so they are planner-owned only; the baselines (not
    relibra*, not balanced) also run on ``DEMO_PLACEMENT``, labelled ``"<strategy>, length-balanced (verl)"``."""
    from ..planners.strategies import RELIBRA_STRATEGIES, REPACK_COMPARED

    runs: list[tuple[str, str, bool, str, str | None]] = []
    if sample_owner in ("planner", "both"):
        runs += [(s, s, False, "planner", None) for s in strategies]
        runs += [(f"{s}, {DEMO_PLACEMENT} (verl)", s, False, "planner", DEMO_PLACEMENT) for s in strategies
                 if s not in RELIBRA_STRATEGIES and s != "balanced" and len(strategies) > 1]
        if sc.repack and len(strategies) > 1:
            runs += [(f"{s}+repack", s, True, "planner", None) for s in REPACK_COMPARED if s in strategies]
    if sample_owner == "trainer":
        runs += [(s, s, False, "trainer", None) for s in strategies]
    elif sample_owner == "both":
        runs += [(f"{s} (trainer)", s, False, "trainer", None) for s in strategies]
    return runs


def run_scenario(sc: Scenario, seed: int, workers: int, plan_batch: Any, strategies: list[str],
                 advance: Any = None, starting: Any = None, sample_owner: str = "planner",
                 overlaps: tuple[str, ...] = ("none",)) -> dict[str, Any]:
    """Plan the scenario's batch with every strategy and simulate each step; the JSON-ready result.

    ``sample_owner`` (``SAMPLE_OWNERS``): with "trainer" every strategy keeps the round-robin samples of each
    micro-batch (the trainer's), with "both" the trainer-owned runs are added under ``"<strategy> (trainer)"``.
    ``overlaps`` (``specs.OVERLAPS``): the trainer's compute / all-to-all overlap; the first is the cluster's for
    the main figures, and every strategy's step under each one goes to its ``by_overlap`` (``overlap_results``).

    ``starting(label)`` is called before each plan and ``advance()`` after it (progress reporting).
    """
    from ..metrics import load_summary
    from ..planners.strategies import REPLICA_STRATEGIES
    from ..sim import StepResult, simulate_step
    from ..specs import cluster_preset, model_preset

    t0 = time.perf_counter()
    full_model = model_preset(sc.model)
    batch = build_batch(sc, seed)
    model = full_model.with_(num_layers=batch.num_layers)
    cluster = cluster_preset("hopper-rail", nodes=sc.nodes, gpus_per_node=sc.gpus_per_node, overlap=overlaps[0])
    stats = load_summary(batch.micro_batch_expert_counts())
    res: dict[str, Any] = {
        **asdict(sc), "num_gpus": sc.num_gpus,
        "data": "synthetic (relibra_moe.synthetic, not real routing)" if sc.data == "synthetic"
        else "real (GPT-OSS-20B routing trace)",
        "num_sequences": batch.num_sequences, "num_tokens": int(batch.num_tokens),
        "num_micro_batches": int(batch.resolve_micro_batch().max()) + 1,
        "layers_simulated": model.num_layers, "layers_total": full_model.num_layers,
        "expert_mib": model.expert_bytes / 2**20,
        "reduced": model.num_layers < full_model.num_layers,
        "expert_skew_mean": stats["skew_mean"], "intersection_mean": stats["intersection_mean"],
        "hot_k": stats["hot_k"], "build_s": time.perf_counter() - t0, "overlap": overlaps[0], "strategies": {},
    }
    results: dict[str, Any] = {}
    details: dict[str, Any] = {}
    plans: dict[str, Any] = {}
    for label, strategy, repack, owner, placement in strategy_runs(sc, strategies, sample_owner):
        if starting is not None:
            starting(label)
        t1 = time.perf_counter()
        r = sc.replica_slots if strategy in REPLICA_STRATEGIES else 0
        owner_kw = {"sample_owner": owner} if owner != "planner" else {}
        if placement is not None:
            owner_kw["sample_placement"] = placement
        plan = plan_batch(batch, model, cluster, strategy, replica_slots=r, seed=seed, workers=workers,
                          repack=repack, **owner_kw)
        solve_s = time.perf_counter() - t1
        step = simulate_step(plan, batch, model, cluster, balanced=strategy == "balanced")
        results[label] = {
            **StepResult.of(plan, step, solve_s).to_dict(), "strategy": strategy, "repack": repack,
            "sample_owner": owner, "sample_placement": placement or "round-robin",
            "rank_skew_per_micro_batch": step.rank_skew.mean(axis=1).tolist(),
        }
        details[label] = step
        plans[label] = (plan, {**owner_kw, "repack": repack})
        if advance is not None:
            advance()
    overlap_results(results, plans, batch, model, cluster, overlaps, seed, workers, plan_batch, sc.replica_slots,
                    advance, starting)
    base = results["static" if "static" in results else "static (trainer)"]["tokens_per_s"]
    bal = results.get("balanced", {}).get("tokens_per_s")  # the bound
    bal_moe = results.get("balanced", {}).get("t_moe_s")
    for r in results.values():
        r["speedup_vs_static"] = r["tokens_per_s"] / base
        r["percent_of_bound_throughput"] = 100.0 * r["tokens_per_s"] / bal if bal else float("nan")
        # The cost-model view (what `relibra score` reports): sum of the forward T_MoE only.
        r["percent_of_bound"] = 100.0 * bal_moe / r["t_moe_s"] if bal_moe else float("nan")
        r["reorder_share"] = r["breakdown"]["reorder"] / r["step_s"]
        r["replica_share"] = r["breakdown"]["replica_exposed"] / r["step_s"]
    res["strategies"] = results
    res["wall_s"] = time.perf_counter() - t0
    res["_details"] = details  # StepTime objects for the plots; dropped from the JSON
    return res


def overlap_replans(strategies: list[str], overlaps: tuple[str, ...]) -> int:
    """Plans ``overlap_results`` makes besides the main ones (``strategies``: the strategy of every run): relibra*
    again under each other overlap."""
    from ..planners.strategies import RELIBRA_STRATEGIES

    return (len(overlaps) - 1) * sum(s in RELIBRA_STRATEGIES for s in strategies)


def overlap_results(results: dict[str, Any], plans: dict[str, Any], batch: Any, model: Any, cluster: Any,
                    overlaps: tuple[str, ...], seed: int, workers: int, plan_batch: Any, replica_slots: int,
                    advance: Any = None, starting: Any = None) -> None:
    """Every run's step under each of ``overlaps`` (``ClusterSpec.overlap``; the first is ``cluster``'s, whose
    figures are the run's own): ``results[label]["by_overlap"][overlap]`` = ``step_s``, ``tokens_per_s``,
    ``speedup_vs_static`` and ``percent_of_bound_throughput`` (against static and the bound under that overlap).
    The baselines' plans do not read the overlap, so each is simulated again as planned; relibra and
    relibra-inter, whose objective and portfolio follow it, are planned again under it with the run's options.
    ``plans[label]``: ``(plan, the plan_batch options it was planned with)``."""
    from ..planners.strategies import RELIBRA_STRATEGIES
    from ..sim import simulate_step

    for ov in overlaps:
        cl = cluster.with_(overlap=ov)
        for label, (plan, kw) in plans.items():
            strategy = results[label]["strategy"]
            if ov != overlaps[0] and strategy in RELIBRA_STRATEGIES:
                if starting is not None:
                    starting(f"{label}, overlap {ov}")
                plan = plan_batch(batch, model, cl, strategy, replica_slots=replica_slots, seed=seed,
                                  workers=workers, **kw)
                if advance is not None:
                    advance()
            step = simulate_step(plan, batch, model, cl, balanced=strategy == "balanced")
            results[label].setdefault("by_overlap", {})[ov] = {"step_s": step.step_s,
                                                               "tokens_per_s": step.tokens_per_s}
        base = results["static" if "static" in results else "static (trainer)"]["by_overlap"][ov]["tokens_per_s"]
        bound = results.get("balanced", {}).get("by_overlap", {}).get(ov, {}).get("tokens_per_s")
        for r in results.values():
            o = r["by_overlap"][ov]
            o["speedup_vs_static"] = o["tokens_per_s"] / base
            o["percent_of_bound_throughput"] = 100.0 * o["tokens_per_s"] / bound if bound else float("nan")


# ------------------------------------------------------------------------------------------ report
def ablation(scenarios: list[dict[str, Any]]) -> dict[str, Any]:
    """static -> +reorder (relibra-inter) -> +replication (relibra) per synthetic/real scenario."""
    steps = [("static", "static"), ("+reorder", "relibra-inter"), ("+replication", "relibra")]
    rows = []
    for sc in scenarios:
        st = sc["strategies"]
        if all(k in st for _, k in steps):
            rows.append({"scenario": sc["name"], "speedup": [st[k]["speedup_vs_static"] for _, k in steps]})
    return {"steps": [f"{a} ({b})" if a != b else a for a, b in steps], "rows": rows}


def check_targets(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, evaluated on the scenarios that ran (absent ones are not listed)."""
    by = {s["name"]: s["strategies"] for s in scenarios}
    out = []

    def add(name: str, value: float, threshold: float, unit: str) -> None:
        out.append({"target": name, "value": value, "threshold": threshold, "unit": unit,
                    "met": bool(value >= threshold)})

    mixed = by.get("qwen3-235b-a22b/mixed", {})
    if "relibra" in mixed:
        add("qwen3-235b-a22b/mixed: relibra vs static", mixed["relibra"]["speedup_vs_static"], 1.2, "x")
        if "eplb" in mixed:
            add("qwen3-235b-a22b/mixed: relibra vs eplb", mixed["relibra"]["tokens_per_s"]
                / mixed["eplb"]["tokens_per_s"], 1.05, "x")
        if "balanced" in mixed:
            add("qwen3-235b-a22b/mixed: relibra % of bound",
                mixed["relibra"]["percent_of_bound_throughput"], 90.0, "%")
    ep8 = by.get("gpt-oss-ep8", {})
    if "relibra" in ep8 and "balanced" in ep8:
        add("gpt-oss-ep8 (r=2): relibra % of bound", ep8["relibra"]["percent_of_bound_throughput"], 90.0, "%")
        # For reference, the same on the cost model alone (sum of T_MoE, no reorder or replica traffic).
        add("gpt-oss-ep8 (r=2): relibra % of bound, sum T_MoE only", ep8["relibra"]["percent_of_bound"],
            90.0, "%")
    return out


def notes(scenarios: list[dict[str, Any]]) -> list[str]:
    """Plain-language caveats drawn from the numbers (reorder and replica traffic that dominate a step)."""
    out = []
    for sc in scenarios:
        r = sc["strategies"].get("relibra")
        if not r:
            continue
        if r["reorder_share"] > 0.05:
            out.append(f"{sc['name']}: moving the re-laid-out experts (weights + optimizer state, from the static "
                       f"placement) takes {100 * r['reorder_share']:.0f}% of relibra's step: the batch has only "
                       f"{sc['num_tokens']:,} tokens; the planner moves a layer only where its step-time gain pays "
                       "for the move, and the cost is per batch (paper: 1.4-2.1%).")
        if r["replica_share"] > 0.05:
            out.append(f"{sc['name']}: replica pushes/pulls not hidden behind their window take "
                       f"{100 * r['replica_share']:.0f}% of relibra's step (expert of "
                       f"{sc['expert_mib']:.0f} MiB, short attention per layer); relibra keeps a replica set only "
                       "where its forward + backward gain pays for this exposed traffic.")
    return out


def write_plots(out: Path, scenarios: list[dict[str, Any]]) -> list[str]:
    """PNG plots: per-GPU loads (worst static layer/micro-batch), rank skew per micro-batch, throughput bars."""
    files: list[str] = []
    for sc in scenarios:
        det = sc["_details"]
        slug = sc["name"].replace("/", "_")
        if "static" in det:
            m, l = np.unravel_index(int(np.argmax(det["static"].rank_skew)), det["static"].rank_skew.shape)
            loads = {"static (before)": det["static"].gpu_load[m, l]}
            if "relibra" in det:
                loads["relibra (after)"] = det["relibra"].gpu_load[m, l]
            files.append(str(report.plot_gpu_loads(
                out / f"gpu_load_{slug}.png", loads, sc["gpus_per_node"],
                f"{sc['name']} [{sc['data'].split(' ')[0]}]: per-GPU load, micro-batch {m}, MoE layer {l} "
                "(worst static)")))
        skew = {k: np.asarray(v["rank_skew_per_micro_batch"]) for k, v in sc["strategies"].items()}
        files.append(str(report.plot_rank_skew(out / f"rank_skew_{slug}.png", skew,
                                               f"{sc['name']} [{sc['data'].split(' ')[0]}]: rank skew per "
                                               "micro-batch (mean over layers)")))
    names = [s["name"] for s in scenarios]
    labels = list(dict.fromkeys(k for s in scenarios for k in s["strategies"]))
    rel = {k: [s["strategies"][k]["speedup_vs_static"] if k in s["strategies"] else float("nan")
               for s in scenarios] for k in labels}
    files.append(str(report.plot_throughput(out / "throughput.png", names, rel,
                                            "Simulated training throughput relative to static (Megatron-LM)")))
    return files


def run_demo(scenarios: list[Scenario], out: Path, *, seed: int = 0, workers: int = 1, console: Any = None,
             progress: bool = True, quick: bool = False, sample_owner: str = "planner",
             overlaps: tuple[str, ...] = DEMO_OVERLAPS) -> dict[str, Any]:
    """Run the scenarios, print tables, write plots and ``report.json`` under ``out``; return the report.
    ``sample_owner``: who places the samples (``SAMPLE_OWNERS``), for the scenarios and the steady state;
    ``overlaps``: the trainer's compute / all-to-all overlaps every step is reported under (the first for the
    main tables, the targets and the steady state; ``run_scenario``)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..datasets import TracesNotFoundError, traces_dir

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=max(console.width, 140))
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    plan_batch, strategies = _strategies_available()
    skipped, todo = [], []
    try:
        traces_dir("gpt-oss-20b/topk_ids.npz")
        missing = None
    except TracesNotFoundError as exc:
        missing = str(exc)
    for sc in scenarios:
        if sc.data == "real" and missing:
            skipped.append({"scenario": sc.name, "reason": missing})
            console.print(f"[yellow]skipping {sc.name}: {escape(missing)}[/]")
        else:
            todo.append(sc)
    reduced = [sc.name for sc in todo if sc.layers is not None]
    if any(sc.data == "synthetic" for sc in todo):
        console.print("[bold]Synthetic[/] RL batches (relibra_moe.synthetic) stand in for the paper's datasets; "
                      "the GPT-OSS-20B scenarios use real recorded routing.")
    if reduced:
        console.print(f"To fit the time budget these scenarios simulate fewer MoE layers than the model has: "
                      f"{', '.join(reduced)} (see layers_simulated in the JSON).")
    total = sum(len(runs) + overlap_replans([r[1] for r in runs], overlaps)
                for runs in (strategy_runs(sc, strategies, sample_owner) for sc in todo))
    results: list[dict[str, Any]] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not progress, transient=False) as bar:
        task = bar.add_task("planning", total=total)
        for sc in todo:
            bar.update(task, description=f"planning {sc.name}")
            results.append(run_scenario(
                sc, seed, workers, plan_batch, strategies, advance=lambda: bar.advance(task),
                starting=lambda label, name=sc.name: bar.update(task, description=f"planning {name}: {label}"),
                sample_owner=sample_owner, overlaps=overlaps))
    for sc in results:
        console.print(report.scenario_table(sc))
        if len(overlaps) > 1:
            console.print(report.overlap_table(sc))
    abl = ablation(results)
    if abl["rows"]:
        console.print(report.ablation_table(abl))
    targets = check_targets(results)
    for t in targets:
        mark = "[green]met[/]" if t["met"] else "[red]NOT met[/]"
        console.print(f"target {t['target']}: {t['value']:.3f}{t['unit']} (>= {t['threshold']}{t['unit']}) {mark}")
    caveats = notes(results)
    for n in caveats:
        console.print(f"[yellow]note[/] {n}")
    plots = write_plots(out, results) if results else []
    rep = {
        "version": REPORT_VERSION, "quick": quick, "seed": seed, "workers": workers, "sample_owner": sample_owner,
        "overlaps": list(overlaps),
        "strategies": strategies, "cluster_fabric": "hopper-rail", "simulator": "relibra_moe.sim",
        "scenarios": [{k: v for k, v in sc.items() if not k.startswith("_")} for sc in results],
        "ablation": abl, "targets": targets, "notes": caveats, "skipped": skipped,
        "steady_state": demo_steady_state([sc["name"] for sc in results], quick=quick, seed=seed, workers=workers,
                                          console=console, sample_owner=sample_owner, overlap=overlaps[0]),
        "plots": [os.path.relpath(p, out) for p in plots], "wall_s": time.perf_counter() - t0,
    }
    write_text(out / "report.json", json.dumps(rep, indent=2, default=json_default))
    console.print(f"wrote {out / 'report.json'} and {len(plots)} plots under {out} "
                  f"({rep['wall_s']:.1f} s)")
    return rep


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``relibra demo`` to the CLI."""
    p = subparsers.add_parser(
        "demo", help="plan and simulate real and synthetic RL batches with every strategy (the main job)",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="relibra-demo", help="folder for report.json and the PNG plots "
                                                         "(default ./relibra-demo)")
    p.add_argument("--quick", action="store_true", help="a small run (two scenarios, few layers)")
    p.add_argument("--scenario", action="append", default=None,
                   help="run only this scenario (name, glob or prefix; repeatable), e.g. qwen3-235b-a22b/mixed")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    add_seed_workers_flags(p, workers_help="planner processes (default: the CPU count)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--sample-owner", choices=SAMPLE_OWNERS, default=option_default("sample_owner"),
                   help="who places the samples: the planner, the trainer (round-robin within each "
                        "micro-batch kept; only homes, replicas and splits planned), or both (every strategy in "
                        "both modes, side by side); default %(default)s")
    p.add_argument("--overlap", default=",".join(DEMO_OVERLAPS),
                   help="the trainer's compute / all-to-all overlaps to report every step under, comma-separated "
                        f"({', '.join(OVERLAPS)}; the first for the main tables; relibra is planned under each): "
                        "default %(default)s")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``relibra demo``: list, or run the chosen scenarios and write the report; exit status 0."""
    scenarios = default_scenarios(args.quick)
    if args.list:
        for sc in scenarios:
            print(f"{sc.name:28s} {sc.data:9s} {sc.model} EP{sc.num_gpus} = {sc.nodes} x {sc.gpus_per_node}, "
                  f"{sc.num_samples} samples, micro-batches of {sc.micro_batch_size}, "
                  f"layers {sc.layers or 'all'}")
        return 0
    scenarios = select_scenarios(scenarios, args.scenario)
    if args.workers is not None and args.workers < 1:
        raise PlanError(f"--workers={args.workers} must be >= 1 (omit it for the CPU count)")
    if args.seed < 0:
        raise PlanError(f"--seed={args.seed} must be >= 0")
    overlaps = tuple(dict.fromkeys(o.strip() for o in args.overlap.split(",")))
    for o in overlaps:
        if o not in OVERLAPS:
            raise PlanError(f"--overlap={args.overlap!r}: {o!r} is not one of {list(OVERLAPS)}")
    workers = args.workers if args.workers else max(1, min(os.cpu_count() or 1, 4))
    run_demo(scenarios, Path(args.out), seed=args.seed, workers=workers, progress=not args.no_progress,
             quick=args.quick, sample_owner=args.sample_owner, overlaps=overlaps)
    return 0
