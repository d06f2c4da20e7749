"""Objects a checkpoint pickles that mpitailor does not build, carried through as written.

Every global a checkpoint names gets a stand-in class here, never the real thing: DeepSpeed's
own classes (its loss scaler, its ZeRO stage enum), torch's dtypes, and the ordinary objects
training scripts put in DeepSpeed's `client_state` (an argparse `Namespace`, a numpy scalar, a
dataclass). Building the real ones would mean importing their modules and running their code.
The unpickler (pickle_read.py) builds stand-ins, which record the arguments and state the
pickle gave them, and the pickler here writes them back as the very same GLOBAL / REDUCE /
NEWOBJ / BUILD instructions. So the output refers to the same classes with the same
arguments, and DeepSpeed's `load_checkpoint` builds the objects from it exactly as it would
from the source. What mpitailor reads of them: the fields of their state (`a.numel` of a
`fragment_address`) and the value of an int enum (`int(zero_stage)`).

Which globals may be carried: those of allow-lists (pickle_read.py, `--safe-globals`), and
otherwise only the training script's own classes (`__main__.Name`), and those only as plain
instances: made by NEWOBJ and given a state by BUILD, as a dataclass pickles. A file that
calls such a global (REDUCE: what a payload does to run code) is refused, so the output can
make DeepSpeed's loader build an object of the user's own script, never call a function or
build an installed package's object.
"""
from __future__ import annotations

import copyreg
import functools
import pickle

NOSTATE = _NOSTATE = object()  # a stand-in no BUILD has given a state yet


class _OpaqueMeta(type):
    """The metaclass of stand-ins: lets the pickler below spot one and name its global.
    A stand-in class is shared by every load in the process: read-only once made."""

    def __setattr__(cls, name, value):
        raise AttributeError(f"stand-in {cls.global_name} is read-only")

    __delattr__ = __setattr__

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

    def torch_reduce(self):
        """What the pickler below writes: the instructions the stand-in was made by.
        NEWOBJ as pickle spells it (copyreg.__newobj__ with the class first), else REDUCE."""
        if self._how == "newobj":
            head = (copyreg.__newobj__, (type(self), *self._args))
        else:
            head = (type(self), self._args)
        return head if self._state is _NOSTATE else (*head, self._state)

    def __reduce__(self):
        # Any other pickler (mpi4py sending a rank's states to another) carries the
        # stand-in itself, by name: the real class is never looked up.
        has = self._state is not _NOSTATE
        return _revive, (type(self).global_name, self._how, self._args, has,
                         self._state if has else None)

    @classmethod
    def new(cls, state: dict):
        """An instance as pickle's NEWOBJ and BUILD make one (what a dataclass pickles as)."""
        obj = object.__new__(cls)
        obj._how, obj._args, obj._state = "newobj", (), state
        return obj

    def __getattr__(self, name: str):
        # Only called for names not found otherwise: the fields of a BUILD state dict.
        state = self.__dict__.get("_state")
        if isinstance(state, dict) and name in state:
            return state[name]
        raise AttributeError(f"{type(self).global_name} has no field {name!r}")

    def __int__(self) -> int:
        """An int enum's value (its REDUCE argument), e.g. DeepSpeed's ZeroStageEnum."""
        if self._how == "reduce" and len(self._args) == 1 and type(self._args[0]) is int:
            return self._args[0]
        raise TypeError(f"{type(self).global_name} is not an int")

    __index__ = __int__

    def __eq__(self, other) -> bool:
        return (type(other) is type(self) and self._how == other._how
                and self._args == other._args and self._state == other._state)

    def __hash__(self) -> int:
        # Of what the pickle gave, so that many stand-ins of one class as dict keys do not
        # all collide (a file of N such keys would cost N**2 comparisons); unhashable
        # arguments: the object itself (no two such stand-ins are then one key).
        try:
            return hash((type(self).global_name, self._how, self._args))
        except TypeError:
            return id(self)

    def __repr__(self) -> str:
        return f"<opaque {type(self).global_name}>"


_registered: dict[str, type] = {}  # stand-ins that do more than record (rebuild.py)


def register(cls: type) -> type:
    """Make cls (an Opaque subclass with its global_name) the stand-in of that name."""
    _registered[cls.global_name] = cls
    return cls


@functools.cache
def stand_in(full_name: str) -> type:
    """The stand-in class for global `module.name` (one per name, so loads compare equal)."""
    if full_name in _registered:
        return _registered[full_name]
    return _OpaqueMeta(f"Opaque[{full_name}]", (Opaque,), {"global_name": full_name})


def _revive(name: str, how: str, args: tuple, has_state: bool, state):
    obj = object.__new__(stand_in(name))
    obj._how, obj._args, obj._state = how, args, state if has_state else _NOSTATE
    return obj


# Stand-in classes travel by name to other processes (e.g. over MPI), not as globals.
copyreg.pickle(_OpaqueMeta, lambda cls: (stand_in, (cls.global_name,)))


def may_stand_in(full_name: str) -> bool:
    """Whether a class of this name may be carried as plain instances without being on an
    allow-list: one of the training script's own (`__main__.Name`). A name alone cannot
    tell a dataclass of the user's package from an installed package's class whose
    `__new__` or `__setstate__` runs code (sympy's Poly evaluates a string): such classes
    need --safe-globals. In DeepSpeed's loader, `__main__` is the user's own script."""
    module, _, name = full_name.rpartition(".")
    return module == "__main__" and "." not in name


class Pickler(pickle._Pickler):  # type: ignore[name-defined]
    """The pure-Python pickler, writing a stand-in class back as its original GLOBAL and a
    stand-in instance as the instructions that made it."""

    dispatch = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]

    def reducer_override(self, obj):
        return obj.torch_reduce() if isinstance(obj, Opaque) else NotImplemented

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

    # Plain dicts and lists batched as the C pickler (torch.save's) batches them, which
    # differs from the pure one's in the last batch: C writes one item alone (SETITEM,
    # APPEND) only when it is the container's only item, and after a full batch of a dict
    # an empty MARK SETITEMS.
    def save_dict(self, obj: dict) -> None:
        self.write(pickle.EMPTY_DICT)
        self.memoize(obj)
        if len(obj) == 1:
            for k, v in obj.items():
                self.save(k)
                self.save(v)
            self.write(pickle.SETITEM)
        elif obj:
            items, n = list(obj.items()), len(obj)
            for start in range(0, n + 1 if n % self._BATCHSIZE == 0 else n, self._BATCHSIZE):
                self.write(pickle.MARK)
                for k, v in items[start: start + self._BATCHSIZE]:
                    self.save(k)
                    self.save(v)
                self.write(pickle.SETITEMS)

    dispatch[dict] = save_dict

    def save_list(self, obj: list) -> None:
        self.write(pickle.EMPTY_LIST)
        self.memoize(obj)
        if len(obj) == 1:
            self.save(obj[0])
            self.write(pickle.APPEND)
        else:
            for start in range(0, len(obj), self._BATCHSIZE):
                self.write(pickle.MARK)
                for x in obj[start: start + self._BATCHSIZE]:
                    self.save(x)
                self.write(pickle.APPENDS)

    dispatch[list] = save_list

