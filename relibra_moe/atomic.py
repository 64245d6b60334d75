"""Writing a file so that a failure never destroys the previous one.

:func:`atomic_write` hands out a temporary file in the target's directory; when the ``with`` block ends
normally it is flushed, ``fsync``'ed and ``os.replace``'d over the target (atomic on POSIX and Windows for
a rename within one directory), then the directory entry is synced. An exception (or a ``KeyboardInterrupt``)
inside the block, a full disk or any failure to flush removes the temporary file and leaves the target as
it was: either the previous complete file or none, never a partial one. Errors are the caller's type
(``PlanError``, ``TraceError``) naming the path: a missing directory, a directory as target, a read-only or
full file system.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from .errors import PlanError

__all__ = ["atomic_write", "check_target", "write_text", "write_json"]


def check_target(path: str | os.PathLike, error: type[Exception] = PlanError) -> None:
    """``error`` naming ``path`` when it cannot be written: it is a directory, or its directory is missing (a
    command checks its ``--out`` with this before working for minutes)."""
    path = Path(path)
    if path.is_dir():
        raise error(f"cannot write {os.fspath(path)!r}: it is a directory")
    parent = path.parent
    if not parent.is_dir():
        raise error(f"cannot write {os.fspath(path)!r}: the directory {os.fspath(parent)!r} does not exist")


def _fsync_dir(directory: Path) -> None:
    """Persist the rename (best effort: some file systems and Windows cannot open a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _mode_for(path: Path) -> int:
    """The permission bits the target gets: its current ones, else ``0o666`` less the umask (as ``open`` gives)."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", *, error: type[Exception] = PlanError,
                 encoding: str | None = None) -> Iterator[IO[Any]]:
    """A file object (``mode`` ``"wb"`` or ``"w"``) whose content replaces ``path`` only when the block completes.

    Raises:
        error: the target is a directory or its directory is missing, or writing, flushing or renaming
            failed (disk full, read-only file system, no permission); the message names the path and the
            cause. The previous file at ``path``, if any, is then unchanged.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write: mode={mode!r} is not 'w' or 'wb'")
    target = Path(path)
    check_target(target, error)
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:
        raise error(f"cannot write {os.fspath(target)!r}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, mode, encoding=encoding if mode == "w" else None) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _mode_for(target))
        os.replace(tmp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise error(f"cannot write {os.fspath(target)!r}: {exc.strerror or exc} (the previous file, if any, is "
                    "unchanged)") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)


def write_text(path: str | os.PathLike, text: str, *, error: type[Exception] = PlanError) -> None:
    """Write ``text`` (UTF-8) to ``path`` through :func:`atomic_write`."""
    with atomic_write(path, "w", error=error, encoding="utf-8") as f:
        f.write(text)


def write_json(path: str | os.PathLike, obj: Any, *, error: type[Exception] = PlanError, **dumps: Any) -> None:
    """``json.dumps(obj, **dumps)`` plus a newline to ``path`` through :func:`atomic_write` (the text is built
    first, so an unserializable value leaves the file untouched)."""
    write_text(path, json.dumps(obj, **dumps) + "\n", error=error)
