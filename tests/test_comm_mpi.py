"""Guarded collectives under a real mpiexec: one rank's error reaches every rank."""
from __future__ import annotations

import pytest

from mpitailor.cluster.comm import Comm, check_not_singleton
from mpitailor.errors import CheckpointError, MergeFailed, UserError


@pytest.mark.mpi(min_size=2)
def test_one_rank_failure_raises_on_every_rank():
    comm = Comm.world()

    def work():
        if comm.rank == 1:
            raise CheckpointError("bad.pt: truncated")
        return comm.rank

    with pytest.raises(CheckpointError, match=r"^bad.pt: truncated \(on rank 1\)$"):
        comm.step(work)  # its class on every rank, not only its exit code's (UserError)
    assert comm.step(lambda: comm.rank * 10) == comm.rank * 10


@pytest.mark.mpi(min_size=2)
def test_an_error_class_defined_elsewhere_keeps_its_type_on_every_rank():
    from mpitailor.formats.io import TooLarge
    comm = Comm.world()

    def work():
        if comm.rank == comm.size - 1:
            raise TooLarge("big.json: 2 GB")
    with pytest.raises(TooLarge, match="big.json: 2 GB"):
        comm.step(work)
    with pytest.raises(TooLarge):
        comm.root_step(lambda: (_ for _ in ()).throw(TooLarge("root's")))


@pytest.mark.mpi(min_size=2)
def test_unexpected_error_becomes_merge_failed_everywhere():
    comm = Comm.world()

    def work():
        if comm.rank == comm.size - 1:
            raise OSError("disk on fire")
        return 1

    with pytest.raises(MergeFailed, match="OSError: disk on fire"):
        comm.step(work)


@pytest.mark.mpi(min_size=3)
def test_every_failed_rank_is_reported_not_only_the_first():
    comm = Comm.world()

    def work():
        if comm.rank == 0:
            raise CheckpointError("a.pt: truncated")
        if comm.rank == 2:
            raise CheckpointError("c.pt: truncated")
        return 1

    with pytest.raises(UserError) as caught:
        comm.step(work)
    assert str(caught.value) == "a.pt: truncated (on rank 0); c.pt: truncated (on rank 2)"
    assert caught.value.failures == {0: "a.pt: truncated", 2: "c.pt: truncated"}


@pytest.mark.mpi(min_size=2)
def test_an_error_every_rank_had_alike_is_said_once_for_all():
    """Every rank failed with one message: no list of every rank in it, and it says it is
    raised on a world of this size (the CLI's rank 0 then prints it alone)."""
    comm = Comm.world()
    with pytest.raises(UserError) as caught:
        comm.step(lambda: (_ for _ in ()).throw(UserError("recipe.yml: unknown key")))
    assert str(caught.value) == "recipe.yml: unknown key"
    assert caught.value.raised_on == comm.size


@pytest.mark.mpi(min_size=2)
def test_failed_ranks_learn_whether_they_failed_alike():
    comm = Comm.world()
    assert comm.same_everywhere("mpitailor: error: x", 60) is True
    assert comm.same_everywhere(f"mpitailor: error: rank {comm.rank}", 60) is False
    comm.barrier()  # the world's collectives go on after it, undisturbed


@pytest.mark.mpi(min_size=2)
def test_root_step_broadcasts_result_or_error():
    comm = Comm.world()
    assert comm.root_step(lambda: {"plan": comm.rank}) == {"plan": 0}
    with pytest.raises(UserError, match="recipe.yml: unknown key"):
        comm.root_step(lambda: (_ for _ in ()).throw(UserError("recipe.yml: unknown key")))


def test_singleton_guard():
    with pytest.raises(UserError, match="PMI_SIZE=4 says 4 processes.*--mpi=pmi2"):
        check_not_singleton(1, {"PMI_SIZE": "4"})
    with pytest.raises(UserError, match="SLURM_STEP_NUM_TASKS=2"):
        check_not_singleton(1, {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"})
    check_not_singleton(1, {"SLURM_NTASKS": "4"})  # a batch script, not an srun step
    check_not_singleton(4, {"PMI_SIZE": "4"})
