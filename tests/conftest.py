"""Shared test setup: real DeepSpeed fixtures (see ckpt_fixtures.py) and small helpers."""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import ckpt_fixtures
import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(scope="session")
def ckpt():
    """ckpt(name, step) -> the tag dir (or HF checkpoint-N) of a real DeepSpeed run."""
    return ckpt_fixtures.tag_dir


@pytest.fixture(scope="session")
def built_once(tmp_path_factory):
    """built_once(name, build) -> a dir that build(dir) filled, once per test session, also
    under pytest-xdist: the workers' temp dirs share a parent, where they take turns on a
    lock; the first to come builds and the others reuse. A build that failed is not marked
    done, so the next worker builds again (and fails as the first did)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def once(name: str, build: Callable[[Path], object]) -> Path:
        path, done = root / name, root / name / ".built"
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not done.is_file():
                shutil.rmtree(path, ignore_errors=True)  # a build that failed
                path.mkdir()
                build(path)
                done.touch()
        return path
    return once


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
