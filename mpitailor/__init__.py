"""mpitailor: layer-wise composite checkpoints from DeepSpeed ZeRO-3 saves, merged with MPI."""

__version__ = "0.1.0"
