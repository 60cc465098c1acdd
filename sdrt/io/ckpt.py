"""PyTorch checkpoints (.ckpt/.pt/.pth/.bin): zip and legacy formats, read without executing them.

A checkpoint is a pickle that names Python callables (`torch._utils._rebuild_tensor_v2`,
`collections.OrderedDict`, ...) and asks the unpickler to call them. We never do: the pickle
runs on our own small virtual machine (`_PickleVM`, pure Python, like sd.cpp's pickle_io.cpp and
torch's weights_only unpickler). GLOBAL/STACK_GLOBAL only push an inert `_Global(module, name)`
marker, and only names in `_GLOBALS` are accepted at all; REDUCE/NEWOBJ look the marker up in our
own table of handlers that build plain records (a tensor reference, a dict, a tuple). Nothing
is ever imported, no attribute of a file-named object is looked up, and any other global, opcode
or call target raises ModelFileError naming it. There is no fallback to an executing loader.

Layouts
- zip (torch >= 1.6): `<prefix>/data.pkl`, `<prefix>/data/<key>` (one per storage), optional
  `byteorder`, `version`, `.format_version`, `.storage_alignment`, `.data/serialization_id`.
  Storages stored uncompressed (as torch writes them) are memory-mapped from the file: zero copy,
  nothing read until used. Deflated ones (a re-zipped file) are inflated into RAM, capped.
- legacy (torch < 1.6, or `_use_new_zipfile_serialization=False`): pickles of the magic number,
  protocol 1001 and sys_info, then the object pickle, then the sorted storage keys; then for each
  key an 8-byte element count and the raw bytes. Also memory-mapped.

The table: a `state_dict` / `model` / `module` wrapper is unwrapped (sd.cpp and A1111 do too),
nested dicts of tensors are flattened with dots (`string_to_param.*`), non-tensor entries
(global_step, epoch, ...) stay out of the table; top-level scalars go to
`metadata["pickle_scalars"]`. Tensors keep their stored dtype. Those sdrt has no dtype for
(uint8, bool, complex, fnuz float8) and empty tensors are listed in `metadata["skipped"]`.
Rank-0 tensors become ne=(1,) as in sd.cpp; 5-D and higher contiguous tensors fold their top
dims into ne[3] (sd.cpp folds Wan's 5-D patch embedding the same way).
"""
from __future__ import annotations

import codecs
import os
import struct
import zipfile

import numpy as np

from ..errors import ModelFileError
from ..ops.tensor import MAX_DIMS, Tensor
from .base import ConvertedTensor, ModelFile, map_file

__all__ = ["read_ckpt", "is_torch_zip", "is_torch_legacy"]

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001

MAX_PICKLE_BYTES = 256 << 20        # data.pkl larger than this is not a checkpoint we accept
MAX_OPS = 16_000_000                # opcodes per pickle: bounds the objects (RAM) a pickle can make
MAX_LINE = 4096                     # protocol-0 text lines (GLOBAL names, ints)
MAX_LONG_BYTES = 1024               # LONG4 payload
MAX_INFLATE_RATIO = 8               # a deflated storage may not expand more than this
MAX_INFLATE_TOTAL = 8 << 30         # ... nor past this in total (RAM)
MAX_NEST = 8                        # nested dicts flattened into tensor names
MAX_DIMS_ACCEPTED = 8


class _Fail(Exception):
    """Internal: a reason; read_ckpt turns it into a ModelFileError with the path."""


# ---- inert values the VM builds ---------------------------------------------------------------

class _Global:
    """A name a pickle asked for. Never imported, never called."""
    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __eq__(self, o):
        return isinstance(o, _Global) and o.module == self.module and o.name == self.name

    def __hash__(self):
        return hash((self.module, self.name))

    def __repr__(self):
        return f"{self.module}.{self.name}"


class _PickleDict(dict):
    """An OrderedDict from the pickle; BUILD may attach a state (torch's `_metadata`), ignored."""
    __slots__ = ("state",)


class _Opaque:
    """A value we keep no contents of (numpy arrays, training-callback markers)."""
    __slots__ = ("kind",)

    def __init__(self, kind: str):
        self.kind = kind


class _NpDType:
    __slots__ = ("code", "byteorder")

    def __init__(self, code: str):
        self.code, self.byteorder = code, "<"


class _Storage:
    """A storage named by a persistent id: `key` in the archive, `nbytes` declared."""
    __slots__ = ("key", "dtype", "itemsize", "numel", "byte_offset", "nbytes", "root")

    def __init__(self, key, dtype, itemsize, numel, byte_offset=0, root=None):
        self.key, self.dtype, self.itemsize, self.numel = key, dtype, itemsize, numel
        self.byte_offset = byte_offset
        self.nbytes = numel * itemsize
        self.root = root if root is not None else self


class _TensorRef:
    __slots__ = ("storage", "offset", "size", "stride", "dtype", "itemsize")

    def __init__(self, storage, offset, size, stride, dtype, itemsize):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride
        self.dtype, self.itemsize = dtype, itemsize


# torch dtype -> (sdrt dtype, or None when sdrt has none; itemsize; numpy dtype of the raw bytes).
# As the safetensors reader (and sd.cpp) does: F64 -> F32 and I64 -> I32 on first use, BOOL -> I8
# zero copy; dtypes sdrt has no tensor type for go to ModelFile.raw as numpy arrays.
_TORCH_DTYPES = {
    "float32": ("F32", 4, "<f4"), "float64": ("F64", 8, "<f8"), "float16": ("F16", 2, "<f2"),
    "bfloat16": ("BF16", 2, "<u2"), "int64": ("I64", 8, "<i8"), "int32": ("I32", 4, "<i4"),
    "int16": ("I16", 2, "<i2"), "int8": ("I8", 1, "i1"), "bool": ("BOOL", 1, "u1"),
    "float8_e4m3fn": ("F8_E4M3", 1, "u1"), "float8_e5m2": ("F8_E5M2", 1, "u1"),
    "uint8": (None, 1, "u1"), "float8_e4m3fnuz": (None, 1, "u1"), "float8_e5m2fnuz": (None, 1, "u1"),
    "float8_e8m0fnu": (None, 1, "u1"), "uint16": (None, 2, "<u2"), "uint32": (None, 4, "<u4"),
    "uint64": (None, 8, "<u8"), "complex32": (None, 4, "<u4"), "complex64": (None, 8, "<c8"),
    "complex128": (None, 16, "<c16"),
}
for _alias, _name in {"float": "float32", "double": "float64", "half": "float16", "long": "int64",
                      "int": "int32", "short": "int16"}.items():
    _TORCH_DTYPES[_alias] = _TORCH_DTYPES[_name]
# legacy typed storage classes (persistent ids name them) -> torch dtype
_STORAGES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
    "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128", "UntypedStorage": "uint8",
}
_WIDE = {"F64": ("F32", np.float32), "I64": ("I32", np.int32)}
_NP_SCALAR_CODES = {"b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8"}


def _need(cond, msg):
    if not cond:
        raise _Fail(msg)


def _int(x, what):
    _need(type(x) is int, f"{what} must be an int, got {type(x).__name__}")
    return x


def _ints(x, what):
    _need(type(x) is tuple and len(x) <= MAX_DIMS_ACCEPTED,
          f"{what} must be a tuple of at most {MAX_DIMS_ACCEPTED} ints, got {type(x).__name__}")
    for v in x:
        _need(type(v) is int and 0 <= v < (1 << 62), f"{what} holds {v!r}; dims/strides must be ints >= 0")
    return x


# ---- REDUCE / NEWOBJ handlers: our code, building inert records -----------------------------

def _rebuild_tensor(args, dtype_from=None):
    _need(len(args) >= 4, "_rebuild_tensor needs (storage, offset, size, stride, ...)")
    storage, offset, size, stride = args[:4]
    _need(isinstance(storage, _Storage), f"_rebuild_tensor: storage is {type(storage).__name__}, not a storage")
    offset = _int(offset, "storage_offset")
    _need(offset >= 0, f"negative storage_offset {offset}")
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    _need(len(size) == len(stride), f"size {size} and stride {stride} differ in length")
    dtype, itemsize = (storage.dtype, storage.itemsize) if dtype_from is None else dtype_from
    return _TensorRef(storage, offset, size, stride, dtype, itemsize)


def _rebuild_tensor_v3(args):
    _need(len(args) >= 7, "_rebuild_tensor_v3 needs 7 arguments")
    dt = args[6]
    _need(isinstance(dt, _Global) and dt.module == "torch" and dt.name in _TORCH_DTYPES,
          f"_rebuild_tensor_v3: unknown dtype {dt!r}")
    return _rebuild_tensor(args, (dt.name, _TORCH_DTYPES[dt.name][1]))


def _rebuild_parameter(args):
    _need(len(args) >= 1 and isinstance(args[0], _TensorRef), "_rebuild_parameter: data is not a tensor")
    return args[0]


def _rebuild_from_type_v2(args):
    _need(len(args) == 4, "_rebuild_from_type_v2 needs (func, type, args, state)")
    func, new_type, fargs, _state = args
    _need(isinstance(new_type, _Global) and _GLOBALS.get((new_type.module, new_type.name)) == "tensor_type",
          f"_rebuild_from_type_v2: type {new_type!r} is not allowed")
    _need(isinstance(func, _Global) and isinstance(fargs, tuple), "_rebuild_from_type_v2: bad function")
    handler = _REDUCE.get((func.module, func.name))
    _need(handler is not None, f"_rebuild_from_type_v2: refusing to call {func!r}")
    return handler(fargs)


def _ordered_dict(args):
    d = _PickleDict()
    if args:
        _need(len(args) == 1 and type(args[0]) in (list, tuple), "OrderedDict(...) takes one list of pairs")
        for pair in args[0]:
            _need(type(pair) in (list, tuple) and len(pair) == 2, "OrderedDict items must be pairs")
            _setitem(d, pair[0], pair[1])
    return d


def _torch_size(args):
    _need(len(args) == 1, "torch.Size takes one tuple")
    return _ints(tuple(args[0]) if type(args[0]) in (list, tuple) else args[0], "torch.Size")


def _codecs_encode(args):
    _need(len(args) == 2 and type(args[0]) is str and type(args[1]) is str, "_codecs.encode(str, encoding)")
    _need(args[1].lower() in ("latin1", "latin-1", "iso-8859-1", "ascii", "utf-8", "utf8"),
          f"_codecs.encode: encoding {args[1]!r} not allowed")
    return args[0].encode(args[1])


def _set(args):
    s = set()
    if args:
        _need(len(args) == 1 and type(args[0]) in (list, tuple, set, frozenset), "set() takes one iterable")
        for v in args[0]:
            _check_key(v)
            s.add(v)
    return s


def _frozenset(args):
    return frozenset(_set(args))


def _bytearray(args):
    _need(len(args) <= 1, "bytearray() takes at most one argument")
    if not args:
        return b""
    _need(type(args[0]) in (bytes, bytearray), "bytearray() of bytes only")
    return bytes(args[0])


def _np_dtype(args):
    _need(1 <= len(args) <= 3 and type(args[0]) is str, "numpy.dtype(code, ...)")
    code = args[0].lstrip("<>=|")
    _need(code in _NP_SCALAR_CODES, f"numpy dtype {args[0]!r} not allowed")
    return _NpDType(code)


def _np_scalar(args):
    _need(len(args) == 2 and isinstance(args[0], _NpDType) and type(args[1]) is bytes,
          "numpy scalar(dtype, bytes)")
    dt = np.dtype(("<" if args[0].byteorder in "<=|" else ">") + args[0].code)
    _need(len(args[1]) == dt.itemsize, "numpy scalar: byte count does not match its dtype")
    return np.frombuffer(args[1], dt)[0].item()


def _np_reconstruct(args):
    return _Opaque("numpy.ndarray")


def _torch_device(args):
    _need(1 <= len(args) <= 2 and type(args[0]) is str, "torch.device(str[, index])")
    return args[0]


# Every global a pickle may name, and what it is. Anything else: refused by name.
_GLOBALS: dict[tuple[str, str], str] = {
    ("collections", "OrderedDict"): "call",
    ("torch._utils", "_rebuild_tensor"): "call",
    ("torch._utils", "_rebuild_tensor_v2"): "call",
    ("torch._utils", "_rebuild_tensor_v3"): "call",
    ("torch._utils", "_rebuild_parameter"): "call",
    ("torch._utils", "_rebuild_parameter_with_state"): "call",
    ("torch._tensor", "_rebuild_from_type_v2"): "call",
    ("torch", "Size"): "call",
    ("torch", "device"): "call",
    ("_codecs", "encode"): "call",
    ("builtins", "set"): "call", ("__builtin__", "set"): "call",
    ("builtins", "frozenset"): "call", ("__builtin__", "frozenset"): "call",
    ("builtins", "bytearray"): "call", ("__builtin__", "bytearray"): "call",
    ("numpy", "dtype"): "call",
    ("numpy.core.multiarray", "scalar"): "call", ("numpy._core.multiarray", "scalar"): "call",
    ("numpy.core.multiarray", "_reconstruct"): "call", ("numpy._core.multiarray", "_reconstruct"): "call",
    ("numpy", "ndarray"): "marker",
    ("torch", "Tensor"): "tensor_type", ("torch.nn.parameter", "Parameter"): "tensor_type",
    ("torch.storage", "UntypedStorage"): "storage",
    # PyTorch Lightning stores its callback class as a dict key in SD 1.x training checkpoints
    ("pytorch_lightning.callbacks.model_checkpoint", "ModelCheckpoint"): "marker",
    **{("torch", n): "storage" for n in _STORAGES},
    **{("torch", n): "dtype" for n in _TORCH_DTYPES},
}
_REDUCE = {
    ("collections", "OrderedDict"): _ordered_dict,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Size"): _torch_size,
    ("torch", "device"): _torch_device,
    ("_codecs", "encode"): _codecs_encode,
    ("builtins", "set"): _set, ("__builtin__", "set"): _set,
    ("builtins", "frozenset"): _frozenset, ("__builtin__", "frozenset"): _frozenset,
    ("builtins", "bytearray"): _bytearray, ("__builtin__", "bytearray"): _bytearray,
    ("numpy", "dtype"): _np_dtype,
    ("numpy.core.multiarray", "scalar"): _np_scalar, ("numpy._core.multiarray", "scalar"): _np_scalar,
    ("numpy.core.multiarray", "_reconstruct"): _np_reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _np_reconstruct,
}
def _new_ordered_dict(args):
    _need(args == (), "OrderedDict.__new__ takes no arguments")
    return _PickleDict()


_NEWOBJ = {("collections", "OrderedDict"): _new_ordered_dict}

_KEY_TYPES = (str, int, float, bool, bytes, type(None), _Global)


def _check_key(k, depth=0):
    """Dict keys / set items: only flat values, so hashing can never recurse deeply."""
    if type(k) is tuple:
        _need(depth < 2 and len(k) <= 16, "dict key is a nested tuple")
        for v in k:
            _check_key(v, depth + 1)
        return
    _need(type(k) in _KEY_TYPES, f"dict key of type {type(k).__name__} is not allowed")


def _setitem(d, k, v):
    _need(isinstance(d, dict), f"SETITEM on a {type(d).__name__}; only dicts take items")
    _check_key(k)
    _need(k not in d, f"duplicate key {k!r}" if type(k) is str else "duplicate dict key")
    d[k] = v


# ---- the pickle virtual machine ---------------------------------------------------------------

class _PickleVM:
    """Interprets one pickle from `data` (bytes / memoryview) at `pos`. `persistent_load(pid)`
    turns a storage id into a _Storage. Returns (object, end position)."""

    def __init__(self, data, pos, persistent_load, end=None):
        self.data = data
        self.is_bytes = isinstance(data, bytes)
        self.pos = pos
        self.end = len(data) if end is None else end
        self.persistent_load = persistent_load
        self.stack: list = []
        self.marks: list[int] = []
        self.memo: dict = {}
        self.proto = 0

    # -- reading
    def _take(self, n: int) -> bytes:
        p = self.pos
        q = p + n
        if n < 0 or q > self.end:
            raise _Fail(f"pickle truncated: {n} bytes wanted at byte {p}")
        self.pos = q
        b = self.data[p:q]
        return b if self.is_bytes else bytes(b)

    def _byte(self) -> int:
        p = self.pos
        if p >= self.end:
            raise _Fail(f"pickle truncated at byte {p}")
        self.pos = p + 1
        return self.data[p]

    def _u(self, fmt: str, n: int):
        return struct.unpack(fmt, self._take(n))[0]

    def _line(self) -> bytes:
        chunk = bytes(self.data[self.pos:min(self.end, self.pos + MAX_LINE)])
        i = chunk.find(b"\n")
        _need(i >= 0, f"pickle text line at byte {self.pos} is unterminated or too long")
        self.pos += i + 1
        return chunk[:i]

    # -- stack
    def _pop(self):
        _need(len(self.stack) > (self.marks[-1] if self.marks else 0), "pickle stack underflow")
        return self.stack.pop()

    def _top(self):
        _need(len(self.stack) > (self.marks[-1] if self.marks else 0), "pickle stack underflow")
        return self.stack[-1]

    def _pop_mark(self) -> list:
        _need(self.marks, "pickle MARK missing")
        k = self.marks.pop()
        items = self.stack[k:]
        del self.stack[k:]
        return items

    # -- main loop
    def run(self):
        d, disp, end = self.data, _DISPATCH, self.end
        count = 0
        while True:
            pos = self.pos
            if pos >= end:
                raise _Fail("pickle ends without STOP")
            count += 1
            if count > MAX_OPS:
                raise _Fail(f"pickle has more than {MAX_OPS} opcodes")
            h = disp.get(d[pos])
            self.pos = pos + 1
            if h is None:
                raise _Fail(f"pickle opcode {bytes([d[pos]])!r} at byte {pos} is not allowed")
            try:
                stop = h(self)
            except (ValueError, UnicodeDecodeError, struct.error, OverflowError, TypeError) as e:
                raise _Fail(f"malformed pickle at byte {self.pos}: {type(e).__name__}: {e}"[:300]) from None
            if stop:
                _need(not self.marks, "pickle STOP with an open MARK")
                _need(len(self.stack) == 1, "pickle STOP with a stack that is not one object")
                return self.stack[0], self.pos

    # -- opcodes, grouped as in pickletools; a handler returns True only for STOP
    # framing and stack
    def op_proto(self):
        self.proto = self._take(1)[0]
        _need(self.proto <= 5, f"pickle protocol {self.proto} unknown")

    def op_frame(self): _need(self._u("<Q", 8) <= self.end - self.pos, "pickle FRAME past the end")
    def op_stop(self): return True
    def op_mark(self): self.marks.append(len(self.stack))
    def op_pop_mark(self): self._pop_mark()
    def op_dup(self): self.stack.append(self._top())

    def op_pop(self):
        if self.marks and len(self.stack) == self.marks[-1]:
            self.marks.pop()          # POP of a bare MARK
        else:
            self._pop()

    # constants
    def op_none(self): self.stack.append(None)
    def op_true(self): self.stack.append(True)
    def op_false(self): self.stack.append(False)
    def op_binint(self): self.stack.append(self._u("<i", 4))
    def op_binint1(self): self.stack.append(self._byte())
    def op_binint2(self): self.stack.append(self._u("<H", 2))
    def op_binfloat(self): self.stack.append(self._u(">d", 8))
    def op_long1(self): self.stack.append(int.from_bytes(self._take(self._take(1)[0]), "little", signed=True))

    def op_long4(self):
        n = self._u("<i", 4)
        _need(0 <= n <= MAX_LONG_BYTES, f"pickle LONG4 of {n} bytes refused")
        self.stack.append(int.from_bytes(self._take(n), "little", signed=True))

    def _short_line(self, what):
        s = self._line()
        _need(len(s) <= 64, f"pickle {what} too long")
        return s

    def op_int(self):
        s = self._short_line("INT")
        self.stack.append(s == b"01" if s in (b"00", b"01") else int(s))

    def op_long(self):
        s = self._short_line("LONG")
        self.stack.append(int(s[:-1] if s.endswith(b"L") else s))

    def op_float(self): self.stack.append(float(self._short_line("FLOAT")))

    # strings and bytes (py2 8-bit strings: utf-8, else latin-1, as torch's loader does)
    @staticmethod
    def _str8(b: bytes):
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return b.decode("latin-1")

    def op_string(self):
        s = self._line().rstrip()
        _need(len(s) >= 2 and s[:1] == s[-1:] and s[:1] in (b"'", b'"'), "pickle STRING not quoted")
        self.stack.append(self._str8(codecs.escape_decode(s[1:-1])[0]))

    def op_binstring(self):
        n = self._u("<i", 4)
        _need(n >= 0, "negative BINSTRING length")
        self.stack.append(self._str8(self._take(n)))

    def op_short_binstring(self): self.stack.append(self._str8(self._take(self._take(1)[0])))
    def op_unicode(self): self.stack.append(self._line().decode("raw-unicode-escape"))
    def op_binunicode(self): self.stack.append(self._utf8(self._u("<I", 4)))
    def op_short_binunicode(self): self.stack.append(self._utf8(self._take(1)[0]))
    def op_binunicode8(self): self.stack.append(self._utf8(self._u("<Q", 8)))
    def op_binbytes(self): self.stack.append(self._take(self._u("<I", 4)))
    def op_short_binbytes(self): self.stack.append(self._take(self._take(1)[0]))
    def op_binbytes8(self): self.stack.append(self._take(self._u("<Q", 8)))
    def op_bytearray8(self): self.stack.append(self._take(self._u("<Q", 8)))

    def _utf8(self, n):
        at = self.pos
        try:
            return self._take(n).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise _Fail(f"pickle string at byte {at} is not valid UTF-8") from None

    # containers
    def op_empty_tuple(self): self.stack.append(())
    def op_tuple(self): self.stack.append(tuple(self._pop_mark()))
    def op_tuple1(self): self.stack.append((self._pop(),))
    def op_empty_list(self): self.stack.append([])
    def op_list(self): self.stack.append(self._pop_mark())
    def op_empty_dict(self): self.stack.append({})
    def op_empty_set(self): self.stack.append(set())

    def op_tuple2(self):
        b, a = self._pop(), self._pop()
        self.stack.append((a, b))

    def op_tuple3(self):
        c, b, a = self._pop(), self._pop(), self._pop()
        self.stack.append((a, b, c))

    def op_append(self):
        v = self._pop()
        lst = self._top()
        _need(type(lst) is list, f"APPEND to a {type(lst).__name__}; only lists take items")
        lst.append(v)

    def op_appends(self):
        items = self._pop_mark()
        lst = self._top()
        _need(type(lst) is list, f"APPENDS to a {type(lst).__name__}; only lists take items")
        lst.extend(items)

    def op_dict(self):
        items = self._pop_mark()
        _need(len(items) % 2 == 0, "DICT with an odd number of items")
        d = {}
        for i in range(0, len(items), 2):
            _setitem(d, items[i], items[i + 1])
        self.stack.append(d)

    def op_setitem(self):
        v, k = self._pop(), self._pop()
        _setitem(self._top(), k, v)

    def op_setitems(self):
        items = self._pop_mark()
        _need(len(items) % 2 == 0, "SETITEMS with an odd number of items")
        d = self._top()
        for i in range(0, len(items), 2):
            _setitem(d, items[i], items[i + 1])

    def op_additems(self):
        items = self._pop_mark()
        s = self._top()
        _need(type(s) is set, f"ADDITEMS to a {type(s).__name__}")
        for v in items:
            _check_key(v)
            s.add(v)

    def op_frozenset(self):
        items = self._pop_mark()
        for v in items:
            _check_key(v)
        self.stack.append(frozenset(items))

    # globals and calls: markers and our own handlers only
    def _global(self, module, name):
        _need(type(module) is str and type(name) is str, "GLOBAL with a module or name that is not a string")
        if (module, name) not in _GLOBALS:
            raise _Fail(f"refusing global '{module[:100]}.{name[:100]}': not something a tensor checkpoint "
                        "needs (sdrt never imports or calls what a checkpoint names)")
        return _Global(module, name)

    def op_global(self):
        module = self._line().decode("utf-8", "replace")
        self.stack.append(self._global(module, self._line().decode("utf-8", "replace")))

    def op_stack_global(self):
        name, module = self._pop(), self._pop()
        self.stack.append(self._global(module, name))

    def op_reduce(self):
        args, fn = self._pop(), self._pop()
        _need(isinstance(fn, _Global), f"REDUCE of a {type(fn).__name__}; only allowed globals may be called")
        _need(type(args) is tuple, "REDUCE arguments are not a tuple")
        h = _REDUCE.get((fn.module, fn.name))
        if h is None:
            raise _Fail(f"refusing to call '{fn.module}.{fn.name}'")
        self.stack.append(h(args))

    def op_newobj(self):
        args, cls = self._pop(), self._pop()
        self._newobj(cls, args, {})

    def op_newobj_ex(self):
        kwargs, args, cls = self._pop(), self._pop(), self._pop()
        self._newobj(cls, args, kwargs)

    def _newobj(self, cls, args, kwargs):
        _need(isinstance(cls, _Global), f"NEWOBJ of a {type(cls).__name__}")
        _need(type(args) is tuple and not kwargs, "NEWOBJ arguments")
        h = _NEWOBJ.get((cls.module, cls.name))
        if h is None:
            raise _Fail(f"refusing to instantiate '{cls.module}.{cls.name}'")
        self.stack.append(h(args))

    def op_build(self):
        state = self._pop()
        obj = self._top()
        if isinstance(obj, _PickleDict):
            obj.state = state        # torch's state_dict `_metadata`; not used
        elif isinstance(obj, _NpDType):
            _need(type(state) is tuple and len(state) >= 2 and state[1] in ("<", ">", "=", "|"),
                  "numpy dtype state")
            obj.byteorder = state[1]
        elif not isinstance(obj, (_Opaque, _TensorRef)):
            raise _Fail(f"BUILD on a {type(obj).__name__} is not allowed")

    def op_binpersid(self): self.stack.append(self.persistent_load(self._pop()))

    # memo
    def op_get(self): self._get(int(self._short_line("GET")))
    def op_binget(self): self._get(self._byte())
    def op_long_binget(self): self._get(self._u("<I", 4))
    def op_put(self): self._put(int(self._short_line("PUT")))
    def op_binput(self): self._put(self._byte())
    def op_long_binput(self): self._put(self._u("<I", 4))
    def op_memoize(self): self._put(len(self.memo))

    def _get(self, i):
        _need(i in self.memo, f"pickle memo {i} read before it was written")
        self.stack.append(self.memo[i])

    def _put(self, i):
        _need(i >= 0, "negative memo index")
        self.memo[i] = self._top()


_OPS = {
    b"\x80": "proto", b"\x95": "frame", b".": "stop", b"(": "mark", b"0": "pop", b"1": "pop_mark",
    b"2": "dup", b"N": "none", b"\x88": "true", b"\x89": "false", b"I": "int", b"J": "binint",
    b"K": "binint1", b"M": "binint2", b"L": "long", b"\x8a": "long1", b"\x8b": "long4",
    b"F": "float", b"G": "binfloat", b"S": "string", b"T": "binstring", b"U": "short_binstring",
    b"V": "unicode", b"X": "binunicode", b"\x8c": "short_binunicode", b"\x8d": "binunicode8",
    b"B": "binbytes", b"C": "short_binbytes", b"\x8e": "binbytes8", b"\x96": "bytearray8",
    b")": "empty_tuple", b"t": "tuple", b"\x85": "tuple1", b"\x86": "tuple2", b"\x87": "tuple3",
    b"]": "empty_list", b"l": "list", b"a": "append", b"e": "appends", b"}": "empty_dict",
    b"d": "dict", b"s": "setitem", b"u": "setitems", b"\x8f": "empty_set", b"\x90": "additems",
    b"\x91": "frozenset", b"c": "global", b"\x93": "stack_global", b"R": "reduce",
    b"\x81": "newobj", b"\x92": "newobj_ex", b"b": "build", b"Q": "binpersid", b"g": "get",
    b"h": "binget", b"j": "long_binget", b"p": "put", b"q": "binput", b"r": "long_binput",
    b"\x94": "memoize",
}
# Not interpreted, so refused: INST (i), OBJ (o), PERSID (P, text ids), EXT1/2/4 (copyreg
# registry), NEXT_BUFFER / READONLY_BUFFER (out-of-band buffers).
_DISPATCH = {k[0]: getattr(_PickleVM, "op_" + v) for k, v in _OPS.items()}


# ---- turning the unpickled object into a tensor table ---------------------------------------

def _is_simple(v):
    return type(v) in (int, float, bool, str, type(None)) and (type(v) is not str or len(v) <= 1024)


def _select_state_dict(root, meta):
    _need(isinstance(root, dict), f"the pickle holds a {type(root).__name__}, not a dict of tensors "
          "(a whole pickled model object cannot be read safely; save its state_dict)")
    scalars = {}
    obj = root
    wrappers = []
    for _ in range(4):
        for k, v in obj.items():
            if type(k) is str and _is_simple(v) and len(scalars) < 256:
                scalars.setdefault(k, v)
        for key in ("state_dict", "model", "module"):
            v = obj.get(key)
            if isinstance(v, dict) and _holds_tensor(v):
                wrappers.append(key)
                obj = v
                break
        else:
            break
    if scalars:
        meta["pickle_scalars"] = scalars
    if wrappers:
        meta["wrapper"] = ".".join(wrappers)
    return obj


def _holds_tensor(d) -> bool:
    todo, seen = [(d, 0)], set()
    while todo:
        cur, depth = todo.pop()
        if id(cur) in seen or depth > MAX_NEST:
            continue
        seen.add(id(cur))
        for v in cur.values():
            if isinstance(v, _TensorRef):
                return True
            if isinstance(v, dict):
                todo.append((v, depth + 1))
    return False


def _flatten(sd) -> tuple[dict, list]:
    """{name: _TensorRef} with nested dicts joined by '.', and [(name, why)] for what is left out."""
    out, skipped = {}, []
    seen = set()
    todo = [("", sd, 0)]
    while todo:
        prefix, d, depth = todo.pop()
        _need(id(d) not in seen, f"dict '{prefix[:-1]}' appears twice in the checkpoint (shared or recursive)")
        seen.add(id(d))
        for k, v in d.items():
            if type(k) is not str:
                continue
            name = prefix + k
            if isinstance(v, _TensorRef):
                _need(name not in out, f"duplicate tensor name '{name}'")
                out[name] = v
            elif isinstance(v, dict):
                _need(depth < MAX_NEST, f"dicts nested deeper than {MAX_NEST} at '{name}'")
                todo.append((name + ".", v, depth + 1))
            elif isinstance(v, _Opaque):
                skipped.append((name, v.kind))
    return out, skipped


def _fold_dims(ne, nb):
    """Merge the top dims until there are MAX_DIMS (sd.cpp folds 5-D Wan weights the same way)."""
    ne, nb = list(ne), list(nb)
    while len(ne) > MAX_DIMS:
        a, b = len(ne) - 2, len(ne) - 1
        if ne[b] == 1:
            stride = nb[a]
        elif ne[a] == 1:
            stride = nb[b]
        else:
            _need(nb[b] == nb[a] * ne[a], f"{len(ne)}-D tensor whose strides cannot fold to {MAX_DIMS}-D")
            stride = nb[a]
        ne[a], nb[a] = ne[a] * ne[b], stride
        del ne[b], nb[b]
    return tuple(ne), tuple(nb)


def _make_tensors(refs: dict, buffers: dict, skipped: list, mf: ModelFile) -> None:
    """refs {name: _TensorRef}; buffers {root storage key: uint8 array}. Bounds-checked; fills
    mf.tensors (and mf.raw for dtypes sdrt has no tensor type for, and empty tensors)."""
    for name, r in refs.items():
        sdt, itemsize, npdt = _TORCH_DTYPES[r.dtype]
        numel = 1
        for s in r.size:
            numel *= s
        _need(numel < (1 << 62), f"tensor '{name}': size {list(r.size)} overflows")
        if numel == 0:
            mf.raw[name] = np.zeros(r.size, np.dtype(npdt))
            continue
        st = r.storage
        span = (sum((n - 1) * s for n, s in zip(r.size, r.stride)) + 1) * itemsize
        start = r.offset * itemsize
        _need(start + span <= st.nbytes,
              f"tensor '{name}': {list(r.size)} at element offset {r.offset} with strides {list(r.stride)} "
              f"needs {start + span} bytes, its storage '{st.key}' holds {st.nbytes}")
        buf = buffers[st.root.key]
        off = st.byte_offset + start
        if sdt is None or sdt in _WIDE:
            arr = np.ndarray(r.size, np.dtype(npdt), buf, off, tuple(s * itemsize for s in r.stride))
            arr.flags.writeable = False
            if sdt is None:
                mf.raw[name] = arr
                continue
        ne = tuple(reversed(r.size)) or (1,)
        nb = tuple(s * itemsize for s in reversed(r.stride)) or (itemsize,)
        if len(ne) > MAX_DIMS:
            ne, nb = _fold_dims(ne, nb)
        try:
            if sdt in _WIDE:
                mf.tensors[name] = ConvertedTensor(_WIDE[sdt][0], ne, _widen(arr, sdt, mf.path, name), name=name)
            else:
                mf.tensors[name] = Tensor.from_buffer(buf, "I8" if sdt == "BOOL" else sdt, ne, offset=off, nb=nb,
                                                      name=name)
        except Exception as e:  # OpError from the tensor library: report it as a file problem
            raise _Fail(f"tensor '{name}': {e}") from None
    if skipped:
        mf.metadata["skipped"] = dict(skipped)


def _widen(arr, sdt, path, name):
    """The fill of a ConvertedTensor: F64 -> F32, I64 -> I32 (values must fit), contiguous."""
    to = _WIDE[sdt][1]

    def fill():
        if sdt == "I64" and arr.size and (arr.min() < -(1 << 31) or arr.max() >= 1 << 31):
            raise ModelFileError(f"{path}: tensor '{name}': I64 values outside the int32 range")
        return np.ascontiguousarray(arr, dtype=to).reshape(-1).view(np.uint8)
    return fill


def _make_persistent_load(storages: dict, legacy: bool):
    def persistent_load(pid):
        _need(type(pid) is tuple and len(pid) >= 5 and pid[0] == "storage",
              "persistent id is not ('storage', type, key, location, numel)")
        stype, key, _loc, numel = pid[1], pid[2], pid[3], pid[4]
        _need(isinstance(stype, _Global) and _GLOBALS.get((stype.module, stype.name)) == "storage",
              f"persistent id names storage type {stype!r}")
        _need(type(key) is str and 0 < len(key) <= 64 and "/" not in key and "\\" not in key and ".." not in key,
              "storage key is not a short plain string")
        numel = _int(numel, "storage numel")
        _need(0 <= numel < (1 << 56), f"storage '{key}' declares {numel} elements")
        dtype = _STORAGES[stype.name]
        itemsize = _TORCH_DTYPES[dtype][1]
        root = storages.get(key)
        if root is None:
            root = storages[key] = _Storage(key, dtype, itemsize, numel)
        else:
            _need(root.itemsize == itemsize and root.numel == numel,
                  f"storage '{key}' is declared twice with different types or sizes")
        if legacy and len(pid) >= 6 and pid[5] is not None:
            view = pid[5]
            _need(type(view) is tuple and len(view) == 3, "legacy storage view metadata")
            vkey, voff, vsize = view
            voff, vsize = _int(voff, "view offset"), _int(vsize, "view size")
            _need(0 <= voff and 0 <= vsize and voff + vsize <= numel, f"storage view '{vkey}' outside '{key}'")
            return _Storage(str(vkey), dtype, itemsize, vsize, voff * itemsize, root)
        return root if dtype == root.dtype else _Storage(key, dtype, itemsize, numel, 0, root)
    return persistent_load


def _swap_bytes(buf: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize == 1:
        return np.array(buf)
    n = buf.nbytes // itemsize * itemsize
    a = np.frombuffer(buf[:n].tobytes(), np.dtype(f">u{itemsize}")).astype(f"<u{itemsize}")
    return np.concatenate([a.view(np.uint8), np.array(buf[n:])])


# ---- zip format ---------------------------------------------------------------------------------

def is_torch_zip(head: bytes) -> bool:
    return head[:4] == b"PK\x03\x04"


def is_torch_legacy(head: bytes) -> bool:
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def _local_data_offset(mm, info: zipfile.ZipInfo, file_size: int) -> int:
    h = info.header_offset
    _need(0 <= h and h + 30 <= file_size, f"zip entry '{info.filename}' header outside the file")
    hdr = bytes(mm[h:h + 30])
    _need(hdr[:4] == b"PK\x03\x04", f"zip entry '{info.filename}': bad local header")
    nlen, elen = struct.unpack("<HH", hdr[26:30])
    _need(h + 30 + nlen <= file_size, f"zip entry '{info.filename}': name outside the file")
    raw = bytes(mm[h + 30:h + 30 + nlen])
    enc = "utf-8" if info.flag_bits & 0x800 else "cp437"
    _need(raw.decode(enc, "replace") == info.orig_filename,
          f"zip entry '{info.filename}': local and central names differ")
    start = h + 30 + nlen + elen
    _need(start + info.compress_size <= file_size, f"zip entry '{info.filename}' runs past the end of the file")
    return start


def _read_zip(path: str, mm, file_size: int, meta: dict):
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError,
            struct.error, NotImplementedError, UnicodeDecodeError) as e:
        raise _Fail(f"not a readable zip archive ({e})") from None
    with zf:
        infos = zf.infolist()
        _need(infos, "empty zip archive")
        names = [i.filename for i in infos]
        _need(len(set(names)) == len(names), "zip archive has duplicate entry names")
        for n in names:
            parts = n.replace("\\", "/").split("/")
            _need(not n.startswith(("/", "\\")) and ".." not in parts and ":" not in parts[0],
                  f"zip entry name '{n[:200]}' is absolute or climbs out with '..'")
        prefix = names[0].split("/", 1)[0] + "/" if "/" in names[0] else ""
        pkls = [n for n in names if n == "data.pkl" or n.endswith("/data.pkl")]
        _need(pkls, "zip archive has no data.pkl: not a PyTorch checkpoint")
        _need(len(pkls) == 1, f"zip archive has {len(pkls)} data.pkl entries")
        _need(pkls[0] == prefix + "data.pkl",
              f"data.pkl is '{pkls[0]}', not under the archive's first directory '{prefix}'")
        _need(prefix + "constants.pkl" not in names,
              "this is a TorchScript archive (it has constants.pkl), not a state dict; refusing it")
        by_name = {i.filename: i for i in infos}
        for i in infos:
            _need(not i.flag_bits & 0x1, f"zip entry '{i.filename}' is encrypted")
            _need(i.compress_type in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED),
                  f"zip entry '{i.filename}' uses compression method {i.compress_type}")

        def read_entry(i, n):
            try:
                with zf.open(i) as f:
                    return f.read(n)
            except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, RuntimeError,
                    struct.error, UnicodeDecodeError) as e:  # zlib.error is an Exception subclass too
                raise _Fail(f"zip entry '{i.filename}' is damaged ({type(e).__name__}: {e})") from None
            except Exception as e:
                raise _Fail(f"zip entry '{i.filename}' is damaged ({type(e).__name__}: {e})") from None

        def small(name, cap=64):
            i = by_name.get(prefix + name)
            if i is None:
                return None
            _need(i.file_size <= cap, f"'{prefix + name}' is {i.file_size} bytes, expected a short record")
            return read_entry(i, cap + 1)[:cap]

        bo = small("byteorder")
        _need(bo in (None, b"little", b"big"), f"byteorder record is {bo!r}, not 'little' or 'big'")
        big = bo == b"big"
        meta["byteorder"] = "big" if big else "little"
        for rec in ("version", ".format_version", ".storage_alignment"):
            v = small(rec)
            if v is not None:
                meta["torch_" + rec.lstrip(".")] = v.decode("ascii", "replace").strip()

        pinfo = by_name[pkls[0]]
        _need(pinfo.file_size <= MAX_PICKLE_BYTES, f"data.pkl is {pinfo.file_size} bytes")
        pkl = read_entry(pinfo, MAX_PICKLE_BYTES + 1)
        _need(len(pkl) == pinfo.file_size, "data.pkl is shorter than the zip directory says")

        storages: dict[str, _Storage] = {}
        root, end = _PickleVM(pkl, 0, _make_persistent_load(storages, legacy=False)).run()
        sd = _select_state_dict(root, meta)
        refs, skipped = _flatten(sd)

        used = {r.storage.root.key for r in refs.values()}
        buffers = {}
        inflated = 0
        for key in sorted(used):
            st = storages[key]
            i = by_name.get(prefix + "data/" + key)
            _need(i is not None, f"storage '{key}' has no entry '{prefix}data/{key}' in the archive")
            _need(i.file_size >= st.nbytes,
                  f"storage '{key}' declares {st.nbytes} bytes, its entry holds {i.file_size}")
            if i.compress_type == zipfile.ZIP_STORED:
                _need(i.compress_size == i.file_size, f"stored entry '{i.filename}' has two sizes")
                start = _local_data_offset(mm, i, file_size)
                buf = mm[start:start + st.nbytes]
            else:
                _need(i.file_size <= MAX_INFLATE_RATIO * i.compress_size + (1 << 20),
                      f"entry '{i.filename}' would inflate {i.compress_size} -> {i.file_size} bytes; "
                      "refusing a possible zip bomb")
                inflated += st.nbytes
                _need(inflated <= MAX_INFLATE_TOTAL, "compressed storages inflate past the RAM cap")
                data = read_entry(i, st.nbytes)
                _need(len(data) == st.nbytes, f"entry '{i.filename}' inflated short")
                buf = np.frombuffer(data, np.uint8)
            if big:
                buf = _swap_bytes(buf, max(r.itemsize for r in refs.values() if r.storage.root is st))
            buffers[key] = buf
        return refs, buffers, skipped


# ---- legacy format ------------------------------------------------------------------------------

def _read_legacy(path: str, mm, file_size: int, meta: dict):
    data = memoryview(mm)
    none = _make_persistent_load({}, legacy=True)

    def header_pickle(pos, what):
        try:
            return _PickleVM(data, pos, none).run()
        except _Fail as e:
            raise _Fail(f"legacy header ({what}): {e}") from None

    magic, pos = header_pickle(0, "magic number")
    _need(magic == LEGACY_MAGIC, "not a PyTorch checkpoint (legacy magic number missing)")
    proto, pos = header_pickle(pos, "protocol")
    _need(proto == LEGACY_PROTOCOL, f"legacy protocol {proto!r}, expected {LEGACY_PROTOCOL}")
    sys_info, pos = header_pickle(pos, "sys_info")
    _need(isinstance(sys_info, dict), "legacy sys_info is not a dict")
    little = sys_info.get("little_endian", True)
    _need(type(little) is bool, "legacy sys_info little_endian is not a bool")
    meta["byteorder"] = "little" if little else "big"

    storages: dict[str, _Storage] = {}
    root, pos = _PickleVM(data, pos, _make_persistent_load(storages, legacy=True)).run()
    keys, pos = _PickleVM(data, pos, none).run()
    _need(type(keys) is list and all(type(k) is str for k in keys), "legacy storage key list is not a list of str")
    _need(len(set(keys)) == len(keys), "legacy storage key list has duplicates")

    sd = _select_state_dict(root, meta)
    refs, skipped = _flatten(sd)

    buffers = {}
    order = "<q" if little else ">q"
    for key in keys:
        st = storages.get(key)
        _need(st is not None, f"legacy storage '{key}' is listed but never used, its element size is unknown")
        _need(pos + 8 <= file_size, f"legacy storage '{key}' header past the end of the file")
        n = struct.unpack(order, bytes(data[pos:pos + 8]))[0]
        _need(n == st.numel, f"legacy storage '{key}' holds {n} elements, its pickle declares {st.numel}")
        start = pos + 8
        _need(start + st.nbytes <= file_size,
              f"legacy storage '{key}' ({st.nbytes} bytes at {start}) runs past the end of the file")
        buf = mm[start:start + st.nbytes]
        if not little:
            buf = _swap_bytes(buf, st.itemsize)
        buffers[key] = buf
        pos = start + st.nbytes
    for r in refs.values():
        _need(r.storage.root.key in buffers, f"storage '{r.storage.root.key}' has no data in the file")
    return refs, buffers, skipped


# ---- entry point ----------------------------------------------------------------------------------

def read_ckpt(path) -> ModelFile:
    """Read a PyTorch checkpoint (zip or legacy) lazily; see the module doc.

    Raises ModelFileError (naming the file and the problem) for anything not understood,
    including every global or call a plain tensor checkpoint does not need."""
    path = os.fspath(path)
    mf = ModelFile(path=path, format="ckpt")
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        if len(head) >= 262 and head[257:262] == b"ustar":
            raise _Fail("a tar-format PyTorch file (torch < 0.4); not supported, re-save it with a newer torch")
        mm, stamp = map_file(path, "PyTorch checkpoint")
        mf.sources.append(stamp)
        if is_torch_zip(head):
            mf.metadata["torch_format"] = "zip"
            refs, buffers, skipped = _read_zip(path, mm, stamp[1], mf.metadata)
        elif is_torch_legacy(head):
            mf.metadata["torch_format"] = "legacy"
            refs, buffers, skipped = _read_legacy(path, mm, stamp[1], mf.metadata)
        else:
            raise _Fail("not a PyTorch checkpoint (neither a zip archive nor a pickle)")
        _make_tensors(refs, buffers, skipped, mf)
    except _Fail as e:
        raise ModelFileError(f"{path}: {e}") from None
    except ModelFileError:
        raise
    except RecursionError:
        raise ModelFileError(f"{path}: malformed checkpoint (nested too deeply)") from None
    except MemoryError:
        raise ModelFileError(f"{path}: malformed checkpoint (asks for more memory than it can use)") from None
    except Exception as e:  # any other parse failure of untrusted bytes is a bad file, never a crash
        raise ModelFileError(f"{path}: malformed checkpoint ({type(e).__name__}: {e})") from None
    return mf
