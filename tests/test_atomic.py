"""atomic_write: the target changes only when the block completes; failures leave it and no temporary file."""

from __future__ import annotations

import errno
import os

import pytest

from relibra_moe.atomic import atomic_write, write_json, write_text
from relibra_moe.errors import PlanError, TraceError


def _names(d):
    return sorted(p.name for p in d.iterdir())


def test_a_completed_block_replaces_the_file_with_its_permissions(tmp_path):
    target = tmp_path / "f.json"
    write_text(target, "old")
    os.chmod(target, 0o640)
    write_json(target, {"a": 1}, indent=1)
    assert target.read_text() == '{\n "a": 1\n}\n' and _names(tmp_path) == ["f.json"]
    assert target.stat().st_mode & 0o777 == 0o640
    write_text(tmp_path / "new.txt", "x")
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "new.txt").stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_an_exception_in_the_block_keeps_the_old_file(tmp_path, exc):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    with pytest.raises(type(exc)), atomic_write(target) as f:
        f.write(b"new, partial")
        raise exc
    assert target.read_bytes() == b"old" and _names(tmp_path) == ["f.bin"]


def test_an_unserializable_value_leaves_the_file(tmp_path):
    write_text(tmp_path / "f.json", "old")
    with pytest.raises(TypeError):
        write_json(tmp_path / "f.json", {"a": object()})
    assert (tmp_path / "f.json").read_text() == "old"


def test_bad_targets_are_named_errors(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        write_text(tmp_path / "missing" / "f.json", "x")
    with pytest.raises(TraceError, match="is a directory"):
        write_text(tmp_path, "x", error=TraceError)


def test_disk_full_and_read_only_are_named_errors(tmp_path, monkeypatch):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(PlanError, match="No space left on device.*unchanged"), atomic_write(target) as f:
        f.write(b"new")
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert target.read_bytes() == b"old" and _names(tmp_path) == ["f.bin"]
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        os.chmod(ro, 0o500)
        try:
            with pytest.raises(PlanError, match="Permission denied"):
                write_text(ro / "f.json", "x")
        finally:
            os.chmod(ro, 0o700)


def test_mode_is_checked(tmp_path):
    with pytest.raises(ValueError, match="mode"), atomic_write(tmp_path / "f", "a"):
        pass
