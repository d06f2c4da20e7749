"""The command line: argparse (options declared once) and all printing."""
from __future__ import annotations

from mpitailor.cli.main import main

__all__ = ["main"]
