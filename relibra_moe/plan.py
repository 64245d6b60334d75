"""Plans are data: frozen dataclasses of numpy arrays, validated, with a versioned ``.npz`` format.

A ``BatchPlan`` for one global batch holds

- ``Placement``: the home GPU of every expert in every MoE layer (``expert_gpu [L, E]``); every GPU
  homes exactly E / G experts of each layer.
- ``SamplePlacement``: for every sample of the batch, its micro-batch and the GPU whose attention runs
  it (that GPU is the token's *source* in the cost model).
- ``ReplicaPlan``: per micro-batch and layer, which expert sits in each of the r replica slots of each
  GPU (``replica_expert [M, L, G, r]``, -1 empty) and how the tokens of a replicated expert are split
  between its home and its replicas (``split_index [Z, 5]`` rows ``(m, l, j, e, g)`` with
  ``split_share [Z]``: the share of the tokens from source GPU j for expert e served on GPU g).
  Shares of one ``(m, l, j, e)`` sum to 1. A replicated expert with no rows for some source j sends
  all of j's tokens home; experts without replicas have no rows.
- ``stats``: a ``plan_stats.PlanStats`` (strategy, seed, solve seconds, objective values, fallbacks), saved as JSON.

File format (``np.savez``, ``allow_pickle=False``), version 1: ``version``, ``num_gpus``,
``gpus_per_node``, ``num_experts``, ``num_layers``, ``replica_slots``, ``num_micro_batches``,
``replica_scope``, ``expert_gpu``, ``sample_micro_batch``, ``sample_gpu``, ``replica_expert``,
``split_index``, ``split_share``, ``stats_json``.

``replica_scope`` is ``"node"`` (replicas live in the home's node: ReLibra, LPLB) or ``"global"``
(anywhere in the EP group: EPLB's redundant experts).
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .atomic import atomic_write
from .errors import PlanError
from .npzio import read_member
from .plan_stats import TIMING_FIELDS, PlanStats
from .specs import ClusterSpec, ModelSpec

PLAN_VERSION = 1
TIMING_KEYS = TIMING_FIELDS  # the stats holding wall-clock values: left out of saved files unless asked
SHARE_TOL = 1e-5
_SCOPES = ("node", "global")


def max_replica_slots(num_experts: int, num_gpus: int) -> int:
    """The ceiling of ``replica_slots`` (r, slots per GPU): ``E - E / G``.

    A GPU never holds a replica of an expert it homes (E / G of them) nor one expert twice, so slots
    beyond the E - E / G experts homed elsewhere always stay empty; each slot still costs one expert's
    weights of GPU memory (``specs.replica_buffer_bytes``) and planning work per (micro-batch, layer)
    cell. A request above it is an error, not a silent clamp.
    """
    return int(num_experts) - int(num_experts) // int(num_gpus)


def check_replica_slots(replica_slots: int, num_experts: int, num_gpus: int, field: str = "replica_slots") -> None:
    """``PlanError`` naming ``field`` when ``replica_slots`` is over :func:`max_replica_slots` (the one check
    of a requested ``replica_slots``: ``Planner``, ``plan_batch`` and the integrations that allocate replica slots
    all call it)."""
    cap = max_replica_slots(num_experts, num_gpus)
    if int(replica_slots) > cap:
        raise PlanError(f"{field}={int(replica_slots)} is over the ceiling E - E/G = {cap} (E={int(num_experts)}, "
                        f"G={int(num_gpus)}: a GPU holds replicas of only the experts homed elsewhere; more slots "
                        "always stay empty and cost memory and planning time)")


def _readonly(a: Any, dtype: Any, name: str) -> np.ndarray:
    """A read-only copy of ``a`` as ``dtype``; PlanError (naming ``name``) instead of a lossy conversion.

    Integer fields accept integer arrays (and floats holding whole numbers) within the dtype's range;
    a fractional value or one that would wrap around is rejected, never truncated.
    """
    src = np.asarray(a)
    dtype = np.dtype(dtype)
    if dtype.kind in "iu" and src.size:
        if src.dtype.kind not in "iuf":
            raise PlanError(f"{name} must hold integers, got dtype {src.dtype}")
        if src.dtype.kind == "f":
            bad = ~np.isfinite(src) | (src != np.round(src))
            if bad.any():
                i = tuple(int(v) for v in np.argwhere(bad)[0])
                raise PlanError(f"{name}{list(i)} = {src[i]} is not a whole number")
        info = np.iinfo(dtype)
        lo, hi = src.min(), src.max()
        if lo < info.min or hi > info.max:
            raise PlanError(f"{name} values must fit {dtype} ([{info.min}, {info.max}]), got range [{lo}, {hi}]")
    out = np.array(src, dtype=dtype, copy=True)
    out.setflags(write=False)
    return out


@dataclass(frozen=True)
class Placement:
    """Home GPU of every expert: ``expert_gpu`` int32 ``[L, E]``."""

    expert_gpu: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "expert_gpu", _readonly(self.expert_gpu, np.int32, "expert_gpu"))
        if self.expert_gpu.ndim != 2:
            raise PlanError(f"expert_gpu must be [L, E], got shape {self.expert_gpu.shape}")

    @property
    def num_layers(self) -> int:
        """MoE layers L."""
        return self.expert_gpu.shape[0]

    @property
    def num_experts(self) -> int:
        """Experts per layer E."""
        return self.expert_gpu.shape[1]

    @classmethod
    def static(cls, num_layers: int, num_experts: int, num_gpus: int) -> Placement:
        """Megatron-LM's placement: expert e on GPU e // (E / G) in every layer."""
        if num_experts % num_gpus:
            raise PlanError(f"num_experts={num_experts} is not divisible by num_gpus={num_gpus}")
        row = np.arange(num_experts) // (num_experts // num_gpus)
        return cls(np.tile(row, (num_layers, 1)))

    def validate(self, model: ModelSpec, cluster: ClusterSpec) -> None:
        """Raise PlanError unless ``expert_gpu`` is ``[L, E]`` of the model and every GPU homes E / G experts."""
        L, E, G = model.num_layers, model.num_experts, cluster.num_gpus
        if self.expert_gpu.shape != (L, E):
            raise PlanError(f"expert_gpu has shape {self.expert_gpu.shape}, expected [L={L}, E={E}]")
        if E % G:
            raise PlanError(f"num_experts={E} is not divisible by num_gpus={G}")
        bad = (self.expert_gpu < 0) | (self.expert_gpu >= G)
        if bad.any():
            l, e = np.argwhere(bad)[0]
            raise PlanError(f"expert_gpu[{l}, {e}] = {self.expert_gpu[l, e]} is outside [0, {G})")
        counts = np.stack([np.bincount(row, minlength=G) for row in self.expert_gpu])
        wrong = np.argwhere(counts != E // G)
        if len(wrong):
            l, g = wrong[0]
            raise PlanError(f"expert_gpu: GPU {g} homes {counts[l, g]} experts in layer {l}; every GPU "
                            f"must home exactly E/G = {E // G}")


@dataclass(frozen=True)
class SamplePlacement:
    """Where each sample runs: ``micro_batch`` int32 ``[N]`` and ``gpu`` int32 ``[N]``."""

    micro_batch: np.ndarray
    gpu: np.ndarray
    num_micro_batches: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "micro_batch", _readonly(self.micro_batch, np.int32, "sample_micro_batch"))
        object.__setattr__(self, "gpu", _readonly(self.gpu, np.int32, "sample_gpu"))
        if self.micro_batch.ndim != 1 or self.micro_batch.shape != self.gpu.shape:
            raise PlanError(f"sample_micro_batch {self.micro_batch.shape} and sample_gpu {self.gpu.shape}"
                            " must both be [N]")
        if self.num_micro_batches is None:
            m = int(self.micro_batch.max()) + 1 if self.micro_batch.size else 0
            object.__setattr__(self, "num_micro_batches", m)

    @property
    def num_samples(self) -> int:
        """Samples N."""
        return self.micro_batch.shape[0]

    def validate(self, cluster: ClusterSpec, num_samples: int | None = None) -> None:
        """Raise PlanError unless every sample has a micro-batch in ``[0, M)`` and a GPU in ``[0, G)``.

        ``num_samples``: the batch's N, when known (the placement must cover exactly N samples).
        """
        G, M = cluster.num_gpus, self.num_micro_batches
        if num_samples is not None and self.num_samples != num_samples:
            raise PlanError(f"sample placement covers {self.num_samples} samples, the batch has {num_samples}")
        for name, arr, hi in (("sample_micro_batch", self.micro_batch, M), ("sample_gpu", self.gpu, G)):
            bad = np.flatnonzero((arr < 0) | (arr >= hi))
            if len(bad):
                i = bad[0]
                raise PlanError(f"{name}[{i}] = {arr[i]} is outside [0, {hi}): every sample must run "
                                "somewhere")


@dataclass(frozen=True)
class ReplicaPlan:
    """Replica slots and token splits per micro-batch and layer (see the module docstring)."""

    replica_expert: np.ndarray
    split_index: np.ndarray
    split_share: np.ndarray
    scope: str = "node"

    def __post_init__(self) -> None:
        object.__setattr__(self, "replica_expert", _readonly(self.replica_expert, np.int32, "replica_expert"))
        idx = np.asarray(self.split_index)
        if idx.size == 0:
            idx = idx.reshape(0, 5)
        if idx.ndim != 2 or idx.shape[1] != 5:
            raise PlanError(f"split_index must be [Z, 5] rows (m, l, j, e, g), got shape {idx.shape}")
        object.__setattr__(self, "split_index", _readonly(idx, np.int32, "split_index"))
        share = np.asarray(self.split_share)
        if share.ndim != 1:
            raise PlanError(f"split_share must be [Z], got shape {share.shape}")
        if share.size and share.dtype.kind not in "iuf":
            raise PlanError(f"split_share must be numeric, got dtype {share.dtype}")
        object.__setattr__(self, "split_share", _readonly(share, np.float32, "split_share"))
        if self.replica_expert.ndim != 4:
            raise PlanError(f"replica_expert must be [M, L, G, r], got shape {self.replica_expert.shape}")
        if self.split_share.shape[0] != self.split_index.shape[0]:
            raise PlanError(f"split_share has {self.split_share.shape[0]} rows, split_index has "
                            f"{self.split_index.shape[0]}")
        if self.scope not in _SCOPES:
            raise PlanError(f"replica scope {self.scope!r} is not one of {_SCOPES}")

    @classmethod
    def empty(cls, num_micro_batches: int, num_layers: int, num_gpus: int, replica_slots: int = 0) -> ReplicaPlan:
        """No replicas: every one of the ``replica_slots`` slots per GPU empty, no split rows."""
        return cls(np.full((num_micro_batches, num_layers, num_gpus, replica_slots), -1, np.int32),
                   np.zeros((0, 5), np.int32), np.zeros(0, np.float32))

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches M of ``replica_expert``."""
        return self.replica_expert.shape[0]

    @property
    def replica_slots(self) -> int:
        """Replica slots per GPU r."""
        return self.replica_expert.shape[3]

    @property
    def resident(self) -> bool:
        """Whether these replicas stay resident for the whole batch: several micro-batches, at least one filled
        slot, and every micro-batch's slots hold the same experts (EPLB-style redundant experts).

        The one rule of both sides of "the simulator charges what the layer runs": ``sim.simulate_loads``'s
        ``replica_mode="auto"`` charges such a plan ``persistent`` (pushed once per batch, gradients pulled once),
        and ``ReplayBalancedMoE`` runs it resident (each layer keeps its own slots, filled at the first
        micro-batch, their gradients returned to the homes at the last micro-batch's backward)."""
        rep = self.replica_expert
        return rep.shape[0] > 1 and bool((rep >= 0).any()) and bool((rep == rep[:1]).all())

    @property
    def slots(self) -> int:
        """Deprecated name of ``replica_slots`` (docs/architecture.md, "One name per concept")."""
        import warnings

        warnings.warn("ReplicaPlan.slots is deprecated: use ReplicaPlan.replica_slots", DeprecationWarning,
                      stacklevel=2)
        return self.replica_slots

    def rows_of(self, micro_batch: int, layer: int | None = None) -> np.ndarray:
        """Indices into split_index/split_share of one micro-batch (and layer)."""
        sel = self.split_index[:, 0] == micro_batch
        if layer is not None:
            sel &= self.split_index[:, 1] == layer
        return np.flatnonzero(sel)

    def shares(self, placement: Placement, micro_batch: int) -> np.ndarray:
        """Dense float64 ``[L, G, E, G]`` shares of one micro-batch (one-hot home where not split)."""
        L, E = placement.expert_gpu.shape
        G = self.replica_expert.shape[2]
        out = np.zeros((L, G, E, G))
        l_idx, e_idx = np.meshgrid(np.arange(L), np.arange(E), indexing="ij")
        out[l_idx[:, None, :], np.arange(G)[None, :, None], e_idx[:, None, :],
            placement.expert_gpu[:, None, :]] = 1.0
        rows = self.rows_of(micro_batch)
        if len(rows):
            _, l, j, e, g = self.split_index[rows].T
            out[l, j, e, :] = 0.0
            np.add.at(out, (l, j, e, g), self.split_share[rows].astype(np.float64))
        return out

    def validate(self, placement: Placement, model: ModelSpec, cluster: ClusterSpec,
                 num_micro_batches: int | None = None) -> None:
        """Raise PlanError naming the entry that breaks a rule of the module docstring.

        Rules: ``replica_expert`` is ``[M, L, G, r]`` with ids in ``[-1, E)``, a replica never sits on its
        home GPU, nor (scope "node") outside the home's node, nor twice on one GPU; every split row lies
        in range, targets the home or a GPU holding a replica, appears once; shares lie in ``[0, 1]``
        and the shares of one ``(m, l, j, e)`` sum to 1 (within ``SHARE_TOL``).
        """
        M, L, G, r = self.replica_expert.shape
        E = model.num_experts
        if (L, G) != (model.num_layers, cluster.num_gpus):
            raise PlanError(f"replica_expert has shape {self.replica_expert.shape}, expected "
                            f"[M, L={model.num_layers}, G={cluster.num_gpus}, r]")
        if num_micro_batches is not None and M != num_micro_batches:
            raise PlanError(f"replica_expert covers {M} micro-batches, the plan has {num_micro_batches}")
        cap = max_replica_slots(E, G)
        if r > cap:
            raise PlanError(f"replica_expert has r={r} slots per GPU, over the ceiling E - E/G = {cap} "
                            f"(E={E}, G={G}: a GPU can hold replicas of only the experts homed elsewhere)")
        self._check_rules(placement.expert_gpu, E, cluster.gpus_per_node)

    def validate_layer(self, micro_batch: int, layer: int, expert_gpu: np.ndarray, gpus_per_node: int) -> None:
        """Raise PlanError unless the slice of one ``(micro_batch, layer)`` follows the rules of :meth:`validate`.

        ``expert_gpu``: int ``[E]``, that layer's homes; the GPUs are ``G = replica_expert.shape[2]``,
        ``gpus_per_node`` per node. Reads only that slice (what one MoE layer needs before its forward);
        messages index it as micro-batch 0, layer 0.
        """
        M, L = self.replica_expert.shape[:2]
        if not (0 <= micro_batch < M and 0 <= layer < L):
            raise PlanError(f"(micro_batch, layer) = ({micro_batch}, {layer}) is outside replica_expert's "
                            f"[M={M}, L={L}]")
        rows = self.rows_of(micro_batch, layer)
        idx = self.split_index[rows].copy()
        idx[:, :2] = 0
        one = ReplicaPlan(self.replica_expert[micro_batch, layer][None, None], idx, self.split_share[rows], self.scope)
        home = np.asarray(expert_gpu)[None]
        one._check_rules(home, home.shape[1], gpus_per_node)

    def _check_rules(self, home: np.ndarray, E: int, gpus_per_node: int) -> None:
        """The rules of :meth:`validate` against homes ``home [L, E]`` (shapes checked by the caller)."""
        M, L, G, r = self.replica_expert.shape
        rep = self.replica_expert
        bad = np.argwhere((rep < -1) | (rep >= E))
        if len(bad):
            m, l, g, s = bad[0]
            raise PlanError(f"replica_expert[{m}, {l}, {g}, {s}] = {rep[m, l, g, s]} is outside [-1, {E})")
        node = np.arange(G) // gpus_per_node
        filled = np.argwhere(rep >= 0)
        for m, l, g, s in filled:
            e = rep[m, l, g, s]
            if home[l, e] == g:
                raise PlanError(f"replica_expert[{m}, {l}, {g}, {s}] = expert {e}, which is homed on GPU {g}"
                                " already (a replica must live on another GPU)")
            if self.scope == "node" and node[home[l, e]] != node[g]:
                raise PlanError(f"replica_expert[{m}, {l}, {g}, {s}] = expert {e}: GPU {g} is on node "
                                f"{node[g]}, the home GPU {home[l, e]} on node {node[home[l, e]]}; "
                                "replicas stay inside the home's node")
            if np.count_nonzero(rep[m, l, g] == e) > 1:
                raise PlanError(f"replica_expert[{m}, {l}, {g}] holds expert {e} twice")
        idx, share = self.split_index, self.split_share
        if len(idx) == 0:
            return
        hi = np.array([M, L, G, E, G])
        bad = np.argwhere((idx < 0) | (idx >= hi))
        if len(bad):
            z, c = bad[0]
            name = "mljeg"[c]
            raise PlanError(f"split_index[{z}] = {tuple(idx[z].tolist())}: {name}={idx[z, c]} is outside [0, {hi[c]})")
        if not np.all(np.isfinite(share)) or (share < 0).any() or (share > 1 + SHARE_TOL).any():
            z = np.flatnonzero(~np.isfinite(share) | (share < 0) | (share > 1 + SHARE_TOL))[0]
            raise PlanError(f"split_share[{z}] = {share[z]} is not a fraction in [0, 1]")
        m, l, j, e, g = idx.T
        on_home = home[l, e] == g
        has_rep = (rep[m, l, g] == e[:, None]).any(axis=1)
        wrong = np.flatnonzero(~on_home & ~has_rep & (share > 0))
        if len(wrong):
            z = wrong[0]
            raise PlanError(f"split_index[{z}] = {tuple(idx[z].tolist())} sends tokens of expert {e[z]} to GPU {g[z]}, "
                            "which is neither its home nor holds a replica of it")
        key = (((m.astype(np.int64) * L + l) * G + j) * E + e) * G + g
        uniq, counts = np.unique(key, return_counts=True)
        if (counts > 1).any():
            z = np.flatnonzero(key == uniq[counts > 1][0])[0]
            raise PlanError(f"split_index[{z}] = {tuple(idx[z].tolist())} appears more than once")
        group = key // G
        ug, inv = np.unique(group, return_inverse=True)
        sums = np.bincount(inv, weights=share.astype(np.float64), minlength=len(ug))
        off = np.flatnonzero(np.abs(sums - 1.0) > SHARE_TOL)
        if len(off):
            z = np.flatnonzero(inv == off[0])[0]
            raise PlanError(f"split_share of (m, l, j, e) = {tuple(idx[z, :4].tolist())} sums to {sums[off[0]]:.6g}, "
                            "not 1: every token must be served exactly once")


@dataclass(frozen=True)
class BatchPlan:
    """Everything a training step needs to follow for one global batch."""

    placement: Placement
    samples: SamplePlacement
    replicas: ReplicaPlan
    num_gpus: int
    gpus_per_node: int
    #: what the strategy did (``plan_stats.PlanStats``; a dict given here is read as its JSON form)
    stats: PlanStats = field(default_factory=PlanStats)
    #: the file the plan was loaded from (``None``: built in memory); :meth:`validate`'s errors name it
    origin: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stats, dict):
            object.__setattr__(self, "stats", PlanStats.from_dict(self.stats))
        elif not isinstance(self.stats, PlanStats):
            raise PlanError(f"stats must be a PlanStats (or its JSON dict), got {type(self.stats).__name__}")

    @property
    def num_layers(self) -> int:
        """MoE layers L."""
        return self.placement.num_layers

    @property
    def num_experts(self) -> int:
        """Experts per layer E."""
        return self.placement.num_experts

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches M."""
        return int(self.samples.num_micro_batches)

    @property
    def replica_slots(self) -> int:
        """Replica slots per GPU r."""
        return self.replicas.replica_slots

    @property
    def planned_replica_slots(self) -> int:
        """The replica slots the plan was made for (``stats.replica_slots``; the bound of a ``balanced`` plan is
        the bound for them), else ``replica_slots``."""
        return self.replica_slots if self.stats.replica_slots is None else int(self.stats.replica_slots)

    def validate(self, model: ModelSpec, cluster: ClusterSpec, num_samples: int | None = None) -> None:
        """Raise PlanError naming the field and the rule if the plan does not fit model and cluster (and the
        plan file, for a loaded plan)."""
        try:
            self._validate(model, cluster, num_samples)
        except PlanError as exc:
            if self.origin is None:
                raise
            raise PlanError(f"plan file {self.origin}: {exc}") from None

    def _validate(self, model: ModelSpec, cluster: ClusterSpec, num_samples: int | None) -> None:
        if (self.num_gpus, self.gpus_per_node) != (cluster.num_gpus, cluster.gpus_per_node):
            raise PlanError(f"plan is for {self.num_gpus} GPUs ({self.gpus_per_node} per node), the cluster "
                            f"has {cluster.num_gpus} ({cluster.gpus_per_node} per node)")
        self.placement.validate(model, cluster)
        self.samples.validate(cluster, num_samples)
        self.replicas.validate(self.placement, model, cluster, self.num_micro_batches)

    def save(self, path: str | os.PathLike, *, include_timing: bool = False) -> None:
        """Write the plan as a version-1 ``.npz`` (deterministic bytes for equal plans).

        The stats in ``TIMING_KEYS`` (wall-clock values) are written only with ``include_timing``.
        """
        stats = self.stats.saved(include_timing)
        arrays = {
            "version": np.array(PLAN_VERSION, np.int32),
            "num_gpus": np.array(self.num_gpus, np.int32),
            "gpus_per_node": np.array(self.gpus_per_node, np.int32),
            "num_experts": np.array(self.num_experts, np.int32),
            "num_layers": np.array(self.num_layers, np.int32),
            "replica_slots": np.array(self.replica_slots, np.int32),
            "num_micro_batches": np.array(self.num_micro_batches, np.int32),
            "replica_scope": np.array(self.replicas.scope),
            "expert_gpu": self.placement.expert_gpu,
            "sample_micro_batch": self.samples.micro_batch,
            "sample_gpu": self.samples.gpu,
            "replica_expert": self.replicas.replica_expert,
            "split_index": self.replicas.split_index,
            "split_share": self.replicas.split_share,
            "stats_json": np.array(json.dumps(stats, sort_keys=True, default=json_default)),
        }
        _save_npz_deterministic(path, arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> BatchPlan:
        """Read a plan file; PlanError names the path (and the key, the index) and the reason when it cannot.

        Every member is read only after its ``.npy`` header's dtype, shape and size are checked
        (:mod:`relibra_moe.npzio`); the scalar fields (``num_gpus``, ``num_layers``, ``num_experts``,
        ``replica_slots``, ``num_micro_batches``) must agree with the arrays' shapes; ``stats_json`` must be
        a JSON object. The plan's own rules are checked by :meth:`validate` (its errors name the file too:
        the plan's ``origin`` is the path).
        """
        where = f"plan file {path}"
        try:
            with np.load(path, allow_pickle=False) as f:
                if not isinstance(f, np.lib.npyio.NpzFile):
                    raise PlanError(f"{where}: not an .npz archive (found a single .npy array)")
                data = {k: read_member(f, k, where, PlanError) for k in f.files}
        except FileNotFoundError:
            raise PlanError(f"{where}: no such file") from None
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            if isinstance(exc, PlanError):
                raise
            raise PlanError(f"{where}: not a readable .npz ({exc})") from None

        def scalar(key: str) -> int:
            v = data[key]
            if v.ndim != 0 or v.dtype.kind not in "iu":
                raise PlanError(f"{where}: key {key!r} must be an integer scalar, got dtype {v.dtype} "
                                f"shape {v.shape}")
            return int(v)

        version = scalar("version") if "version" in data else None
        if version != PLAN_VERSION:
            raise PlanError(f"{where}: version {version} is not supported (expected {PLAN_VERSION})")
        need = ("num_gpus", "gpus_per_node", "expert_gpu", "sample_micro_batch", "sample_gpu",
                "replica_expert", "split_index", "split_share")
        for k in need:
            if k not in data:
                raise PlanError(f"{where}: missing key {k!r}")
        try:
            stats = json.loads(str(data["stats_json"])) if "stats_json" in data else {}
        except json.JSONDecodeError as exc:
            raise PlanError(f"{where}: key 'stats_json' is not valid JSON ({exc})") from None
        if not isinstance(stats, dict):
            raise PlanError(f"{where}: key 'stats_json' must hold a JSON object, got a JSON {type(stats).__name__}")
        m = scalar("num_micro_batches") if "num_micro_batches" in data else None
        scope = str(data["replica_scope"]) if "replica_scope" in data else "node"
        num_gpus, gpus_per_node = scalar("num_gpus"), scalar("gpus_per_node")
        try:
            plan = cls(
                placement=Placement(data["expert_gpu"]),
                samples=SamplePlacement(data["sample_micro_batch"], data["sample_gpu"], m),
                replicas=ReplicaPlan(data["replica_expert"], data["split_index"], data["split_share"], scope),
                num_gpus=num_gpus, gpus_per_node=gpus_per_node, stats=stats, origin=str(path))
        except PlanError as exc:
            raise PlanError(f"{where}: {exc}") from None
        rep = plan.replicas.replica_expert.shape
        declared = {"num_layers": plan.num_layers, "num_experts": plan.num_experts, "num_gpus": rep[2],
                    "replica_slots": rep[3], "num_micro_batches": rep[0]}
        shapes = {"num_layers": "expert_gpu [L, E]", "num_experts": "expert_gpu [L, E]",
                  "num_gpus": "replica_expert [M, L, G, r]", "replica_slots": "replica_expert [M, L, G, r]",
                  "num_micro_batches": "replica_expert [M, L, G, r]"}
        for key, actual in declared.items():
            if key in data and scalar(key) != int(actual):
                raise PlanError(f"{where}: key {key!r} = {scalar(key)}, but {shapes[key]} says {int(actual)}")
        if rep[1] != plan.num_layers:
            raise PlanError(f"{where}: replica_expert has shape {list(rep)}, expert_gpu covers L={plan.num_layers}")
        return plan


def json_default(o: Any) -> Any:
    """``json.dumps(..., default=json_default)``: numpy integers, floats, bools and arrays as plain JSON values.

    Raises:
        TypeError: any other type (what ``json`` expects of a ``default`` hook).
    """
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"value of type {type(o).__name__} is not JSON-serializable")


def _save_npz_deterministic(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
    """Like ``np.savez`` but with fixed zip timestamps, so equal plans give equal bytes."""
    import io

    from numpy.lib import format as npformat

    with atomic_write(path, "wb", error=PlanError) as f, zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, arr in arrays.items():
            buf = io.BytesIO()
            npformat.write_array(buf, np.asarray(arr), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            zf.writestr(info, buf.getvalue())


def round_robin_gpus(micro_batch: np.ndarray, num_gpus: int) -> np.ndarray:
    """int64 ``[N]``: the k-th sample of a micro-batch (in sample order) runs on GPU ``k mod G``, or, when
    the micro-batch has fewer samples B than GPUs, on GPU ``floor(k G / B)`` (spread over all nodes)."""
    mb = np.asarray(micro_batch, dtype=np.int64)
    out = np.empty(mb.shape[0], np.int64)
    for m in np.unique(mb):
        idx = np.flatnonzero(mb == m)
        k = np.arange(len(idx))
        out[idx] = k % num_gpus if len(idx) >= num_gpus else (k * num_gpus) // len(idx)
    return out
