"""Checked reads of ``.npz`` members: nothing is allocated before its declared size is checked.

A member's ``.npy`` header declares its shape and dtype; ``numpy.load`` allocates that much memory before
reading a byte of data, so a damaged or hostile header (say shape ``(8, 24, 2**36)``) costs a
``MemoryError`` or worse. :func:`member_header` reads only the header (``numpy.lib.format.read_magic`` /
``read_array_header_*``) and checks it:

* the dtype holds no Python objects (nothing is unpickled);
* the declared size (``prod(shape) * itemsize``, in Python integers: no overflow) is at most
  ``max_bytes`` (default :data:`MAX_MEMBER_BYTES`);
* the declared size equals the bytes the member actually stores after its header (the zip entry's
  uncompressed size), so a header cannot claim more data than the file has.

:func:`read_member` reads the data only after these checks (and the caller's expected dtype kinds and
rank). Errors are the caller's type (``TraceError``, ``PlanError``) and name the file and the member.
"""

from __future__ import annotations

import math
import zipfile
import zlib
from pathlib import Path

import numpy as np
from numpy.lib import format as npformat

__all__ = ["MAX_MEMBER_BYTES", "member_header", "read_member"]

#: Largest member read from a trace or plan file, bytes (16 GiB): above any real file of the formats (a
#: 10^9-token trace of 24 layers, k = 4, int16 ids is 192 GB only uncompressed on disk, and is read lazily
#: in that case, through this same check, by raising the limit explicitly), and below what a training
#: node's host memory holds; a header claiming more is rejected before any allocation.
MAX_MEMBER_BYTES = 1 << 34


def member_header(data: np.lib.npyio.NpzFile, key: str, where: str, error: type[Exception], *,
                  max_bytes: int = MAX_MEMBER_BYTES) -> tuple[tuple[int, ...], np.dtype]:
    """The declared ``(shape, dtype)`` of member ``key`` of the open archive ``data``, checked as the module
    docstring says; ``error`` (naming ``where``, e.g. the file, and ``key``) when it does not hold."""
    zf: zipfile.ZipFile = data.zip
    name = key + ".npy"
    try:
        info = zf.getinfo(name)
        with zf.open(info) as fp:
            version = npformat.read_magic(fp)
            if version == (1, 0):
                shape, _, dtype = npformat.read_array_header_1_0(fp)
            elif version in ((2, 0), (3, 0)):
                shape, _, dtype = npformat.read_array_header_2_0(fp)
            else:
                raise ValueError(f"unknown .npy format version {version}")
            offset = fp.tell()
    except KeyError:
        raise error(f"{where}: missing key {key!r}") from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise error(f"{where}: key {key!r} is truncated or corrupt (unreadable .npy header: "
                    f"{type(exc).__name__}: {exc})") from None
    shape = tuple(int(s) for s in shape)
    if dtype.hasobject:
        raise error(f"{where}: key {key!r} holds Python objects (pickled) of dtype {dtype}; these files hold "
                    "plain numeric / string arrays only")
    declared = math.prod(shape) * int(dtype.itemsize)
    if declared > max_bytes:
        raise error(f"{where}: key {key!r} declares shape {list(shape)} of {dtype} = {declared} bytes, over the "
                    f"limit of {max_bytes} bytes (relibra_moe.npzio.MAX_MEMBER_BYTES); not read")
    stored = int(info.file_size) - offset
    if declared != stored:
        raise error(f"{where}: key {key!r} declares shape {list(shape)} of {dtype} = {declared} bytes, but "
                    f"stores {stored} bytes of data (a damaged or forged header)")
    return shape, dtype


def read_member(data: np.lib.npyio.NpzFile, key: str, where: str | Path, error: type[Exception], *,
                kinds: str | None = None, ndim: int | None = None, max_bytes: int = MAX_MEMBER_BYTES) -> np.ndarray:
    """Member ``key`` of ``data`` after :func:`member_header`'s checks; ``kinds`` (numpy dtype kinds, e.g.
    ``"iu"``) and ``ndim`` are checked on the header too. ``error`` names ``where`` and ``key``."""
    where = str(where)
    shape, dtype = member_header(data, key, where, error, max_bytes=max_bytes)
    if kinds is not None and dtype.kind not in kinds:
        raise error(f"{where}: key {key!r} has dtype {dtype}, expected kind {kinds!r}")
    if ndim is not None and len(shape) != ndim:
        raise error(f"{where}: key {key!r} has shape {list(shape)}, expected {ndim} dimension(s)")
    try:
        return data[key]
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise error(f"{where}: key {key!r} is truncated or corrupt ({type(exc).__name__}: {exc})") from None

