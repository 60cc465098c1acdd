"""The pickle virtual machine that reads PyTorch checkpoints without executing them.

Pure Python, like sd.cpp's pickle_io.cpp and torch's weights_only unpickler: GLOBAL and
STACK_GLOBAL push an inert `_Global(module, name)` marker (only names in `_GLOBALS` are
accepted), REDUCE/NEWOBJ look the marker up in our own handlers, which build plain records
(tensor references, dicts, tuples). Nothing is imported or called; anything else raises
`_Fail`, which the reader (ckpt.py) turns into ModelFileError naming the file.

Costs are bounded, not only counted: at most MAX_OPS opcodes (time), and a memory budget in bytes
(base.pickle_budget: what the pickle and its file can justify) from which every opcode pays about
what CPython allocates for the object it builds, payloads and container items included. Failure
messages that format values are lambdas, built only on failure (never an eager repr per opcode).
"""
from __future__ import annotations

import codecs
import struct

import numpy as np

from .base import MAX_PICKLE_OPS, pickle_budget

MAX_DIMS_ACCEPTED = 8
MAX_OPS = MAX_PICKLE_OPS            # opcodes per pickle: bounds the time
MAX_LINE = 4096                     # protocol-0 text lines (GLOBAL names, ints)
MAX_LONG_BYTES = 1024               # LONG4 payload


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
    """Raise _Fail(msg) unless cond. A message that formats values is passed as a lambda, so it is
    built only on failure: an eager f-string on a hot path once cost a repr of a 10 MB key per call."""
    if not cond:
        raise _Fail(msg() if callable(msg) else msg)


def _int(x, what):
    _need(type(x) is int, lambda: f"{what} must be an int, got {type(x).__name__}")
    return x


def _ints(x, what):
    _need(type(x) is tuple and len(x) <= MAX_DIMS_ACCEPTED,
          lambda: f"{what} must be a tuple of at most {MAX_DIMS_ACCEPTED} ints, got {type(x).__name__}")
    for v in x:
        _need(type(v) is int and 0 <= v < (1 << 62),
              lambda: f"{what} holds {str(v)[:40]}; dims/strides must be ints >= 0")
    return x


# ---- REDUCE / NEWOBJ handlers: our code, building inert records -----------------------------

def _rebuild_tensor(args, dtype_from=None):
    _need(len(args) >= 4, "_rebuild_tensor needs (storage, offset, size, stride, ...)")
    storage, offset, size, stride = args[:4]
    _need(isinstance(storage, _Storage), lambda: f"_rebuild_tensor: storage is {type(storage).__name__}, not a storage")
    offset = _int(offset, "storage_offset")
    _need(offset >= 0, lambda: f"negative storage_offset {offset}")
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    _need(len(size) == len(stride), lambda: f"size {size} and stride {stride} differ in length")
    dtype, itemsize = (storage.dtype, storage.itemsize) if dtype_from is None else dtype_from
    return _TensorRef(storage, offset, size, stride, dtype, itemsize)


def _rebuild_tensor_v3(args):
    _need(len(args) >= 7, "_rebuild_tensor_v3 needs 7 arguments")
    dt = args[6]
    _need(isinstance(dt, _Global) and dt.module == "torch" and dt.name in _TORCH_DTYPES,
          lambda: f"_rebuild_tensor_v3: unknown dtype {dt!r}")
    return _rebuild_tensor(args, (dt.name, _TORCH_DTYPES[dt.name][1]))


def _rebuild_parameter(args):
    _need(len(args) >= 1 and isinstance(args[0], _TensorRef), "_rebuild_parameter: data is not a tensor")
    return args[0]


def _rebuild_from_type_v2(args):
    _need(len(args) == 4, "_rebuild_from_type_v2 needs (func, type, args, state)")
    func, new_type, fargs, _state = args
    _need(isinstance(new_type, _Global) and _GLOBALS.get((new_type.module, new_type.name)) == "tensor_type",
          lambda: f"_rebuild_from_type_v2: type {new_type!r} is not allowed")
    _need(isinstance(func, _Global) and isinstance(fargs, tuple), "_rebuild_from_type_v2: bad function")
    handler = _REDUCE.get((func.module, func.name))
    _need(handler is not None, lambda: f"_rebuild_from_type_v2: refusing to call {func!r}")
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
          lambda: f"_codecs.encode: encoding {args[1]!r} not allowed")
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
    _need(code in _NP_SCALAR_CODES, lambda: f"numpy dtype {args[0]!r} not allowed")
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
    _need(type(k) in _KEY_TYPES, lambda: f"dict key of type {type(k).__name__} is not allowed")


def _setitem(d, k, v):
    _need(isinstance(d, dict), lambda: f"SETITEM on a {type(d).__name__}; only dicts take items")
    _check_key(k)
    _need(k not in d, lambda: f"duplicate key {k[:200]!r}" if type(k) is str else "duplicate dict key")
    d[k] = v


# ---- the pickle virtual machine ---------------------------------------------------------------

class _PickleVM:
    """Interprets one pickle from `data` (bytes / memoryview) at `pos`. `persistent_load(pid)`
    turns a storage id into a _Storage. Returns (object, end position)."""

    def __init__(self, data, pos, persistent_load, end=None, budget=None, file_size=None):
        self.data = data
        self.is_bytes = isinstance(data, bytes)
        self.pos = pos
        self.end = len(data) if end is None else end
        # memory budget (bytes, estimated from what each opcode builds): a small pickle cannot grow
        # into gigabytes of Python objects (16M EMPTY_SETs, a 10 MB string appended everywhere)
        if budget is None:
            budget = pickle_budget(self.end - pos, len(data) if file_size is None else file_size)
        self.budget = budget
        self.persistent_load = persistent_load
        self.stack: list = []
        self.marks: list[int] = []
        self.memo: dict = {}
        self.proto = 0

    # -- reading
    def _payload(self, n: int) -> bytes:
        """_take() of a string/bytes payload that becomes an object: charged to the budget."""
        if n > 0:
            self.charge(n)
        return self._take(n)

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
        _need(i >= 0, lambda: f"pickle text line at byte {self.pos} is unterminated or too long")
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

    def charge(self, nbytes: int) -> None:
        """Spend nbytes of the memory budget on something the pickle makes us build."""
        self.budget -= nbytes
        if self.budget < 0:
            raise _Fail("pickle builds more objects than its size justifies (memory budget spent); "
                        "not a plain tensor checkpoint")

    # -- main loop
    def run(self):
        d, disp, end, cost = self.data, _DISPATCH, self.end, _COST
        count = 0
        while True:
            pos = self.pos
            if pos >= end:
                raise _Fail("pickle ends without STOP")
            count += 1
            if count > MAX_OPS:
                raise _Fail(f"pickle has more than {MAX_OPS} opcodes")
            op = d[pos]
            h = disp.get(op)
            self.pos = pos + 1
            if h is None:
                raise _Fail(f"pickle opcode {bytes([op])!r} at byte {pos} is not allowed")
            self.budget -= cost[op]
            if self.budget < 0:
                self.charge(0)
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
        _need(self.proto <= 5, lambda: f"pickle protocol {self.proto} unknown")

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
        _need(0 <= n <= MAX_LONG_BYTES, lambda: f"pickle LONG4 of {n} bytes refused")
        self.stack.append(int.from_bytes(self._take(n), "little", signed=True))

    def _short_line(self, what):
        s = self._line()
        _need(len(s) <= 64, lambda: f"pickle {what} too long")
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
        self.stack.append(self._str8(self._payload(n)))

    def op_short_binstring(self): self.stack.append(self._str8(self._payload(self._take(1)[0])))
    def op_unicode(self): self.stack.append(self._line().decode("raw-unicode-escape"))
    def op_binunicode(self): self.stack.append(self._utf8(self._u("<I", 4)))
    def op_short_binunicode(self): self.stack.append(self._utf8(self._take(1)[0]))
    def op_binunicode8(self): self.stack.append(self._utf8(self._u("<Q", 8)))
    def op_binbytes(self): self.stack.append(self._payload(self._u("<I", 4)))
    def op_short_binbytes(self): self.stack.append(self._payload(self._take(1)[0]))
    def op_binbytes8(self): self.stack.append(self._payload(self._u("<Q", 8)))
    def op_bytearray8(self): self.stack.append(self._payload(self._u("<Q", 8)))

    def _utf8(self, n):
        at = self.pos
        try:
            return self._payload(n).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise _Fail(f"pickle string at byte {at} is not valid UTF-8") from None

    # containers
    def op_empty_tuple(self): self.stack.append(())
    def op_tuple(self):
        items = self._pop_mark()
        self.charge(8 * len(items))
        self.stack.append(tuple(items))
    def op_tuple1(self): self.stack.append((self._pop(),))
    def op_empty_list(self): self.stack.append([])
    def op_list(self):
        items = self._pop_mark()
        self.charge(8 * len(items))
        self.stack.append(items)
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
        _need(type(lst) is list, lambda: f"APPEND to a {type(lst).__name__}; only lists take items")
        lst.append(v)

    def op_appends(self):
        items = self._pop_mark()
        lst = self._top()
        _need(type(lst) is list, lambda: f"APPENDS to a {type(lst).__name__}; only lists take items")
        self.charge(8 * len(items))
        lst.extend(items)

    def op_dict(self):
        items = self._pop_mark()
        _need(len(items) % 2 == 0, "DICT with an odd number of items")
        self.charge(_DICT_ITEM * (len(items) // 2))
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
        self.charge(_DICT_ITEM * (len(items) // 2))
        d = self._top()
        for i in range(0, len(items), 2):
            _setitem(d, items[i], items[i + 1])

    def op_additems(self):
        items = self._pop_mark()
        s = self._top()
        _need(type(s) is set, lambda: f"ADDITEMS to a {type(s).__name__}")
        self.charge(_DICT_ITEM * len(items))
        for v in items:
            _check_key(v)
            s.add(v)

    def op_frozenset(self):
        items = self._pop_mark()
        self.charge(_DICT_ITEM * len(items))
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
        _need(isinstance(fn, _Global), lambda: f"REDUCE of a {type(fn).__name__}; only allowed globals may be called")
        _need(type(args) is tuple, "REDUCE arguments are not a tuple")
        h = _REDUCE.get((fn.module, fn.name))
        if h is None:
            raise _Fail(f"refusing to call '{fn.module}.{fn.name}'")
        # handlers copy their arguments into new records (OrderedDict(pairs), set(items), encode(str))
        self.charge(sum(_DICT_ITEM * len(a) if type(a) in (list, tuple, set, frozenset, str, bytes) else 0
                        for a in args))
        self.stack.append(h(args))

    def op_newobj(self):
        args, cls = self._pop(), self._pop()
        self._newobj(cls, args, {})

    def op_newobj_ex(self):
        kwargs, args, cls = self._pop(), self._pop(), self._pop()
        self._newobj(cls, args, kwargs)

    def _newobj(self, cls, args, kwargs):
        _need(isinstance(cls, _Global), lambda: f"NEWOBJ of a {type(cls).__name__}")
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
        _need(i in self.memo, lambda: f"pickle memo {i} read before it was written")
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

# What each opcode costs the memory budget, in bytes: about what CPython allocates for the object it
# pushes (a stack or memo slot is 8-16 bytes, an int ~32, a list 56, a set or dict ~220); payloads
# (string bytes, items of a container) are charged where they are copied.
_DICT_ITEM = 104
_COST = [16] * 256
for _name, _c in {"mark": 8, "pop": 0, "pop_mark": 0, "stop": 0, "proto": 0, "frame": 0, "int": 32, "binint": 32,
                  "binint1": 32, "binint2": 32, "long": 40, "long1": 40, "long4": 1100, "float": 24, "binfloat": 24,
                  "string": 64, "binstring": 64, "short_binstring": 64, "unicode": 64, "binunicode": 64,
                  "short_binunicode": 64, "binunicode8": 64, "binbytes": 48, "short_binbytes": 48, "binbytes8": 48,
                  "bytearray8": 48, "empty_tuple": 8, "tuple": 56, "tuple1": 64, "tuple2": 72, "tuple3": 80,
                  "empty_list": 72, "list": 72, "append": 8, "appends": 8, "empty_dict": 232, "dict": 232,
                  "setitem": _DICT_ITEM, "setitems": 0, "empty_set": 216, "additems": 0, "frozenset": 216,
                  "global": 64, "stack_global": 64, "reduce": 256, "newobj": 256, "newobj_ex": 256, "build": 0,
                  "binpersid": 200, "put": _DICT_ITEM, "binput": _DICT_ITEM, "long_binput": _DICT_ITEM,
                  "memoize": _DICT_ITEM}.items():
    for _k, _v in _OPS.items():
        if _v == _name:
            _COST[_k[0]] = _c
