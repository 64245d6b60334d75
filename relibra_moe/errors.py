"""The library's error types.

Every error names the offending field and value. All are ``ValueError`` subclasses so callers that
already catch ``ValueError`` keep working.
"""

from __future__ import annotations


class RelibraError(ValueError):
    """Base class of every error raised for bad input."""


class TraceError(RelibraError):
    """A routing trace (or its file) is malformed: shape, dtype, id range, duplicate ids, version."""


class PlanError(RelibraError):
    """A plan breaks a rule: wrong shape, an expert homed twice, a share that does not sum to 1, ..."""


class ReplayError(RelibraError):
    """Replayed routing does not match the batch a layer sees (token count, k, id range, duplicates)."""
