"""Paths and text as mpitailor shows them: never raw.

A file name may hold any byte but `/` and NUL: bytes that are not UTF-8 (Python keeps them
as lone surrogates, PEP 383), a newline (that would forge a line of output), an ANSI escape
(that would reach the terminal). `shown(path)` renders a path for a message: as it is when
it is plain printable text, else quoted as bash's `$'...'` (copy-pasteable into a shell).
`bounded(obj)` shows an object read from a file in a message at a cost bounded whatever it
holds (a pickle can share one tuple 2**40 times: its full repr never ends).
`escaped(text)` is the last line of defense for a whole line about to be written (the error
line, log messages): what would be undecodable or a control character becomes a visible
escape; the rest is left as it is. `LineFormatter` gives every line mpitailor logs, from the
CLI or the training side, the one shape of its error line: `mpitailor: warning: ...`.
"""
from __future__ import annotations

import logging
import os
import reprlib

# Bidirectional overrides and isolates: they reorder what a terminal shows.
_BIDI = {*range(0x202A, 0x202F), *range(0x2066, 0x206A)}
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\x1b": "\\e"}


def _bad(ch: str) -> bool:
    o = ord(ch)
    return o < 0x20 or 0x7F <= o < 0xA0 or 0xDC80 <= o <= 0xDCFF or o in _BIDI or \
        0xD800 <= o <= 0xDFFF


def _escape(ch: str) -> str:
    o = ord(ch)
    if 0xDC80 <= o <= 0xDCFF:  # an undecodable byte, as surrogateescape keeps it
        return f"\\x{o - 0xDC00:02x}"
    if ch in _NAMED:
        return _NAMED[ch]
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def shown(path: str | os.PathLike | bytes) -> str:
    """A path for a message: itself when it is printable text, else `$'...'` with each
    control character, undecodable byte, `\\` and `'` escaped."""
    text = os.fsdecode(path)
    if not any(_bad(c) for c in text):
        return text
    body = "".join(_escape(c) if _bad(c) else "\\" + c if c in "\\'" else c for c in text)
    return f"$'{body}'"


def escaped(text: str) -> str:
    """Text safe to write to a terminal or a log as one line: control characters (a tab
    excepted), undecodable bytes and bidi overrides escaped, everything else untouched."""
    if not any(_bad(c) and c != "\t" for c in text):
        return text
    return "".join(_escape(c) if _bad(c) and c != "\t" else c for c in text)


class LineFormatter(logging.Formatter):
    """A log record as the line mpitailor writes: `mpitailor: MESSAGE` at INFO, with
    `warning: `, `error: ` or `debug: (logger) ` after the colon otherwise; `prefix` before
    it (`[rank r] ` for another rank than the one that speaks for a job). One line of plain
    text whatever paths it names; a traceback (-v) is left as it is."""

    _LEVELS = {logging.DEBUG: "debug: ", logging.INFO: "", logging.WARNING: "warning: "}

    def __init__(self, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix

    def formatMessage(self, record: logging.LogRecord) -> str:
        level = self._LEVELS.get(record.levelno, "error: ")
        if record.levelno == logging.DEBUG:
            level += f"({record.name}) "
        return f"{self.prefix}mpitailor: {level}{escaped(record.getMessage())}"


class _Bounded(reprlib.Repr):
    """reprlib with small limits, and instances of other classes by their names only (their
    own __repr__ could walk all they hold)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxdict = self.maxset = self.maxfrozenset = 4
        self.maxstring = self.maxlong = self.maxother = 40

    def repr_instance(self, x, level: int) -> str:
        name = getattr(x, "global_name", None) or getattr(type(x), "global_name", None)
        return f"<{name if isinstance(name, str) else type(x).__name__}>"


_BOUNDED = _Bounded()


def bounded(obj) -> str:
    """A short repr of an untrusted object: at most a few dozen elements are looked at, and
    no __repr__ but the builtins' is called."""
    return _BOUNDED.repr(obj)
