"""Tiny real DeepSpeed ZeRO-3 training runs on CPU.

Used by `make demo`, the test fixtures and the benchmarks: random-init Llama/Qwen2-style
models trained for a few steps by real DeepSpeed in real separate processes (gloo), so
that every checkpoint mpitailor reads in its own tests was written by DeepSpeed itself.
"""
from __future__ import annotations

from dev.tinytrain.launch import TrainFailed, launch
from dev.tinytrain.spec import TrainSpec

__all__ = ["TrainFailed", "TrainSpec", "launch"]
