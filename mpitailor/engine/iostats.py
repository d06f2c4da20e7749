"""What this process has read, written, held and spent: /proc/self/io and getrusage (Linux)."""
from __future__ import annotations

import resource
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class IOSnapshot:
    rchar: int        # bytes asked of read()/pread() (page cache or not)
    wchar: int
    read_bytes: int   # bytes the storage layer fetched (0 when served from page cache)
    write_bytes: int
    peak_rss: int     # bytes, process lifetime peak
    cpu: float        # seconds of CPU, user and system

    def since(self, earlier: "IOSnapshot") -> dict:
        return {"read_calls_bytes": self.rchar - earlier.rchar,
                "write_calls_bytes": self.wchar - earlier.wchar,
                "storage_read_bytes": self.read_bytes - earlier.read_bytes,
                "storage_write_bytes": self.write_bytes - earlier.write_bytes,
                "peak_rss_bytes": self.peak_rss, "peak_rss_growth_bytes":
                    self.peak_rss - earlier.peak_rss,
                "cpu_seconds": round(self.cpu - earlier.cpu, 4)}


def snapshot() -> IOSnapshot:
    fields = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, v = line.split(":")
                fields[k] = int(v)
    except OSError:
        pass
    use = resource.getrusage(resource.RUSAGE_SELF)
    return IOSnapshot(fields.get("rchar", 0), fields.get("wchar", 0),
                      fields.get("read_bytes", 0), fields.get("write_bytes", 0),
                      use.ru_maxrss * 1024, use.ru_utime + use.ru_stime)
