"""Reading a pickle from an untrusted checkpoint without running its code.

A pickle is a program: GLOBAL names any importable callable and REDUCE calls it, so `pickle.load` of a file
someone else wrote runs their code. torch's own DCP reader does exactly that for `.metadata`, and torch's
`weights_only` unpickler cannot read DCP metadata (protocol 4 opcodes) and allows `bytearray(n)` of any n.

`RestrictedUnpickler` is pickle's own pure-Python unpickler (`pickle._Unpickler`: the parser that loads is the
parser that checks, no second scan that could disagree with it) with

- an opcode allow-list: the opcodes protocols 2-5 write for plain containers, strings, numbers and reduced
  objects; never the old class opcodes (INST, OBJ), the extension registry (EXT*), persistent ids,
  out-of-band buffers, bytearrays or sets;
- a `Profile`: the only globals that resolve (by exact `module.name`, nothing is imported), the callables
  REDUCE may call, the classes NEWOBJ may create and BUILD may fill (dict state whose keys are the class's
  fields, or the class's own `__setstate__`), and the protocols accepted;
- APPEND(S) on lists only, SETITEM(S) on dicts only, the whole input consumed (no trailing pickle);
- a bound on the input's length, checked before it is read.

Anything else raises `UnsafePickle` naming what it met; the callers turn it into a `CheckpointError` naming
the file or key. The objects it builds still come from hostile input: the callers validate their types.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import struct
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NoReturn

from planc.errors import PlancError

_P = pickle  # the opcode constants

# Opcodes with no side effect beyond building containers and scalars from the stream itself.
_DATA_OPCODES = (
    _P.PROTO, _P.FRAME, _P.STOP, _P.MARK, _P.POP, _P.POP_MARK,
    _P.NONE, _P.NEWTRUE, _P.NEWFALSE, _P.BININT, _P.BININT1, _P.BININT2, _P.LONG1, _P.LONG4, _P.BINFLOAT,
    _P.BINUNICODE, _P.SHORT_BINUNICODE, _P.BINUNICODE8, _P.BINBYTES, _P.SHORT_BINBYTES, _P.BINBYTES8,
    _P.EMPTY_TUPLE, _P.TUPLE, _P.TUPLE1, _P.TUPLE2, _P.TUPLE3, _P.EMPTY_LIST, _P.LIST, _P.APPEND, _P.APPENDS,
    _P.EMPTY_DICT, _P.DICT, _P.SETITEM, _P.SETITEMS,
    _P.BINGET, _P.LONG_BINGET, _P.BINPUT, _P.LONG_BINPUT, _P.MEMOIZE,
)
# Opcodes that reach a global, call it or fill an object: each checked against the profile below.
_OBJECT_OPCODES = (_P.GLOBAL, _P.STACK_GLOBAL, _P.REDUCE, _P.NEWOBJ, _P.BUILD)
_BASE_DISPATCH = pickle._Unpickler.dispatch
_NAMES = {getattr(_P, n)[0]: n for n in dir(_P) if n.isupper() and isinstance(getattr(_P, n), bytes)
          and len(getattr(_P, n)) == 1}


class UnsafePickle(PlancError):
    """A pickle this reader refuses: the message says what it met (a class, an opcode, a call). Callers turn it into
    a CheckpointError naming the file or key."""


@dataclass(frozen=True)
class Profile:
    """What one kind of pickle may hold.

    `globals`: `(module, name)` -> the object it resolves to (nothing else resolves, nothing is imported);
    `callables`: those REDUCE may call, each with a check of its arguments (raising UnsafePickle);
    `classes`: those NEWOBJ may create (no arguments) and BUILD may fill; `protocols`: the protocols accepted.
    """

    name: str
    globals: Mapping[tuple[str, str], Any]
    callables: Mapping[Any, Callable[[tuple[Any, ...]], None]]
    classes: frozenset[type]
    protocols: frozenset[int]


def _refuse(message: str) -> NoReturn:
    raise UnsafePickle(message)


class _Dispatch(dict):  # type: ignore[type-arg]
    """pickle._Unpickler's dispatch table, restricted: an opcode not in it is refused by name."""

    def __missing__(self, key: int) -> NoReturn:
        _refuse(f"the pickle opcode {_NAMES.get(key, hex(key))} ({bytes([key])!r}), which this file never holds")


_FIELDS: dict[type, frozenset[str]] = {}


def _field_names(cls: type) -> frozenset[str]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = frozenset(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) \
            else frozenset()
    return names


class RestrictedUnpickler(pickle._Unpickler):
    """pickle's pure-Python unpickler with the opcode allow-list and a `Profile` (module docstring)."""

    # set by pickle._Unpickler.load (typeshed does not describe them)
    stack: list[Any]
    append: Callable[[Any], None]
    read: Callable[[int], bytes]
    readline: Callable[[], bytes]
    metastack: list[list[Any]]
    proto: int
    pop_mark: Callable[[], list[Any]]

    dispatch = _Dispatch({op[0]: _BASE_DISPATCH[op[0]] for op in _DATA_OPCODES + _OBJECT_OPCODES})

    def __init__(self, data: bytes, profile: Profile) -> None:
        self._stream = io.BytesIO(data)
        self._size = len(data)
        super().__init__(self._stream)
        self.profile = profile

    # -- globals ---------------------------------------------------------------------------------------------
    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.profile.globals[(module, name)]
        except (KeyError, TypeError):
            _refuse(f"the global `{module}.{name}`, which a {self.profile.name} never holds")

    def persistent_load(self, pid: Any) -> NoReturn:
        _refuse("a persistent id")

    def load(self) -> Any:
        """pickle._Unpickler.load reading the in-memory input directly: FRAME is a length to check, not a buffer
        to copy (the whole input is already in memory, and bounded), so each opcode is one C-level read."""
        self.read = self._stream.read
        self.readline = self._stream.readline
        self.metastack = []
        self.stack = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = self.read, self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                dispatch[key[0]](self)
        except pickle._Stop as stop:  # type: ignore[attr-defined]  # how pickle's own loop ends
            return stop.value

    def _frame(self) -> None:
        (size,) = struct.unpack("<Q", self.read(8))
        if size > self._size - self._stream.tell():
            _refuse(f"a truncated pickle (a frame of {size} bytes runs past the end of the input)")

    # -- opcodes that run code -------------------------------------------------------------------------------
    def _proto(self) -> None:
        proto = self.read(1)[0]
        if proto not in self.profile.protocols:
            _refuse(f"pickle protocol {proto}; a {self.profile.name} is written with protocol "
                    + " or ".join(str(p) for p in sorted(self.profile.protocols)))
        self.proto = proto

    def _reduce(self) -> None:
        stack = self.stack
        args = stack.pop()
        func = stack[-1]
        check = self.profile.callables.get(func) if _hashable(func) else None
        if check is None:
            _refuse(f"a call of {_describe(func)}, which a {self.profile.name} never makes")
        if type(args) is not tuple:
            _refuse(f"a call of {_describe(func)} with arguments of type {type(args).__name__}")
        check(args)
        try:
            stack[-1] = func(*args)
        except UnsafePickle:
            raise
        except Exception as e:  # noqa: BLE001 - an allowed constructor refusing hostile arguments
            _refuse(f"a call of {_describe(func)} that failed ({type(e).__name__}: {e})")

    def _newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not (isinstance(cls, type) and cls in self.profile.classes):
            _refuse(f"creating {_describe(cls)}, which a {self.profile.name} never holds")
        if args != ():
            _refuse(f"creating {_describe(cls)} with arguments")
        self.append(object.__new__(cls))

    def _build(self) -> None:
        stack = self.stack
        state = stack.pop()
        inst = stack[-1]
        cls = type(inst)
        if cls not in self.profile.classes:
            _refuse(f"setting the state of {_describe(inst)}, which a {self.profile.name} never does")
        own = cls.__dict__.get("__setstate__")
        if own is not None:  # the class's own code (torch's), given the state it documents
            try:
                own(inst, state)
            except Exception as e:  # noqa: BLE001
                _refuse(f"the state of a {cls.__qualname__} it cannot take ({type(e).__name__}: {e})")
            return
        if type(state) is not dict:
            _refuse(f"a {cls.__qualname__} state of type {type(state).__name__} (a dict of its fields expected)")
        fields = _field_names(cls)
        for key in state:
            if type(key) is not str or key not in fields:
                _refuse(f"a {cls.__qualname__} state with the key {key!r}, not one of its fields")
        inst.__dict__.update(state)

    def _append(self) -> None:
        value = self.stack.pop()
        self._list(self.stack[-1]).append(value)

    def _appends(self) -> None:
        items = self.pop_mark()
        self._list(self.stack[-1]).extend(items)

    def _setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._dict(self.stack[-1])[_key(key)] = value

    def _setitems(self) -> None:
        items = self.pop_mark()
        target = self._dict(self.stack[-1])
        for i in range(0, len(items), 2):
            target[_key(items[i])] = items[i + 1]

    @staticmethod
    def _list(target: Any) -> list[Any]:
        if type(target) is not list:
            _refuse(f"appending to {_describe(target)} (only lists are appended to)")
        return target

    @staticmethod
    def _dict(target: Any) -> dict[Any, Any]:
        if type(target) is not dict:
            _refuse(f"setting an item of {_describe(target)} (only dicts have items set)")
        return target

    dispatch[_P.FRAME[0]] = _frame
    dispatch[_P.PROTO[0]] = _proto
    dispatch[_P.REDUCE[0]] = _reduce
    dispatch[_P.NEWOBJ[0]] = _newobj
    dispatch[_P.BUILD[0]] = _build
    dispatch[_P.APPEND[0]] = _append
    dispatch[_P.APPENDS[0]] = _appends
    dispatch[_P.SETITEM[0]] = _setitem
    dispatch[_P.SETITEMS[0]] = _setitems

    def load_all(self) -> Any:
        """The one object the input holds; refuses truncated input and anything after STOP."""
        try:
            value = self.load()
        except UnsafePickle:
            raise
        except RecursionError:
            _refuse("objects nested too deeply")
        except (EOFError, IndexError):
            _refuse("a truncated pickle (it ends before its STOP opcode)")
        except Exception as e:  # noqa: BLE001 - damaged input: struct, unicode, memo and stack errors
            if self._stream.tell() >= self._size:  # an opcode's argument ran past the end
                _refuse("a truncated pickle (it ends before its STOP opcode)")
            _refuse(f"a damaged pickle ({type(e).__name__}: {e})")
        if self._stream.read(1):
            _refuse("bytes after the pickle's STOP opcode (a second pickle or appended data)")
        return value


def _hashable(obj: Any) -> bool:
    try:
        hash(obj)
    except TypeError:
        return False
    return True


def _key(key: Any) -> Any:
    if not _hashable(key):
        _refuse(f"a dict key of type {type(key).__name__}")
    return key


def _describe(obj: Any) -> str:
    if isinstance(obj, type) or callable(obj):
        return f"`{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}`"
    return f"a {type(obj).__name__}"


def loads(data: bytes, profile: Profile, *, limit: int) -> Any:
    """The object pickled in `data` under `profile`, or UnsafePickle. `limit`: the most bytes accepted."""
    if len(data) > limit:
        _refuse(f"{len(data)} bytes, more than the {limit} a {profile.name} may take")
    return RestrictedUnpickler(data, profile).load_all()


def plain_arguments(*types: type) -> Callable[[tuple[Any, ...]], None]:
    """An argument check: exactly `len(types)` arguments, each exactly of its type."""

    def check(args: tuple[Any, ...]) -> None:
        if len(args) != len(types) or any(type(a) is not t for a, t in zip(args, types)):
            _refuse(f"a call with arguments ({', '.join(type(a).__name__ for a in args)}), expected "
                    f"({', '.join(t.__name__ for t in types)})")

    return check


PLAIN_DATA = Profile(
    name="plain value (None, bool, int, float, str, bytes, and tuples, lists and dicts of them)",
    globals={}, callables={}, classes=frozenset(), protocols=frozenset({2, 3, 4, 5}),
)


def check_plain(value: Any, *, depth: int = 16, nodes: int = 100_000) -> None:
    """UnsafePickle unless `value` is plain data (PLAIN_DATA's types, string dict keys), nested at most `depth`
    deep with at most `nodes` values in all (a memo-shared DAG counts each path)."""
    budget = [nodes]

    def walk(v: Any, level: int) -> None:
        budget[0] -= 1
        if budget[0] < 0:
            _refuse(f"more than {nodes} values")
        if v is None or type(v) in (bool, int, float, str, bytes):
            return
        if level >= depth:
            _refuse(f"values nested more than {depth} deep")
        if type(v) in (tuple, list):
            for item in v:
                walk(item, level + 1)
        elif type(v) is dict:
            for k, item in v.items():
                if type(k) is not str:
                    _refuse(f"a dict key of type {type(k).__name__}")
                walk(item, level + 1)
        else:
            _refuse(f"a value of type {type(v).__name__}")

    walk(value, 0)


__all__ = ["PLAIN_DATA", "Profile", "RestrictedUnpickler", "UnsafePickle", "check_plain", "loads", "plain_arguments"]
