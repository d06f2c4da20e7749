"""Objects a checkpoint pickles that mpitailor does not trust, carried through unbuilt.

Training scripts put ordinary objects in DeepSpeed's `client_state` (an argparse
`Namespace`, a numpy scalar, a dataclass). Loading them would mean importing the user's
modules and running their code; refusing them would make the checkpoint unusable. Instead,
each such global gets a stand-in class: torch's weights-only unpickler builds stand-ins
(recording the arguments and state the pickle gave), never the real thing, and the pickler
here writes them back as the very same GLOBAL / REDUCE / NEWOBJ / BUILD instructions. So the
output refers to the same classes with the same arguments, and DeepSpeed's `load_checkpoint`
builds the user's objects from it exactly as it would from the source.

Globals of modules that exist to run code (os, subprocess, builtins, ...) never get a
stand-in: a file naming them is refused, as before.
"""
from __future__ import annotations

import copyreg
import functools
import io
import pickle
import types

# Modules whose globals are how pickle payloads run code. torch itself refuses sys, os,
# posix and nt; torch's own globals are either on its allow-list or not for us to carry.
DENIED_MODULES = frozenset({
    "builtins", "__builtin__", "os", "posix", "nt", "sys", "subprocess", "shutil", "pty",
    "importlib", "runpy", "code", "codeop", "pickle", "_pickle", "marshal", "socket",
    "ctypes", "io", "_io", "operator", "types", "copyreg", "signal", "multiprocessing",
    "webbrowser", "tempfile", "threading", "asyncio", "torch", "pdb", "timeit", "trace",
})
_NOSTATE = object()


class _OpaqueMeta(type):
    """The metaclass of stand-ins: lets the pickler below spot one and name its global."""

    def __repr__(cls) -> str:
        return f"<opaque global {cls.global_name}>"


class Opaque(metaclass=_OpaqueMeta):
    """An instance of an untrusted class, as the pickle described it: how it was made
    (REDUCE: called with args; NEWOBJ: cls.__new__ with args), and the BUILD state."""

    global_name = ""

    def __new__(cls, *args):
        obj = object.__new__(cls)
        obj._how, obj._args, obj._state = "newobj", args, _NOSTATE
        return obj

    def __init__(self, *args) -> None:
        self._how = "reduce"  # only a call (REDUCE) runs __init__; NEWOBJ runs __new__ alone

    def __setstate__(self, state) -> None:
        self._state = state

    def __reduce__(self):
        # NEWOBJ as pickle spells it (copyreg.__newobj__ with the class first), else REDUCE.
        if self._how == "newobj":
            head = (copyreg.__newobj__, (type(self), *self._args))
        else:
            head = (type(self), self._args)
        return head if self._state is _NOSTATE else (*head, self._state)

    def __eq__(self, other) -> bool:
        return (type(other) is type(self) and self._how == other._how
                and self._args == other._args and self._state == other._state)

    def __hash__(self) -> int:
        return hash(type(self).global_name)

    def __repr__(self) -> str:
        return f"<opaque {type(self).global_name}>"


@functools.cache
def stand_in(full_name: str) -> type:
    """The stand-in class for global `module.name` (one per name, so loads compare equal)."""
    return _OpaqueMeta(f"Opaque[{full_name}]", (Opaque,), {"global_name": full_name})


def may_stand_in(full_name: str) -> bool:
    return full_name.split(".", 1)[0] not in DENIED_MODULES


def holds_opaque(obj) -> bool:
    """Whether a loaded structure contains a stand-in (then `dumps` must write it)."""
    if isinstance(obj, Opaque):
        return True
    if isinstance(obj, dict):
        return any(holds_opaque(v) or holds_opaque(k) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return any(holds_opaque(v) for v in obj)
    return False


class Pickler(pickle._Pickler):  # type: ignore[name-defined]
    """The pure-Python pickler, writing a stand-in class back as its original GLOBAL."""

    dispatch = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]

    def save_opaque_global(self, cls: type) -> None:
        module, _, name = cls.global_name.rpartition(".")
        if self.proto >= 4:
            self.save(module)
            self.save(name)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + module.encode() + b"\n" + name.encode() + b"\n")
        self.memoize(cls)

    dispatch[_OpaqueMeta] = save_opaque_global


# What torch.save takes as `pickle_module`: it subclasses `Pickler` for storages.
pickle_module = types.SimpleNamespace(Pickler=Pickler, __name__="mpitailor.opaque")


def dumps(obj, protocol: int = 2) -> bytes:
    buf = io.BytesIO()
    Pickler(buf, protocol=protocol).dump(obj)
    return buf.getvalue()
