"""A plan's diagnostics, typed: ``PlanStats`` (``BatchPlan.stats``) and the records nested in it.

Every field is optional: ``None`` means the strategy did not record it, and a field that is ``None`` is left out
of the plan file, so a plan's ``stats_json`` holds exactly the keys its strategy wrote (plan files keep their
bytes). A key this version does not know (a newer file) is kept in ``extra`` and written back as it was read.

Seconds are wall-clock only in ``timing`` and ``solve_seconds`` (``TIMING_FIELDS``: left out of saved files unless
asked); every other figure in seconds is a modelled time (the cost model or the step simulator).

Reading a field by key (``plan.stats["migration"]["layers_kept"]``) still works, on the JSON form of the
stats, with a ``DeprecationWarning`` naming the attribute to read instead (``plan.stats.migration.layers_kept``);
it will be removed in the next release.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .errors import PlanError

__all__ = ["PlanStats", "MigrationStats", "PortfolioStats", "RelocateStats", "EplbHistoryStats", "DeadlineStats",
           "TIMING_FIELDS"]

TIMING_FIELDS = ("solve_seconds", "timing")
"""``PlanStats`` fields holding wall-clock values: left out of saved files unless asked (byte-deterministic plans)."""


class _Record:
    """JSON form (``to_dict`` / ``from_dict``) of a stats dataclass: ``None`` fields are absent, nested records
    (``_NESTED``) are converted, unknown keys live in ``extra`` (every record has one); key reads are the
    deprecated shim."""

    _NESTED: ClassVar[dict[str, type[_Record]]] = {}

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the record: its set fields (nested records as objects) and ``extra``."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.name == "extra" or value is None:
                continue
            out[f.name] = value.to_dict() if isinstance(value, _Record) else value
        out.update(self.extra)  # type: ignore[attr-defined]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        """The record of a JSON object (a plan file's, or one written by hand); keys it does not know go to
        ``extra``. PlanError naming the record when a field it needs is missing."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}  # type: ignore[arg-type]
        known = {k: v for k, v in data.items() if k in names}
        for k, sub in cls._NESTED.items():
            if isinstance(known.get(k), dict):
                known[k] = sub.from_dict(known[k])
        missing = sorted(f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                         if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                         and f.name not in known)
        if missing:
            raise PlanError(f"stats record {cls.__name__} needs {missing}, got keys {sorted(data)}")
        return cls(**known, extra={k: v for k, v in data.items() if k not in names})

    # --- deprecated Mapping reads, on the JSON form -------------------------------------------------------------

    def _warn(self, key: str | None) -> None:
        """DeprecationWarning for a Mapping read: ``stats[key]`` (the attribute instead), or (``key=None``) a
        read of the whole mapping (``to_dict`` instead)."""
        if key is None:
            msg = "reading stats as a Mapping is deprecated; read stats.to_dict() instead"
        else:
            fields = {f.name for f in dataclasses.fields(self)} - {"extra"}  # type: ignore[arg-type]
            attr = f"stats.{key}" if key in fields else f"stats.extra[{key!r}]"
            msg = f"stats[{key!r}] is deprecated; read the attribute ({attr}) instead"
        warnings.warn(msg, DeprecationWarning, stacklevel=3)

    def __getitem__(self, key: str) -> Any:
        self._warn(key)
        return self.to_dict()[key]

    def get(self, key: str, default: Any = None) -> Any:
        self._warn(key)
        return self.to_dict().get(key, default)

    def __contains__(self, key: object) -> bool:
        self._warn(key)
        return key in self.to_dict()

    def keys(self) -> Any:
        self._warn(None)
        return self.to_dict().keys()

    def items(self) -> Any:
        self._warn(None)
        return self.to_dict().items()

    def __iter__(self) -> Any:
        self._warn(None)
        return iter(self.to_dict())


@dataclass
class MigrationStats(_Record):
    """What the migration pricing did (``planners.migration.migrate``; docs/method.md, "Migration").

    Attributes:
        enabled: False with option ``migration=False`` (nothing else is then set).
        relabel: int ``[G]``: GPU g of the annealed plan became GPU ``relabel[g]`` (a fabric symmetry).
        moved_after_relabel: experts (count over (layer, expert)) off their previous homes after the relabelling.
        moved: experts off their previous homes in relibra's own plan (the portfolio may return another
            candidate, ``PortfolioStats.chosen``; ``sim.simulate_step(...).experts_moved`` counts the returned plan's).
        layers_kept: layers whose previous homes were kept, sorted.
        gain_s: float ``[L]`` modelled step seconds the new homes of each layer save.
        move_s: float ``[L]`` modelled seconds of moving each layer's experts on their own.
        relayout_s: modelled seconds of the taken moves together.
        credit_s: float ``[L]``, with option ``move_horizon`` > 1 and ``previous_loads`` where some layer got one:
            the seconds of later savings credited to each taken layer's move (``migration.horizon_gains``).
        samples_fixed: True when the trainer owns the samples (the relabelling was priced, not free).
    """

    enabled: bool
    relabel: list[int] | None = None
    moved_after_relabel: int | None = None
    moved: int | None = None
    layers_kept: list[int] | None = None
    gain_s: list[float] | None = None
    move_s: list[float] | None = None
    relayout_s: float | None = None
    credit_s: list[float] | None = None
    samples_fixed: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class PortfolioStats(_Record):
    """relibra's portfolio (``planners.portfolio``; docs/method.md, "The portfolio").

    Attributes:
        chosen: the chosen candidate's name (``"relibra"``, ``"static@length-balanced"``, ...).
        step_s: every judged candidate's score (modelled seconds, ``portfolio.portfolio_score``), by name.
        pruned: candidates not built, by name: their lower bound (modelled seconds) already reached the best score.
        credit_s: with option ``move_horizon`` > 1 and ``previous_loads``, the credit (seconds of expected later
            savings, ``migration.horizon_gains``) already taken off the score of each judged candidate that moves
            experts, by name.
    """

    chosen: str
    step_s: dict[str, float]
    pruned: dict[str, float] | None = None
    credit_s: dict[str, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RelocateStats(_Record):
    """The locality pass for the homes the migration pricing kept (``planners.annealing.relocate``).

    Attributes:
        chosen: ``"annealed"`` or ``"start"``, the pass whose samples the plan keeps.
        annealed, start: each pass's exact locality objective (modelled seconds), or ``{"fallback": reason}``.
    """

    chosen: str
    annealed: float | dict[str, str] | None = None
    start: float | dict[str, str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class EplbHistoryStats(_Record):
    """eplb-history's layout (``planners.history``).

    Attributes:
        window: past batches the layout was computed from (0: none yet, or the task fell back).
        layout: ``"eplb"``, or why not (``"trivial (no history yet)"``, ``"fallback (...)"``).
        relabel: int ``[G]``: the GPU relabelling towards the previous homes.
    """

    window: int
    layout: str
    relabel: list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class DeadlineStats(_Record):
    """The ``Planner`` service's deadline (``planners.service``).

    Attributes:
        deadline_s: the deadline, wall-clock seconds after ``submit``.
        interrupts_tasks: whether a late task is interrupted (pool / Ray executors) or only its result dropped.
    """

    deadline_s: float
    interrupts_tasks: bool
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class PlanStats(_Record):
    """``BatchPlan.stats``: what the strategy did. Every field optional (``None``: not recorded).

    Attributes:
        strategy: the strategy's name; seed: the plan seed; replica_slots: r; repack: whether samples could
            change micro-batch.
        options: the ``PlanOptions`` fields not at their default (JSON values), by name.
        sample_owner: ``"trainer"`` when the trainer owns the sample placement (absent: the planner).
        overlap: the cluster's overlap rule when not ``"none"``.
        sample_placement: the samples' start placement when not round-robin.
        fallbacks: tasks that fell back (count).
        objective: the last locality pass's exact objective (modelled seconds).
        rounds: per round of ``planners.annealing.anneal_inter``, ``{"reorder": info, "locality": info}`` (the
            annealers' info dicts: objectives in modelled seconds).
        final_reorder: the final reorder's info (option ``final_reorder``).
        locality: a baseline's repacking pass info (``repack=True``).
        migration, relocate, portfolio, eplb_history, deadline: the nested records.
        eplb_replicas_dropped: redundant-expert slots EPLB left empty (count).
        replica_fetch: how an online plan's replicas are fetched (``"after-router"``).
        executor, workers, executor_fallback: the ``Planner`` service's executor, its processes, and why it fell
            back to another executor.
        fallback_cells: the ``Planner``'s fallen-back cells by stage (``executor.FallbackLog.as_dict``).
        batch_sha1: the batch's digest (``evaluate.batch_sha1``): a plan is for this batch.
        solve_seconds: wall-clock seconds of the planning call; timing: wall-clock seconds by stage (both left out
            of saved files unless asked: ``TIMING_FIELDS``).
        extra: keys this version does not know (from a newer file), kept as read.
    """

    _NESTED: ClassVar[dict[str, type[_Record]]] = {
        "migration": MigrationStats, "portfolio": PortfolioStats, "relocate": RelocateStats,
        "eplb_history": EplbHistoryStats, "deadline": DeadlineStats}

    strategy: str | None = None
    seed: int | None = None
    replica_slots: int | None = None
    repack: bool | None = None
    options: dict[str, Any] | None = None
    sample_owner: str | None = None
    overlap: str | None = None
    sample_placement: str | None = None
    fallbacks: int | None = None
    objective: float | None = None
    rounds: list[dict[str, Any]] | None = None
    final_reorder: dict[str, Any] | None = None
    locality: dict[str, Any] | None = None
    migration: MigrationStats | None = None
    relocate: RelocateStats | None = None
    portfolio: PortfolioStats | None = None
    eplb_history: EplbHistoryStats | None = None
    eplb_replicas_dropped: int | None = None
    replica_fetch: str | None = None
    executor: str | None = None
    workers: int | None = None
    executor_fallback: str | None = None
    deadline: DeadlineStats | None = None
    fallback_cells: dict[str, Any] | None = None
    batch_sha1: str | None = None
    solve_seconds: float | None = None
    timing: dict[str, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def timings(self) -> dict[str, float]:
        """``timing`` (wall-clock seconds by stage), created empty on first use: the planners add to it."""
        if self.timing is None:
            self.timing = {}
        return self.timing

    @property
    def move_credited(self) -> bool:
        """Whether the plan's moves were taken on option ``move_horizon``'s credit: the portfolio's chosen candidate
        was credited, or (relibra-inter, no portfolio) some layer's move was. A runner then gives the next
        ``move_horizon - 1`` batches no ``previous_loads`` (``steady.plan_steady``, the ``Planner``): a credited
        re-layout serves the batches it was credited for before another one can be."""
        pf, mig = self.portfolio, self.migration
        if pf is not None:
            return bool(pf.credit_s and pf.credit_s.get(pf.chosen, 0.0) > 0.0)
        return bool(mig is not None and mig.credit_s and any(c > 0.0 for c in mig.credit_s))

    def saved(self, include_timing: bool = False) -> dict[str, Any]:
        """The JSON object a plan file holds: ``to_dict`` without ``TIMING_FIELDS`` unless ``include_timing``."""
        out = self.to_dict()
        return out if include_timing else {k: v for k, v in out.items() if k not in TIMING_FIELDS}
