"""The environment a test gives the launcher of a child job (mpiexec, srun, or a plain
`python -m mpitailor`).

Standard library only: tests/compat/output_bytes.py, a standalone harness that must not
import mpitailor itself, takes it from here too."""
from __future__ import annotations

import os

# Variables of an outer MPI job (pytest itself under mpiexec) must not reach a child job.
OUTER = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_")


def child_env(*also: str) -> dict[str, str]:
    """This process's environment less the outer job's variables: those named by a prefix of
    OUTER, or of `also` (a caller's own additions)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(OUTER + also)}
