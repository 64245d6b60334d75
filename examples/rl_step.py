"""RL training steps with ReLibra on a tiny Hugging Face Qwen3-MoE, on CPU, across 4 gloo processes.

The 4 processes are an expert-parallel group of 2 logical nodes x 2 GPUs. Each step (``--steps``, 2 by
default):

1. rollout (rank 0, on its own copy of the weights, the "rollout engine", synced from the trainer after
   every step with ``full_state_dict``): ``generate()`` responses for a batch of left-padded prompts with
   :class:`~relibra_moe.integrations.hf.RoutingRecorder` on, then ``TraceBatch`` of the recorded routing;
2. ``Planner.submit(batch)`` plans in the background (reorder + locality + replication, strategy
   ``relibra``; one Planner for all steps) while a stand-in reward is computed (GRPO-style
   group-normalized advantages);
3. the plan, sequences and advantages go to every rank; every rank (whose MoE blocks were swapped once:
   ``swap_moe_blocks``, E/G home experts and r replica slots per rank) applies the plan's placement with
   ``relayout``, which moves the experts together with their AdamW state;
4. per micro-batch: each rank runs the samples the plan puts on it, inside
   ``replay(model, batch, plan, micro_batch=m)`` (recorded routing + the replica plan), forward and
   backward of a policy-gradient loss; then dense gradients are all-reduced (experts are sharded:
   their gradients are already complete at their home ranks) and the optimizer steps.

Checks, for every step (the function returns them; ``--check`` exits non-zero when one fails):

- the planned step's loss and gradients equal a reference step on the same data with the plain HF
  model, all experts local, live routing, no plan (fp32 tolerance; with AdamW see ``Config``), and so do
  the parameters after the optimizer step, also as the gathered HF state dict (``full_state_dict``:
  expert shards of every rank back in logical order, after the relayout);
- the per-rank expert loads each layer saw in each micro-batch equal the plan's: the tokens x of the
  trace (``TraceBatch.loads`` with the plan's sample placement) times the plan's shares, materialized
  per source rank by largest remainder, and within rounding of the fractional expectation.

Run: ``python examples/rl_step.py --check`` (about half a minute on 2 cores).
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


@dataclass
class Config:
    """Sizes of the example (defaults: the tiny size the test runs)."""

    world: int = 4
    gpus_per_node: int = 2
    num_prompts: int = 4
    responses_per_prompt: int = 2
    max_new_tokens: int = 6
    micro_batch_size: int = 4
    replica_slots: int = 1
    num_layers: int = 3
    num_experts: int = 8
    top_k: int = 2
    lr: float = 0.05
    optimizer: str = "adamw"  # "adamw" (its state moves with the experts at each relayout) or "sgd"
    steps: int = 2  # RL steps: each rolls out with the weights the previous one trained, then re-plans
    seed: int = 0
    strategy: str = "relibra"
    rtol: float = 1e-4
    atol: float = 1e-6
    # AdamW divides each gradient by its running RMS, so fp32 summation-order noise in a near-zero gradient
    # becomes a visible difference of the step: parameters are compared to 1% of one step (lr) instead.
    # A misplaced expert row or optimizer state would be off by about a whole step or more.
    adamw_param_atol_lr: float = 1e-2
    # ... and from the second step on the two models differ by that much, so gradients are compared normwise
    # per tensor: max |g - g_ref| <= adamw_grad_rtol * max |g_ref| (+ atol).
    adamw_grad_rtol: float = 1e-3
    collective_timeout_s: float = 300.0  # bounds every collective, including waiting for rank 0's rollout


# ----------------------------------------------------------------------------------------- pieces
def make_prompts(cfg: Config, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids ``[N, P]`` and mask of RL step ``step``: ``num_prompts`` prompts of varied
    length, each repeated ``responses_per_prompt`` times (a GRPO group)."""
    g = torch.Generator().manual_seed(cfg.seed * 1000 + step)
    lengths = [3 + (i * 2) % 5 for i in range(cfg.num_prompts)]
    P = max(lengths)
    rows, masks = [], []
    for n in lengths:
        ids = torch.randint(3, 97, (n,), generator=g)
        for _ in range(cfg.responses_per_prompt):
            rows.append(torch.cat([torch.zeros(P - n, dtype=torch.long), ids]))
            masks.append(torch.cat([torch.zeros(P - n, dtype=torch.long), torch.ones(n, dtype=torch.long)]))
    return torch.stack(rows), torch.stack(masks)


def stand_in_reward(responses: list[torch.Tensor]) -> np.ndarray:
    """A stand-in reward per response: the fraction of its tokens that are even ids."""
    return np.array([float((r % 2 == 0).float().mean()) if len(r) else 0.0 for r in responses])


def group_advantages(rewards: np.ndarray, group: int) -> np.ndarray:
    """GRPO advantages: reward minus its group's mean, over the group's std (+1e-6)."""
    r = rewards.reshape(-1, group)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)).reshape(-1)


def training_rows(seqs: list[torch.Tensor], prompt_lens: list[int], index: list[int]):
    """Right-padded shifted inputs of samples ``index``: ``input_ids = seq[:-1]``, labels ``seq[1:]``
    on response positions only (-100 elsewhere), the attention mask. A rank with no sample gets one
    placeholder token (mask 1, no label)."""
    if not index:
        return (torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long),
                torch.full((1, 1), -100, dtype=torch.long))
    S = max(len(seqs[i]) - 1 for i in index)
    ids = torch.zeros(len(index), S, dtype=torch.long)
    mask = torch.zeros(len(index), S, dtype=torch.long)
    labels = torch.full((len(index), S), -100, dtype=torch.long)
    for b, i in enumerate(index):
        s = seqs[i]
        n = len(s) - 1
        ids[b, :n] = s[:-1]
        mask[b, :n] = 1
        pos = torch.arange(n)
        resp = pos + 1 >= prompt_lens[i]  # the label s[t + 1] is a generated token
        labels[b, :n] = torch.where(resp, s[1:], torch.full_like(s[1:], -100))
    return ids, mask, labels


def policy_loss(model, ids, mask, labels, adv: torch.Tensor, denom: int) -> torch.Tensor:
    """``-sum_t A_n log p(label_t) / denom`` over labelled positions (denom: labelled tokens of the
    whole global batch, so partial losses of ranks and micro-batches add up to the batch loss)."""
    logits = model(ids, attention_mask=mask).logits.float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    keep = (labels != -100).float()
    return -(adv[:, None] * logp * keep).sum() / denom


def _spec(cfg: Config):
    from relibra_moe.specs import ClusterSpec, ModelSpec

    n_moe = cfg.num_layers - (1 if cfg.num_layers > 2 else 0)  # the tiny Qwen3-MoE has one dense layer
    model = ModelSpec("tiny-qwen3-moe", hidden=32, ffn=16, num_experts=cfg.num_experts, top_k=cfg.top_k,
                      num_layers=n_moe, num_heads=4, num_kv_heads=2, head_dim=8)
    cluster = ClusterSpec(nodes=cfg.world // cfg.gpus_per_node, gpus_per_node=cfg.gpus_per_node)
    return model, cluster


# ----------------------------------------------------------------------------------------- worker
def _worker(rank: int, cfg: Config, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("TRITON_INTERPRET", "0")
    # a finite collective timeout: a rank that fails never leaves its peers waiting forever
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=cfg.world,
                            timeout=timedelta(seconds=cfg.collective_timeout_s))
    try:
        result = _step(rank, cfg)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _make_optimizer(params, cfg: Config) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    raise ValueError(f"optimizer={cfg.optimizer!r} is not one of ('adamw', 'sgd')")


def _step(rank: int, cfg: Config) -> dict:
    """``cfg.steps`` RL steps on this rank; the per-step records (rank 0 also has the rollout timings)."""
    from relibra_moe.integrations.hf import swap_moe_blocks
    from relibra_moe.integrations.hf_tiny import tiny_model
    from relibra_moe.planners.service import Planner

    def fresh():
        return tiny_model("qwen3_moe", seed=cfg.seed, num_layers=cfg.num_layers, num_experts=cfg.num_experts,
                          top_k=cfg.top_k)

    model = fresh()
    reference = copy.deepcopy(model).train()  # plain HF model: every sample, all experts local, live routing
    ref_opt = _make_optimizer(reference.parameters(), cfg)
    rollout_state = copy.deepcopy(model.state_dict())  # what the rollout engine holds
    swap_moe_blocks(model, replica_slots=cfg.replica_slots, gpus_per_node=cfg.gpus_per_node)
    model.train()
    opt = _make_optimizer(model.parameters(), cfg)
    planner = None
    if rank == 0:
        spec, cluster = _spec(cfg)
        # migration=False, portfolio=False: at this toy size moving an expert never pays for itself in the
        # step-time model, so the default pricing (and the portfolio's static candidate) would keep every expert
        # home; the example wants the relayout path exercised
        planner = Planner(spec, cluster, strategy=cfg.strategy, replica_slots=cfg.replica_slots, workers=1,
                          executor="inline", seed=cfg.seed, migration=False, portfolio=False)
    records = []
    try:
        for step in range(cfg.steps):
            # the gathered state dict the step checked is also the weight sync to the rollout engine
            record, rollout_state = _one_step(rank, cfg, step, model, opt, reference, ref_opt, rollout_state,
                                              planner, fresh)
            records.append(record)
    finally:
        if planner is not None:
            planner.close()
    return {"rank": rank, "steps": records}


def _one_step(rank: int, cfg: Config, step: int, model, opt, reference, ref_opt, rollout_state, planner,
              fresh) -> tuple[dict, dict[str, torch.Tensor]]:
    """One RL step (rollout on rank 0 from ``rollout_state``, plan, relayout, train, check against the
    reference); returns (the step's record, the trained model's gathered HF state dict)."""
    from relibra_moe.integrations.hf import RoutingRecorder, full_state_dict, moe_blocks, replay
    from relibra_moe.layers.moe import materialize_counts
    from relibra_moe.layers.relayout import relayout

    G = cfg.world
    timings: dict[str, float] = {}

    # 1-2. rollout with the recorder, plan in the background while the reward is computed (rank 0)
    if rank == 0:
        t0 = time.perf_counter()
        rollout = fresh()
        rollout.load_state_dict(rollout_state)
        prompts, pmask = make_prompts(cfg, step)
        torch.manual_seed(cfg.seed + step)  # sampled responses: the members of a group differ
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
        rewards = stand_in_reward([s[p:] for s, p in zip(seqs, prompt_lens)])  # overlaps the planner
        adv = group_advantages(rewards, cfg.responses_per_prompt)
        plan = future.result()
        timings["plan_wait_s"] = time.perf_counter() - t1
        payload = [batch, seqs, prompt_lens, adv, plan]
    else:
        payload = [None] * 5
    dist.broadcast_object_list(payload, src=0)
    batch, seqs, prompt_lens, adv, plan = payload
    denom = sum(len(s) - p for s, p in zip(seqs, prompt_lens))  # labelled tokens of the batch

    # 3. relayout to the plan's placement: experts move with their optimizer state (none before step 1)
    layers = [b for _, _, b in moe_blocks(model)]
    state_before = sum(len(opt.state.get(p, {})) > 0 for p in model.parameters())
    moved = relayout(model, plan.placement, opt)
    opt.zero_grad(set_to_none=True)

    # 4. micro-batched forward / backward with replay and the replica plan
    M, L = plan.num_micro_batches, len(layers)
    seen = np.zeros((M, L, G), np.int64)
    loss_sum = torch.zeros(())
    for m in range(M):
        mine = [int(i) for i in np.flatnonzero((plan.samples.micro_batch == m) & (plan.samples.gpu == rank))]
        ids, mask, labels = training_rows(seqs, prompt_lens, mine)
        with replay(model, batch, plan, micro_batch=m, attention_mask=mask) as rows:
            assert rows == mine, (rows, mine)
            a = torch.tensor([adv[i] for i in mine] or [0.0], dtype=torch.float32)
            loss = policy_loss(model, ids, mask, labels, a, denom)
        loss.backward()
        loss_sum += loss.detach()
        for li, layer in enumerate(layers):
            seen[m, li, rank] = layer.last_load
    expert_names = {n for n, _ in model.named_parameters() if ".mlp.experts." in n}
    for n, p in model.named_parameters():
        if n not in expert_names and p.grad is not None:
            dist.all_reduce(p.grad)
    dist.all_reduce(loss_sum)
    dist.all_reduce(torch.from_numpy(seen))  # seen is written in place through the shared storage
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()

    # reference step on the same data
    ref_opt.zero_grad(set_to_none=True)
    rids, rmask, rlabels = training_rows(seqs, prompt_lens, list(range(len(seqs))))
    ref_loss = policy_loss(reference, rids, rmask, rlabels, torch.tensor(adv, dtype=torch.float32), denom)
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.grad is not None}
    ref_opt.step()
    ref_params = dict(reference.named_parameters())

    # compare: dense parameters whole, expert parameters on this rank's home rows
    patol = cfg.atol if cfg.optimizer == "sgd" else max(cfg.atol, cfg.adamw_param_atol_lr * cfg.lr)
    home = {}
    for _, name, b in moe_blocks(model):
        home[f"{name}.experts."] = torch.as_tensor(b.home_experts)
    grad_err = param_err = 0.0
    ok = set(grads) == set(ref_grads)
    for n, g in grads.items():
        r, p_ref = ref_grads[n], ref_params[n].detach()
        prefix = next((k for k in home if n.startswith(k)), None)
        if prefix is not None:
            r, p_ref = r[home[prefix]], p_ref[home[prefix]]
        scale = float(r.abs().max()) + 1e-12
        grad_err = max(grad_err, float((g - r).abs().max()) / scale)
        if cfg.optimizer == "sgd" or step == 0:
            ok &= torch.allclose(g, r, rtol=cfg.rtol, atol=cfg.atol)
        else:
            ok &= float((g - r).abs().max()) <= cfg.adamw_grad_rtol * scale + cfg.atol
        p = dict(model.named_parameters())[n].detach()
        param_err = max(param_err, float((p - p_ref).abs().max()))
        ok &= torch.allclose(p, p_ref, rtol=cfg.rtol, atol=patol)

    # the gathered HF state dict (expert shards back in logical order) is the reference model's
    full = full_state_dict(model)
    ref_sd = reference.state_dict()
    state_ok = list(full) == list(ref_sd) and all(
        torch.allclose(full[k], ref_sd[k], rtol=cfg.rtol, atol=patol) for k in ref_sd)
    state_err = max(float((full[k] - ref_sd[k]).abs().max()) for k in ref_sd)

    # expected per-rank loads from the trace and the plan
    x = batch.loads(plan.samples.gpu, G, plan.samples.micro_batch)  # [M, L, G(source), E]
    exact = np.zeros((M, L, G), np.int64)
    frac = np.zeros((M, L, G))
    split_pairs = np.zeros((M, L), np.int64)
    for m in range(M):
        shares = plan.replicas.shares(plan.placement, m)  # [L, G(source), E, G(dest)]
        for li in range(L):
            for j in range(G):
                exact[m, li] += materialize_counts(x[m, li, j], shares[li, j]).sum(axis=0)
            frac[m, li] = np.einsum("je,jeg->g", x[m, li].astype(np.float64), shares[li])
            split_pairs[m, li] = int(((shares[li] > 0).sum(-1) > 1).sum())
    record = {
        "step": step, "loss": float(loss_sum), "ref_loss": float(ref_loss.detach()),
        "ref_grad_norm": float(torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values()))),
        "grads_ok": bool(ok), "grad_rel_err": grad_err, "param_abs_err": param_err,
        "state_ok": bool(state_ok), "state_abs_err": state_err,
        "loads_seen": seen.tolist(), "loads_exact": exact.tolist(), "loads_frac": frac.tolist(),
        "split_pairs": split_pairs.tolist(),
        "replicas": int((plan.replicas.replica_expert >= 0).sum()), "experts_moved": moved["experts_moved"],
        "optimizer_state_params_at_relayout": int(state_before),
        "micro_batches": M, "timings": timings, "plan_stats": {k: v for k, v in plan.stats.to_dict().items()
                                                             if isinstance(v, (int, float, str))},
    }
    return record, full


# ----------------------------------------------------------------------------------------- driver
def run(cfg: Config | None = None) -> dict:
    """Run the steps on ``cfg.world`` spawned gloo processes; returns the summary with the checks (of every
    step) and ``steps``, one record per step as rank 0 saw it."""
    cfg = cfg or Config()
    with tempfile.TemporaryDirectory(prefix="relibra-rl-") as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(cfg, init_file, tmp), nprocs=cfg.world, join=True)
        results = [json.loads(Path(tmp, f"rank{r}.json").read_text())["steps"] for r in range(cfg.world)]
    checks: dict[str, bool] = {}
    for s, r0 in enumerate(results[0]):
        seen, exact, frac = (np.array(r0[k]) for k in ("loads_seen", "loads_exact", "loads_frac"))
        bound = np.array(r0["split_pairs"])[..., None]
        step_checks = {
            "loss_matches_reference": abs(r0["loss"] - r0["ref_loss"]) <= cfg.rtol * max(1.0, abs(r0["ref_loss"])),
            "grads_and_step_match_reference": all(r[s]["grads_ok"] for r in results),
            "gathered_state_dict_matches_reference": all(r[s]["state_ok"] for r in results),
            "loads_equal_plan": bool((seen == exact).all()),
            "loads_within_rounding_of_plan": bool((np.abs(seen - frac) <= bound + 1e-9).all()),
            "loads_cover_every_token": bool((seen.sum(-1) == exact.sum(-1)).all()),
            "nontrivial": abs(r0["ref_loss"]) > 1e-6 and r0["ref_grad_norm"] > 1e-6,
        }
        checks.update({f"step{s}: {k}": v for k, v in step_checks.items()})
    steps = [{k: v for k, v in r.items() if k not in ("loads_exact", "loads_frac", "split_pairs")}
             for r in results[0]]
    for s, rec in enumerate(steps):
        rec["max_grad_rel_err"] = max(r[s]["grad_rel_err"] for r in results)
        rec["max_param_abs_err"] = max(r[s]["param_abs_err"] for r in results)
    return {"config": asdict(cfg), "checks": checks, "ok": all(checks.values()), "steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=Config.num_prompts)
    ap.add_argument("--responses", type=int, default=Config.responses_per_prompt)
    ap.add_argument("--new-tokens", type=int, default=Config.max_new_tokens)
    ap.add_argument("--micro-batch-size", type=int, default=Config.micro_batch_size)
    ap.add_argument("--replica-slots", type=int, default=Config.replica_slots)
    ap.add_argument("--strategy", default=Config.strategy)
    ap.add_argument("--steps", type=int, default=Config.steps, help="RL steps (each re-plans and re-lays out)")
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default=Config.optimizer)
    ap.add_argument("--check", action="store_true", help="exit 1 when a check fails")
    args = ap.parse_args(argv)
    cfg = Config(num_prompts=args.prompts, responses_per_prompt=args.responses, max_new_tokens=args.new_tokens,
                 micro_batch_size=args.micro_batch_size, replica_slots=args.replica_slots, strategy=args.strategy,
                 steps=args.steps, optimizer=args.optimizer)
    out = run(cfg)
    for rec in out["steps"]:
        rec.pop("loads_seen")
    print(json.dumps(out, indent=2))
    return 0 if (out["ok"] or not args.check) else 1


if __name__ == "__main__":
    sys.exit(main())
