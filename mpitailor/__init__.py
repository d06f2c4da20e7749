"""mpitailor: layer-wise composite checkpoints from DeepSpeed ZeRO-3 saves, merged with MPI."""
