"""RL training steps with ReLibra under FSDP2 + expert parallelism on a 2-D mesh (dp 2 x ep 2), on CPU.

The FSDP2 variant of ``examples/rl_step.py`` (whose data pieces it reuses: prompts, stand-in reward,
GRPO advantages, shifted training rows, policy-gradient loss). 4 gloo processes form the mesh
``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))``;
:func:`relibra_moe.integrations.fsdp.parallelize` swaps the MoE blocks on each EP group of 2 ranks
(E/2 home experts and r replica slots per rank) and ``fully_shard``-s the dense parameters over all 4
ranks (experts excluded). Each step (``--steps``, 2 by default):

1. rollout on rank 0 (its own copy of the weights, synced from the trainer after every step through
   ``MeshMoE.full_state_dict``): ``generate()`` with :class:`~relibra_moe.integrations.hf.RoutingRecorder`;
2. ``Planner.submit(batch)`` plans the global batch for one EP group (a cluster of ``ep`` GPUs) in the
   background while the reward is computed;
3. every rank applies the plan's placement (``MeshMoE.relayout``: experts move with their AdamW state,
   the FSDP-sharded dense state stays; the dp ranks are checked to apply the same placement);
4. the plan's micro-batches are dealt over the dp ranks (``MeshMoE.micro_batches``: m % dp == d); per
   micro-batch each rank runs the samples the plan puts on its EP rank inside ``MeshMoE.replay``
   (recorded routing + the replica plan), forward and backward (FSDP reduce-scatters the dense
   gradients); then ``MeshMoE.reduce_expert_grads`` all-reduces the expert gradients over dp and AdamW
   steps.

Checks, for every step (``--check`` exits non-zero when one fails): the step's loss, gathered gradients
(``MeshMoE.full_grads``) and gathered parameters after AdamW equal a plain single-process HF step on the
same data (live routing, all experts local; tolerances as in ``examples/rl_step.py``), and the per-rank
expert loads of every layer and micro-batch equal the plan's.

At the default size (one node of 2 ranks per EP group, 8 short sequences) the planner places no replica:
the cost model finds none worth its transfer (``replicas`` in the step records). The replica path on the
mesh is tested with hand-made plans in ``tests/integrations/test_fsdp.py``.

Run: ``python examples/rl_step_fsdp.py --check`` (a few minutes on 2 shared cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_step import group_advantages, make_prompts, policy_loss, stand_in_reward, training_rows  # noqa: E402


@dataclass
class Config:
    """Sizes of the example (defaults: the tiny size the test runs)."""

    dp: int = 2
    ep: int = 2
    gpus_per_node: int = 2  # ranks of one EP group per node (replicas stay inside a node)
    num_prompts: int = 4
    responses_per_prompt: int = 2
    max_new_tokens: int = 5
    micro_batch_size: int = 2  # samples per micro-batch (8 sequences: 4 micro-batches, 2 per dp rank)
    replica_slots: int = 1
    num_layers: int = 3
    num_experts: int = 8
    top_k: int = 2
    lr: float = 0.05
    steps: int = 2
    seed: int = 0
    strategy: str = "relibra"
    rtol: float = 1e-4
    atol: float = 1e-6
    adamw_param_atol_lr: float = 1e-2  # see examples/rl_step.py: parameters within 1% of one AdamW step
    adamw_grad_rtol: float = 1e-3  # gradients normwise per tensor from the second step on
    collective_timeout_s: float = 300.0

    @property
    def world(self) -> int:
        return self.dp * self.ep


def _spec(cfg: Config):
    from relibra_moe.specs import ClusterSpec, ModelSpec

    n_moe = cfg.num_layers - (1 if cfg.num_layers > 2 else 0)  # the tiny Qwen3-MoE has one dense layer
    model = ModelSpec("tiny-qwen3-moe", hidden=32, ffn=16, num_experts=cfg.num_experts, top_k=cfg.top_k,
                      num_layers=n_moe, num_heads=4, num_kv_heads=2, head_dim=8)
    return model, ClusterSpec(nodes=cfg.ep // cfg.gpus_per_node, gpus_per_node=cfg.gpus_per_node)


def _worker(rank: int, cfg: Config, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=cfg.world,
                            timeout=timedelta(seconds=cfg.collective_timeout_s))
    try:
        result = _train(rank, cfg)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        from relibra_moe.layers.dispatch import clear_dispatcher_cache

        clear_dispatcher_cache()
        dist.destroy_process_group()


def _train(rank: int, cfg: Config) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from relibra_moe.integrations.fsdp import parallelize
    from relibra_moe.integrations.hf_tiny import tiny_model
    from relibra_moe.planners.service import Planner

    def fresh():
        return tiny_model("qwen3_moe", seed=cfg.seed, num_layers=cfg.num_layers, num_experts=cfg.num_experts,
                          top_k=cfg.top_k)

    model = fresh()
    reference = copy.deepcopy(model).train()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=cfg.lr, weight_decay=0.01)
    rollout_state = copy.deepcopy(model.state_dict())
    mesh = init_device_mesh("cpu", (cfg.dp, cfg.ep), mesh_dim_names=("dp", "ep"))
    # the loss of each rank is its share of the global loss (divided by the global token count): sum reduction
    par = parallelize(model.train(), mesh, replica_slots=cfg.replica_slots, gpus_per_node=cfg.gpus_per_node,
                      reduction="sum")
    opt = torch.optim.AdamW(par.param_groups(weight_decay=0.01), lr=cfg.lr)  # dense (DTensor) + expert groups
    planner = None
    if rank == 0:
        spec, cluster = _spec(cfg)
        # migration=False, portfolio=False: at this toy size a move never pays in the step-time model (the
        # portfolio would keep the static homes); the example wants relayouts
        planner = Planner(spec, cluster, strategy=cfg.strategy, replica_slots=cfg.replica_slots, workers=1,
                          executor="inline", seed=cfg.seed, migration=False, portfolio=False)
    records = []
    try:
        for step in range(cfg.steps):
            record, rollout_state = _one_step(rank, cfg, step, par, opt, reference, ref_opt, rollout_state,
                                              planner, fresh)
            records.append(record)
    finally:
        if planner is not None:
            planner.close()
    return {"rank": rank, "steps": records}


def _one_step(rank: int, cfg: Config, step: int, par, opt, reference, ref_opt, rollout_state, planner,
              fresh) -> tuple[dict, dict[str, torch.Tensor]]:
    from relibra_moe.integrations.hf import RoutingRecorder, moe_blocks
    from relibra_moe.layers.moe import materialize_counts

    model, G = par.model, cfg.ep
    timings: dict[str, float] = {}
    if rank == 0:  # 1-2. rollout with the recorder, plan in the background while the reward is computed
        t0 = time.perf_counter()
        rollout = fresh()
        rollout.load_state_dict(rollout_state)
        prompts, pmask = make_prompts(cfg, step)
        torch.manual_seed(cfg.seed + step)
        with RoutingRecorder(rollout) as rec, torch.no_grad():
            gen = rollout.generate(prompts, attention_mask=pmask, max_new_tokens=cfg.max_new_tokens,
                                   do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        full_mask = torch.cat([pmask, torch.ones(len(gen), gen.shape[1] - pmask.shape[1], dtype=pmask.dtype)], 1)
        seqs = [gen[b][full_mask[b].bool()] for b in range(len(gen))]
        prompt_lens = [int(m.sum()) for m in pmask]
        batch = rec.trace_batch()
        timings["rollout_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        future = planner.submit(batch, micro_batch_size=cfg.micro_batch_size)
        adv = group_advantages(stand_in_reward([s[p:] for s, p in zip(seqs, prompt_lens)]),
                               cfg.responses_per_prompt)
        plan = future.result()
        timings["plan_wait_s"] = time.perf_counter() - t1
        payload = [batch, seqs, prompt_lens, adv, plan]
    else:
        payload = [None] * 5
    dist.broadcast_object_list(payload, src=0)
    batch, seqs, prompt_lens, adv, plan = payload
    denom = sum(len(s) - p for s, p in zip(seqs, prompt_lens))

    # 3. relayout: experts (and their AdamW state) move inside each EP group; the dense FSDP state stays
    layers = [b for _, _, b in moe_blocks(model)]
    state_before = sum(len(opt.state.get(p, {})) > 0 for p in model.parameters())
    moved = par.relayout(plan, opt)
    opt.zero_grad(set_to_none=True)

    # 4. this dp rank's micro-batches, replayed; dense grads reduce-scattered by FSDP in every backward
    M, L = plan.num_micro_batches, len(layers)
    seen = np.zeros((M, L, G), np.int64)
    loss_sum = torch.zeros(())
    rounds = par.micro_batches(plan)
    for m in rounds:
        mine = [] if m is None else [int(i) for i in np.flatnonzero((plan.samples.micro_batch == m) &
                                                                    (plan.samples.gpu == par.ep_rank))]
        ids, mask, labels = training_rows(seqs, prompt_lens, mine)
        with par.replay(batch, plan, m, attention_mask=mask) as rows:
            assert rows == mine, (rows, mine)
            a = torch.tensor([adv[i] for i in mine] or [0.0], dtype=torch.float32)
            loss = policy_loss(model, ids, mask, labels, a, denom)
        loss.backward()
        loss_sum += loss.detach()
        if m is not None:
            for li, layer in enumerate(layers):
                seen[m, li, par.ep_rank] = layer.last_load
    par.reduce_expert_grads()
    dist.all_reduce(loss_sum)
    dist.all_reduce(torch.from_numpy(seen))  # every (m, ep rank) cell is written by exactly one rank
    grads = par.full_grads()
    opt.step()
    full = par.full_state_dict()

    # the plain HF reference step on the same data
    ref_opt.zero_grad(set_to_none=True)
    rids, rmask, rlabels = training_rows(seqs, prompt_lens, list(range(len(seqs))))
    ref_loss = policy_loss(reference, rids, rmask, rlabels, torch.tensor(adv, dtype=torch.float32), denom)
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.grad is not None}
    ref_opt.step()
    ref_sd = reference.state_dict()

    patol = max(cfg.atol, cfg.adamw_param_atol_lr * cfg.lr)
    ok = set(grads) == set(ref_grads)
    grad_err = 0.0
    for n, r in ref_grads.items():
        g = grads.get(n, torch.full_like(r, float("nan")))
        scale = float(r.abs().max()) + 1e-12
        grad_err = max(grad_err, float((g - r).abs().max()) / scale)
        if step == 0:
            ok &= torch.allclose(g, r, rtol=cfg.rtol, atol=cfg.atol)
        else:
            ok &= float((g - r).abs().max()) <= cfg.adamw_grad_rtol * scale + cfg.atol
    state_ok = list(full) == list(ref_sd) and all(
        torch.allclose(full[k], ref_sd[k], rtol=cfg.rtol, atol=patol) for k in ref_sd)
    state_err = max(float((full[k] - ref_sd[k]).abs().max()) for k in ref_sd)

    # expected per-rank loads from the trace and the plan (per EP group: the plan's G = ep ranks)
    x = batch.loads(plan.samples.gpu, G, plan.samples.micro_batch)  # [M, L, G(source), E]
    exact = np.zeros((M, L, G), np.int64)
    for m in range(M):
        shares = plan.replicas.shares(plan.placement, m)  # [L, G(source), E, G(dest)]
        for li in range(L):
            for j in range(G):
                exact[m, li] += materialize_counts(x[m, li, j], shares[li, j]).sum(axis=0)
    record = {
        "step": step, "loss": float(loss_sum), "ref_loss": float(ref_loss.detach()),
        "ref_grad_norm": float(torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values()))),
        "grads_ok": bool(ok), "grad_rel_err": grad_err, "state_ok": bool(state_ok), "state_abs_err": state_err,
        "loads_seen": seen.tolist(), "loads_exact": exact.tolist(),
        "replicas": int((plan.replicas.replica_expert >= 0).sum()), "experts_moved": moved["experts_moved"],
        "optimizer_state_params_at_relayout": int(state_before), "micro_batches": M,
        "rounds": [None if m is None else int(m) for m in rounds], "timings": timings,
    }
    return record, full


def run(cfg: Config | None = None) -> dict:
    """Run the steps on ``cfg.world`` spawned gloo processes; returns the summary with the checks of every
    step and ``steps``, one record per step as rank 0 saw it (``rounds`` per rank under ``rounds``)."""
    cfg = cfg or Config()
    with tempfile.TemporaryDirectory(prefix="relibra-rl-fsdp-") as tmp:
        mp.spawn(_worker, args=(cfg, os.path.join(tmp, "init"), tmp), nprocs=cfg.world, join=True)
        results = [json.loads(Path(tmp, f"rank{r}.json").read_text())["steps"] for r in range(cfg.world)]
    checks: dict[str, bool] = {}
    for s, r0 in enumerate(results[0]):
        seen, exact = np.array(r0["loads_seen"]), np.array(r0["loads_exact"])
        step_checks = {
            "loss_matches_reference": abs(r0["loss"] - r0["ref_loss"]) <= cfg.rtol * max(1.0, abs(r0["ref_loss"])),
            "grads_match_reference": all(r[s]["grads_ok"] for r in results),
            "gathered_state_dict_matches_reference": all(r[s]["state_ok"] for r in results),
            "loads_equal_plan": bool((seen == exact).all()),
            "every_micro_batch_ran_once": sorted(m for r in results[:: cfg.ep] for m in r[s]["rounds"]
                                                 if m is not None) == list(range(r0["micro_batches"])),
            "nontrivial": abs(r0["ref_loss"]) > 1e-6 and r0["ref_grad_norm"] > 1e-6,
        }
        checks.update({f"step{s}: {k}": v for k, v in step_checks.items()})
    steps = [{k: v for k, v in r.items() if k != "loads_exact"} for r in results[0]]
    for s, rec in enumerate(steps):
        rec["max_grad_rel_err"] = max(r[s]["grad_rel_err"] for r in results)
        rec["rounds_per_rank"] = [r[s]["rounds"] for r in results]
    return {"config": asdict(cfg), "checks": checks, "ok": all(checks.values()), "steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batch-size", type=int, default=Config.micro_batch_size)
    ap.add_argument("--replica-slots", type=int, default=Config.replica_slots)
    ap.add_argument("--steps", type=int, default=Config.steps)
    ap.add_argument("--check", action="store_true", help="exit 1 when a check fails")
    args = ap.parse_args(argv)
    cfg = Config(micro_batch_size=args.micro_batch_size, replica_slots=args.replica_slots, steps=args.steps)
    out = run(cfg)
    for rec in out["steps"]:
        rec.pop("loads_seen")
    print(json.dumps(out, indent=2))
    return 0 if (out["ok"] or not args.check) else 1


if __name__ == "__main__":
    sys.exit(main())
