"""Shared test setup: real DeepSpeed fixtures (see ckpt_fixtures.py) and small helpers."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import ckpt_fixtures
import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(scope="session")
def ckpt():
    """ckpt(name, step) -> the tag dir (or HF checkpoint-N) of a real DeepSpeed run."""
    return ckpt_fixtures.tag_dir


@pytest.fixture
def ckpt_copy(tmp_path):
    """ckpt_copy(name) -> a private copy of a fixture's whole save dir, safe to damage."""
    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(ckpt_fixtures.build(name), dst)
        return dst
    return copy


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under root: proves inputs were not modified."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}
