"""mpitailor: layer-wise composite checkpoints from DeepSpeed ZeRO-3 saves, merged with MPI.

`from mpitailor import merge, recover` (mpitailor/api.py); loaded on first use, so that
importing the package costs nothing. Nothing outside `mpitailor.training` imports torch.
"""

from mpitailor.version import __version__  # noqa: F401 - re-exported

__all__ = ["MergeResult", "merge", "recover"]


def __getattr__(name: str):
    if name in __all__:
        from mpitailor import api
        return getattr(api, name)
    raise AttributeError(f"module 'mpitailor' has no attribute {name!r}")
