"""Reading pickled dumps (``torch.save`` files, plain pickles) without running code from them.

A pickle is a program: each ``GLOBAL`` names a callable the loader imports and calls, so loading a crafted
file can do anything its author wants (write a file, start a process). The RL frameworks write their dumps as
pickles (``torch.save``, verl's ``DataProto.save_to_disk``), so this module reads them with an allow-list:

* ``torch.save`` (zip) files go through ``torch.load(weights_only=True)`` (torch's own restricted
  unpickler: tensors, containers and primitives) inside a ``torch.serialization.safe_globals`` context that
  adds only :data:`NUMPY_GLOBALS` (numpy arrays, dtypes and scalars, through the checked constructors below)
  and the framework classes a caller names (``stubs``: ``"verl.protocol.DataProto"`` and the like), which
  unpickle to :class:`PickledObject` (a plain record of the constructor arguments and state; no framework code
  is imported or run);
* plain pickles go through :class:`RestrictedUnpickler`, a ``pickle.Unpickler`` whose ``find_class`` returns
  only the same allow-list (and a few harmless builtins); every other global is a ``TraceError`` naming it.
  With no global but these, a pickle can only build containers, primitives, numpy arrays and records: it
  cannot call anything else, so it cannot run code.

Sizes are bounded before anything is allocated: the file and a zip's declared members at most
:data:`~relibra_moe.npzio.MAX_MEMBER_BYTES` (the limit of every other reader), a numpy array's declared
``shape x itemsize`` too (checked before numpy allocates it), a tensor's elements by the storage that holds
them (a stride-0 tensor declaring 2^30 rows over 8 bytes is refused), and the object tree by
:data:`MAX_OBJECTS` nodes counted with repeats (a shared-reference "billion laughs" bomb) and
:data:`MAX_DEPTH` levels. ``trust=True`` (the CLI's ``--trust-pickle``) loads with the frameworks' own
classes instead (``torch.load(weights_only=False)`` / ``pickle``): only for files you wrote yourself; the size
checks still apply afterwards. Every failure is a ``TraceError`` naming the file.
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools
import re
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .errors import TraceError
from .npzio import MAX_MEMBER_BYTES
from .validate import is_int

__all__ = ["MAX_OBJECTS", "MAX_DEPTH", "NUMPY_GLOBALS", "PickledObject", "RestrictedUnpickler", "load_pickle",
           "load_torch", "check_tree", "is_zip"]

#: Most nodes (containers, arrays, scalars; a node referenced n times counts n times) of a loaded object tree.
MAX_OBJECTS = 1 << 26
#: Deepest nesting of containers in a loaded object tree (the dumps nest a few levels; a deeper one is hostile).
MAX_DEPTH = 64

_TRUST_HINT = ("pass --trust-pickle (trust=True) only if you wrote the file yourself: it then runs the "
               "pickle's own code")


def _declared_bytes(shape: Any, dtype: Any, where: str) -> int:
    """``prod(shape) x itemsize`` in Python integers, TraceError unless a shape of ints >= 0 and a dtype whose
    total is at most MAX_MEMBER_BYTES."""
    if not isinstance(dtype, np.dtype):
        raise TraceError(f"{where}: a pickled numpy array with dtype {type(dtype).__name__}, not a numpy dtype")
    if is_int(shape):
        shape = (shape,)
    if not isinstance(shape, tuple) or not all(is_int(s) and s >= 0 for s in shape):
        raise TraceError(f"{where}: a pickled numpy array declares shape {shape!r}, not a tuple of ints >= 0")
    n = math.prod(shape) * max(int(dtype.itemsize), 1)
    if n > MAX_MEMBER_BYTES:
        raise TraceError(f"{where}: a pickled numpy array declares shape {list(shape)} of {dtype} = {n} bytes, "
                         f"over the limit of {MAX_MEMBER_BYTES} bytes (relibra_moe.npzio.MAX_MEMBER_BYTES); not read")
    return n


class _CheckedArray(np.ndarray):
    """The ndarray a pickle rebuilds: its ``__setstate__`` checks the declared shape and data before numpy's."""

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise TraceError(f"a pickled numpy array with a state of {type(state).__name__}, not numpy's tuple")
        shape, dtype, data = state[-4], state[-3], state[-1]
        n = _declared_bytes(shape, dtype, "pickle")
        count = math.prod(shape) if isinstance(shape, tuple) else int(shape)
        if dtype.hasobject:
            if not isinstance(data, list) or len(data) != count:
                raise TraceError(f"a pickled object array declares {count} items, its data is not a list of them")
        elif not isinstance(data, (bytes, bytearray)) or len(data) != n:
            got = len(data) if isinstance(data, (bytes, bytearray)) else type(data).__name__
            raise TraceError(f"a pickled numpy array declares shape {list(shape)} of {dtype} = {n} bytes, its "
                             f"data has {got}")
        super().__setstate__(state)


def _reconstruct(subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
    """numpy's ``_reconstruct`` (the empty array ``__setstate__`` then fills), for ``numpy.ndarray`` only,
    with the declared size bounded."""
    if subtype is not _NDARRAY:
        raise TraceError(f"a pickled numpy array of class {getattr(subtype, '__name__', subtype)!r}: only plain "
                         "numpy.ndarray is read")
    dt = np.dtype(dtype) if isinstance(dtype, (bytes, str)) else dtype
    _declared_bytes(shape, dt, "pickle")
    return np.ndarray.__new__(_CheckedArray, shape, dt)


def _frombuffer(buf: Any, dtype: Any, shape: Any, order: str) -> np.ndarray:
    """numpy's ``_frombuffer`` (protocol-5 arrays): the data's length must be the declared size."""
    n = _declared_bytes(shape, dtype, "pickle")
    data = bytes(buf.raw()) if isinstance(buf, pickle.PickleBuffer) else buf
    if dtype.hasobject or not isinstance(data, (bytes, bytearray)) or len(data) != n or order not in ("C", "F"):
        raise TraceError(f"a pickled numpy array declares shape {list(shape)} of {dtype} (order {order!r}) = "
                         f"{n} bytes, its data is not that")
    return np.frombuffer(data, dtype=dtype).reshape(shape, order=order)


def _scalar(dtype: Any, obj: Any = None) -> Any:
    """numpy's ``scalar`` (a pickled numpy scalar) for a plain dtype and its bytes."""
    if not isinstance(dtype, np.dtype) or dtype.hasobject or not isinstance(obj, bytes) \
            or len(obj) != dtype.itemsize:
        raise TraceError(f"a pickled numpy scalar of dtype {dtype!r} with data of {type(obj).__name__}")
    return np.frombuffer(obj, dtype=dtype)[0]


def _encode(text: Any, encoding: str = "utf-8") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles use it for bytes: latin-1 only."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise TraceError(f"a pickle calls _codecs.encode with {type(text).__name__}, {encoding!r}")
    return text.encode("latin-1")


def _bytearray(*args: Any) -> bytearray:
    """``bytearray`` from its pickled bytes or text only (``bytearray(2**40)`` would allocate)."""
    if not args:
        return bytearray()
    if isinstance(args[0], bytes) and len(args) == 1:
        return bytearray(args[0])
    if isinstance(args[0], str) and len(args) == 2 and args[1] in ("latin1", "latin-1"):
        return bytearray(args[0].encode("latin-1"))
    raise TraceError(f"a pickle calls bytearray with {[type(a).__name__ for a in args]}")


def _size(dims: Any = ()) -> tuple[int, ...]:
    """``torch.Size`` in a plain pickle, read as the tuple of its ints (torch is not needed to read it)."""
    dims = tuple(dims) if isinstance(dims, (list, tuple)) else dims
    if not isinstance(dims, tuple) or not all(is_int(d) for d in dims):
        raise TraceError(f"a pickled torch.Size of {dims!r}, not a sequence of ints")
    return dims


class _NDArrayName:
    """What the pickle name ``numpy.ndarray`` stands for: a token ``_reconstruct`` accepts (the real class is
    never handed to the unpickler, whose ``NEWOBJ`` would allocate any shape it is given)."""


_NDARRAY = _NDArrayName

#: The numpy names of a pickled array, dtype or scalar (numpy 1 and 2 spellings) and what each loads as.
NUMPY_GLOBALS: dict[str, Any] = {
    **{f"{m}.multiarray._reconstruct": _reconstruct for m in ("numpy.core", "numpy._core")},
    **{f"{m}.numeric._frombuffer": _frombuffer for m in ("numpy.core", "numpy._core")},
    **{f"{m}.multiarray.scalar": _scalar for m in ("numpy.core", "numpy._core")},
    "numpy.ndarray": _NDARRAY,
    "numpy.dtype": np.dtype,
    **{f"numpy.dtypes.{n}": getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")},
}

_PLAIN_GLOBALS: dict[str, Any] = {
    "_codecs.encode": _encode, "builtins.bytearray": _bytearray, "builtins.set": set,
    "builtins.frozenset": frozenset, "collections.OrderedDict": OrderedDict, "io.BytesIO": io.BytesIO,
    "_io.BytesIO": io.BytesIO, "torch.Size": _size,
}


class PickledObject:
    """A framework object read without its class: the arguments it was built with and its pickled state.

    ``pickled_name`` is the class's ``module.qualname``; ``args`` the constructor arguments, ``state`` what
    ``__setstate__`` received (``None`` if nothing). :func:`stub_class` makes one subclass per name."""

    pickled_name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> PickledObject:
        obj = super().__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<pickled {self.pickled_name}>"


def stub_class(name: str) -> type[PickledObject]:
    """A :class:`PickledObject` subclass standing for the pickled class ``name`` (``module.qualname``)."""
    return type(name.rsplit(".", 1)[-1], (PickledObject,), {"pickled_name": name})


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :data:`NUMPY_GLOBALS`, a few builtins and ``stubs``
    (``{"module.qualname": PickledObject subclass}``); anything else is a ``TraceError`` naming it."""

    def __init__(self, file: Any, where: str, stubs: Mapping[str, type] | None = None) -> None:
        super().__init__(file)
        self._where, self._allowed = where, {**NUMPY_GLOBALS, **_PLAIN_GLOBALS, **(stubs or {})}

    def find_class(self, module: str, name: str) -> Any:
        full = f"{'builtins' if module == '__builtin__' else module}.{name}"  # protocol 2 spells Python 2's name
        if full in self._allowed:
            return self._allowed[full]
        raise TraceError(f"{self._where}: the pickle names {full!r}, which is not on the allow-list of classes a "
                         f"dump may hold (numpy arrays, containers, the framework's record classes); {_TRUST_HINT}")

    def persistent_load(self, pid: Any) -> Any:
        raise TraceError(f"{self._where}: the pickle holds a persistent reference (a torch storage outside a "
                         f"torch.save zip); {_TRUST_HINT}")


class _TrustingUnpickler(pickle.Unpickler):
    """Plain ``pickle`` with the stubs in place of the framework classes (``trust=True``)."""

    def __init__(self, file: Any, stubs: Mapping[str, type]) -> None:
        super().__init__(file)
        self._stubs = stubs

    def find_class(self, module: str, name: str) -> Any:
        return self._stubs.get(f"{module}.{name}") or super().find_class(module, name)


def _read_bounded(path: Path, where: str) -> bytes:
    try:
        size = path.stat().st_size
        if size > MAX_MEMBER_BYTES:
            raise TraceError(f"{where}: {size} bytes, over the limit of {MAX_MEMBER_BYTES} bytes "
                             "(relibra_moe.npzio.MAX_MEMBER_BYTES); not read")
        return path.read_bytes()
    except OSError as exc:
        raise TraceError(f"{where}: cannot read it ({exc.strerror or exc})") from None


def _guard(where: str, fn: Any) -> Any:
    """``fn()`` with every failure of a hostile or damaged pickle turned into a TraceError naming ``where``."""
    try:
        return fn()
    except TraceError as exc:
        msg = str(exc)
        raise TraceError(msg if msg.startswith(where) else f"{where}: {msg}") from None
    except MemoryError:
        raise TraceError(f"{where}: loading it ran out of memory (a pickle bomb, or a damaged file)") from None
    except RecursionError:
        raise TraceError(f"{where}: the pickle nests deeper than Python can follow (a hostile file)") from None
    except ModuleNotFoundError as exc:
        raise TraceError(f"{where}: reading it needs the module {exc.name!r} (the file pickles one of its "
                         "classes); install it, or save the fields as plain tensors / dicts") from None
    except pickle.UnpicklingError as exc:  # torch's weights-only unpickler: name the global it refused
        m = re.search(r"GLOBAL (\S+?)[ ,]|unrecognized function (\S+)|build (.+?)$", str(exc), re.M)
        what = f"names {(m.group(1) or m.group(2) or m.group(3))!r}, which is" if m else "holds something"
        raise TraceError(f"{where}: the pickle {what} not on the allow-list of classes a dump may hold (tensors, "
                         f"numpy arrays, containers, the framework's record classes); {_TRUST_HINT}") from None
    except Exception as exc:  # noqa: BLE001 - the unpicklers raise anything a damaged stream provokes
        raise TraceError(f"{where}: not a readable pickle ({type(exc).__name__}: {str(exc)[:300]})") from None


def _check_lengths(data: bytes, where: str) -> None:
    """Walk the opcodes (``pickletools.genops``, which reads each counted argument from the bytes at hand) so a
    length no file holds is refused before ``pickle`` allocates it (``BYTEARRAY8`` allocates its declared size
    before reading)."""
    try:
        for _ in pickletools.genops(data):
            pass
    except (ValueError, EOFError, OverflowError) as exc:
        raise TraceError(f"{where}: a damaged or forged pickle ({exc})") from None


def load_pickle(data: bytes, where: str, *, stubs: Mapping[str, type] | None = None, trust: bool = False) -> Any:
    """The object of the plain pickle ``data`` (read with :class:`RestrictedUnpickler`, or plain ``pickle``
    when ``trust``), checked by :func:`check_tree`; TraceError naming ``where``."""
    if len(data) > MAX_MEMBER_BYTES:
        raise TraceError(f"{where}: a pickle of {len(data)} bytes, over the limit of {MAX_MEMBER_BYTES} bytes")

    def load() -> Any:
        if not trust:
            _check_lengths(data, where)
        f = io.BytesIO(data)
        up = _TrustingUnpickler(f, stubs or {}) if trust else RestrictedUnpickler(f, where, stubs)
        return check_tree(up.load(), where)

    return _guard(where, load)


def is_zip(data: bytes) -> bool:
    """Whether ``data`` starts like a zip archive (``torch.save``'s format since torch 1.6)."""
    return data[:4] == b"PK\x03\x04"


def _check_zip(data: bytes, where: str) -> None:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            total = sum(i.file_size for i in zf.infolist())
    except (zipfile.BadZipFile, zlib.error, OSError, ValueError, EOFError) as exc:
        raise TraceError(f"{where}: a damaged torch.save zip ({type(exc).__name__}: {exc})") from None
    if total > MAX_MEMBER_BYTES:
        raise TraceError(f"{where}: its zip members declare {total} bytes in all, over the limit of "
                         f"{MAX_MEMBER_BYTES} bytes (relibra_moe.npzio.MAX_MEMBER_BYTES); not read")


def load_torch(source: Path | bytes, where: str, *, stubs: Mapping[str, type] | None = None,
               trust: bool = False) -> Any:
    """The object of a ``torch.save`` file (``source``: its path or bytes), read by ``torch.load(weights_only=True)``
    with :data:`NUMPY_GLOBALS` and ``stubs`` allowed (``trust``: ``weights_only=False``), checked by
    :func:`check_tree`. A file that is not a zip (a plain pickle, torch's legacy format) is read by
    :func:`load_pickle`. TraceError naming ``where``."""
    data = _read_bounded(source, where) if isinstance(source, Path) else source
    if not is_zip(data):
        obj = load_pickle(data, where, stubs=stubs, trust=trust)
        if is_int(obj) and obj == 0x1950A86A20F9469CFC6C:  # torch's legacy-format magic number
            raise TraceError(f"{where}: torch's legacy (pre-1.6) save format, which allocates what it declares "
                             f"before reading it; re-save it with torch.save's default format, or {_TRUST_HINT}")
        return obj
    _check_zip(data, where)
    import torch

    def load() -> Any:
        if trust:
            return check_tree(torch.load(io.BytesIO(data), map_location="cpu", weights_only=False), where)
        allowed = [(v, k) for k, v in {**NUMPY_GLOBALS, **(stubs or {})}.items()]
        # BUILD may fill a checked array; the name no GLOBAL can spell (a newline) keeps NEWOBJ from making one
        allowed.append((_CheckedArray, "relibra\nchecked-ndarray"))
        # Exactly this allow-list: torch keeps one process-wide set and resolves a name to whichever entry its
        # iteration meets last, so an entry another library added for the same name (accelerate and transformers
        # allow the real numpy rebuild functions) could replace a size-checked one here, or widen what a dump holds.
        saved = torch.serialization.get_safe_globals()
        torch.serialization.clear_safe_globals()
        try:
            torch.serialization.add_safe_globals(allowed)
            return check_tree(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True), where)
        finally:
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals(saved)

    return _guard(where, load)


def _check_tensor(t: Any, where: str) -> None:
    n = t.numel() * t.element_size()
    if t.layout != __import__("torch").strided:
        raise TraceError(f"{where}: a tensor of layout {t.layout}; dumps hold dense tensors")
    have = t.untyped_storage().nbytes()
    if n > MAX_MEMBER_BYTES or n > have:
        raise TraceError(f"{where}: a tensor of shape {list(t.shape)} and strides {list(t.stride())} spans {n} "
                         f"bytes over a storage of {have} (stride 0 or overlapping rows, or over the limit of "
                         f"{MAX_MEMBER_BYTES} bytes); refused")


#: Types a loaded tree ends in (no children to walk).
_LEAVES = (str, bytes, bytearray, int, float, complex, type(None), np.ndarray, np.generic)


def check_tree(obj: Any, where: str) -> Any:
    """``obj`` after checking the loaded tree: at most :data:`MAX_DEPTH` levels, :data:`MAX_OBJECTS` nodes
    counted with repeats, tensors no larger than their storage. Checked arrays become plain ``np.ndarray``
    views. TraceError naming ``where``."""
    sizes: dict[int, int] = {}
    keep: list[Any] = []  # ids stay unique while the walk runs

    def walk(o: Any, depth: int) -> tuple[Any, int]:
        if depth > MAX_DEPTH:
            raise TraceError(f"{where}: the pickled objects nest deeper than {MAX_DEPTH} levels (or refer to "
                             "themselves)")
        if isinstance(o, _CheckedArray):
            return o.view(np.ndarray), 1
        if isinstance(o, _LEAVES):
            return o, 1
        if id(o) in sizes:
            return o, sizes[id(o)]
        keep.append(o)
        total = 1
        if isinstance(o, list):
            for i, v in enumerate(o):
                o[i], n = walk(v, depth + 1)
                total += n
        elif isinstance(o, dict):
            for k in list(o):
                o[k], n = walk(o[k], depth + 1)
                total += n
        elif isinstance(o, (tuple, set, frozenset)):
            items = [walk(v, depth + 1) for v in o]
            total += sum(n for _, n in items)
            if isinstance(o, tuple) and any(a is not b for (a, _), b in zip(items, o, strict=True)):
                o = type(o)(a for a, _ in items) if type(o) is tuple else o
        elif isinstance(o, PickledObject):
            o.args, n1 = walk(o.args, depth + 1)
            o.state, n2 = walk(o.state, depth + 1)
            total += n1 + n2
        elif type(o).__module__.startswith("torch") and hasattr(o, "untyped_storage"):
            _check_tensor(o, where)
        if total > MAX_OBJECTS:
            raise TraceError(f"{where}: the pickled objects expand to more than {MAX_OBJECTS} nodes (shared "
                             "references repeated: a pickle bomb)")
        sizes[id(o)] = total
        return o, total

    return walk(obj, 0)[0]
