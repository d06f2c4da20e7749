"""The oracle of the reader fuzzer: one input through mpitailor's reader and torch's
weights-only loader, and what their answers say.

Verdicts: `agree-refuse`, `agree-accept` (the same tensors, containers and values),
`stricter` (mpitailor refuses what torch reads: allowed, counted by kind), `stand-in` (the
one listed exception: see STAND_INS) and the findings of FINDINGS, each with a signature
that groups inputs failing the same way (numbers and paths taken out).
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import resource
import signal
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import reader_compare as compare
import reader_fuzzing as fz
import reader_grammar as grammar

from mpitailor.errors import CheckpointError
from mpitailor.formats.torch import pickle_read, safeload

FINDINGS = ("disagree", "mismatch", "crash", "outside", "blowup", "memory", "hang", "slow",
            "harness")  # the last: the fuzzer's own checks failed (a bug here, to fix)
# Globals mpitailor knowingly accepts as stand-ins (never built: it records their arguments)
# because real DeepSpeed and HF files carry them; torch builds the real classes, under
# safe_globals naming the same ones. When torch refuses an input only because one of them
# raised on the file's arguments, mpitailor's acceptance is this exception, not a finding.
# (mpitailor's own lists: torch is told exactly what mpitailor allows)
STAND_INS = {group: pickle_read.ALLOWED[group] for group in ("deepspeed", "numpy")}
SLOW_S = 2.0  # bench: one input's load and checks
MEMORY_MB = 200  # bench: growth of the process's peak RSS on one input
HANG_S = 20  # test and bench: a load that runs this long is stopped and reported
AS_HEADROOM = 2 << 30  # address space a fuzzing process may grow by (a MemoryError beyond)


@dataclass(frozen=True)
class Outcome:
    verdict: str
    sig: str = ""      # what kind: findings and stricter refusals are grouped by it
    detail: str = ""   # one line
    seconds: float = 0.0  # mpitailor's load alone
    rss_mb: float = 0.0   # growth of the peak RSS over mpitailor's load alone


class _Hang(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _Hang()


@contextlib.contextmanager
def memory_limited():
    """limit_memory() for a block, the process's own limit back after it (a pytest worker
    runs other tests after the fuzzer's: a 4 GiB map of one of them failed under it)."""
    before = resource.getrlimit(resource.RLIMIT_AS)
    limit_memory()
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, before)


def limit_memory() -> None:
    """Let this process's address space grow by AS_HEADROOM at most, so that a reader asking
    for gigabytes gets a MemoryError (reported as a finding) instead of the machine's RAM."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[0])
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    want = pages * os.sysconf("SC_PAGE_SIZE") + AS_HEADROOM
    if soft == resource.RLIM_INFINITY or soft > want:
        resource.setrlimit(resource.RLIMIT_AS, (want if hard == resource.RLIM_INFINITY
                                                else min(want, hard), hard))


def normalize(text: str, path: str | Path = "") -> str:
    """A message as a kind: the file's path, record folders and numbers taken out."""
    text = str(text).strip().split("\n")[0]
    if path:
        text = text.replace(str(path), "FILE")
    text = re.sub(r"[\w.-]+/(data\.pkl|data/|version|byteorder|\.data/)", r"ARCHIVE/\1", text)
    text = re.sub(r"0x[0-9a-f]+", "N", text)
    text = re.sub(r"\d+", "N", text)
    return text[:160]


def _torch_message(e: BaseException) -> str:
    """torch's refusal as one line (the weights-only unpickler's own words where it has them;
    an unsupported opcode by its name)."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].strip()
    m = re.match(r"Unsupported operand (\d+)", text)
    if m:
        import pickletools
        code = chr(int(m.group(1)))
        names = [o.name for o in pickletools.opcodes if o.code == code]
        text = f"Unsupported operand {names[0] if names else m.group(1)}"
    return f"{type(e).__name__}: {normalize(text)}"


def _torch_globals(allow: tuple[str, ...]) -> list:
    import importlib
    out = []
    for group in allow:
        for full in STAND_INS[group]:
            module, _, name = full.rpartition(".")
            try:
                obj = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                continue
            out.append(obj)
            if module.startswith("numpy._core."):  # numpy 1's spelling, which mpitailor allows
                out.append((obj, full.replace("numpy._core.", "numpy.core.")))
    return out


def torch_side(data: bytes, allow: tuple[str, ...]):
    """("ok", obj) or ("refused", exception) from torch.load(weights_only=True)."""
    import torch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.serialization.safe_globals(_torch_globals(allow)):
                return "ok", torch.load(io.BytesIO(data), map_location="cpu",
                                        weights_only=True)
        except _Hang:
            raise
        except Exception as e:  # noqa: BLE001 - every refusal of torch's is an answer
            return "refused", e


def _stand_in_raised(e: BaseException, allow: tuple[str, ...]) -> bool:
    """torch refused because a stand-in's real class raised on the file's arguments: the
    object its unpickler was calling (REDUCE), making (NEWOBJ) or filling (BUILD) when it
    failed is one of STAND_INS, or the error came from inside their modules."""
    names = {n for group in allow for n in STAND_INS[group]}
    chain = [e]  # torch re-raises the unpickler's error `from None`: it is the context
    while chain[-1].__context__ is not None and len(chain) < 5:
        chain.append(chain[-1].__context__)
    return any(_raised_in(x.__traceback__, names) for x in chain)


def _raised_in(tb, names: set[str]) -> bool:
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.endswith("_weights_only_unpickler.py") and \
                frame.f_code.co_name == "load":
            local = frame.f_locals
            op = {b"R": "func", b"\x81": "cls", b"b": "inst"}.get(local.get("key"))
            target = local.get(op) if op else None
            target = type(target) if op == "inst" else target
            if target is not None and compare.name(target) in names:
                return True
        f = frame.f_code.co_filename
        if f"{os.sep}deepspeed{os.sep}" in f or f"{os.sep}numpy{os.sep}" in f:
            return True
        tb = tb.tb_next
    return False


def _crash_sig(e: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if "mpitailor" in f.filename or "reader_" in f.filename]
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].name}" if frames else ""
    return f"{type(e).__name__}{where}: {normalize(e)}"


def judge(inp: fz.Input, path: Path) -> Outcome:
    """Write the input to `path`, load it both ways, and say what that shows."""
    path.write_bytes(inp.data)
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(HANG_S)
    cost = [0.0, 0.0]
    try:
        out = _judge(inp, path, cost)
    except _Hang:
        out = Outcome("hang", "a load or its checks ran past the time bound")
    except Exception as e:  # noqa: BLE001 - the checks' own failure, reported, not fatal
        out = Outcome("harness", f"the fuzzer's checks raised {_crash_sig(e)}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return Outcome(out.verdict, out.sig, out.detail, *cost)


def _ours(inp: fz.Input, path: Path, cost: list):
    """mpitailor's load, timed, and the growth of the peak RSS over it (so torch's
    allocations, made after, never hide one of mpitailor's)."""
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    try:
        return "ok", safeload.load(path, allow=inp.allow)
    except _Hang:
        raise
    except Exception as e:  # noqa: BLE001 - judged below
        return "raised", e
    finally:
        cost[0] = time.perf_counter() - start
        cost[1] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024


def _judge(inp: fz.Input, path: Path, cost: list) -> Outcome:
    got, ours = _ours(inp, path, cost)
    try:
        state, theirs = torch_side(inp.data, inp.allow)
    except _Hang:  # torch's problem (a key shared 2^64 times, hashed path by path)
        return Outcome("torch-hang", f"torch's load ran past {HANG_S} s; mpitailor "
                       f"{'refused' if got == 'raised' else 'accepted'} it")
    try:
        if got == "raised":
            raise ours
    except CheckpointError as e:
        msg = normalize(e, path)
        if "(MemoryError)" in str(e):
            return Outcome("memory", "the reader ran out of memory (a MemoryError under "
                           "the fuzzer's address-space bound)", msg)
        if state == "refused":
            return Outcome("agree-refuse")
        return Outcome("stricter", _stricter_kind(msg), msg)
    except _Hang:
        raise
    except BaseException as e:  # noqa: BLE001 - anything but CheckpointError is a finding
        return Outcome("crash", _crash_sig(e), "".join(
            traceback.format_exception_only(type(e), e)).strip()[:300])
    problem = compare.outside(ours, path)
    if problem:
        return Outcome("outside", problem)
    if state == "refused":
        if _stand_in_raised(theirs, inp.allow):
            return Outcome("stand-in", _torch_message(theirs))
        return Outcome("disagree", f"mpitailor accepts, torch refuses: {_torch_message(theirs)}")
    problem = compare.same(ours, theirs)
    if problem:
        return Outcome("mismatch", f"both accept, different objects: {normalize(problem)}",
                       problem[:300])
    problem = compare.walkers(ours, path)
    if problem:
        return Outcome("blowup", problem)
    return Outcome("agree-accept")


def _stricter_kind(msg: str) -> str:
    m = re.search(r"it pickles (\S+) outside", msg)
    if m:
        return f"global {m.group(1)}"
    m = re.search(r"checkpoint file \((.*)\); re-copy", msg)
    return m.group(1) if m else msg


def finding(o: Outcome) -> bool:
    return o.verdict in FINDINGS


# ---- the smallest input that fails the same way -------------------------------------------------

def shrink(inp: fz.Input, want: Outcome, path: Path, budget: int = 400) -> fz.Input:
    """A smaller input with the same verdict and signature: records dropped, then the
    pickle's opcodes (or bytes, where it no longer parses) removed in chunks (ddmin), in at
    most `budget` loads. Inputs without records (cut or damaged zips) come back as they are."""
    if not inp.records:
        return inp
    runs = [0]

    def same_failure(recs: list) -> bool:
        runs[0] += 1
        got = judge(fz.Input(inp.kind, fz.build_zip(recs), inp.note, inp.allow), path)
        return (got.verdict, got.sig) == (want.verdict, want.sig)

    recs = list(inp.records)
    for r in list(recs):
        if not r.name.endswith("/data.pkl") and runs[0] < budget:
            trial = [x for x in recs if x is not r]
            if same_failure(trial):
                recs = trial
    at = next((i for i, r in enumerate(recs) if r.name.endswith("/data.pkl")), None)
    if at is not None:
        try:
            items, join = grammar.parse_ops(recs[at].data), grammar.encode_ops
        except Exception:  # noqa: BLE001 - a pickle pickletools cannot walk: shrink bytes
            items, join = list(recs[at].data), bytes
        items = _ddmin(items, lambda xs: runs[0] < budget and same_failure(
            recs[:at] + [replace(recs[at], data=join(xs))] + recs[at + 1:]))
        recs[at] = replace(recs[at], data=join(items))
    return fz.Input(inp.kind, fz.build_zip(recs), inp.note, inp.allow, tuple(recs))


def _ddmin(items: list, fails) -> list:
    n = 2
    while len(items) >= 2:
        chunk = -(-len(items) // n)
        for start in range(0, len(items), chunk):
            trial = items[:start] + items[start + chunk:]
            if fails(trial):
                items, n = trial, max(n - 1, 2)
                break
        else:
            if n >= len(items):
                return items
            n = min(n * 2, len(items))
    return items
