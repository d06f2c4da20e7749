"""Pieces of `python -m bench.gpu_check` (issue 24, part 4): training workers run as
subprocesses, one per training run. Self-contained: they use mpitailor's public surfaces
only (`mpitailor.training` and the `python -m mpitailor` CLI)."""
