"""Launcher discovery: torchrun, SLURM and MPI environments resolve to the same LaunchInfo."""

import pytest

from megatron_ext.training.distributed import first_slurm_host, resolve_launch


def test_torchrun_env():
    info = resolve_launch({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                           "MASTER_ADDR": "node3", "MASTER_PORT": "1234"})
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("torchrun", 5, 8, 1)
    assert (info.master_addr, info.master_port) == ("node3", 1234)


def test_slurm_env_takes_first_node_as_master():
    info = resolve_launch({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                           "SLURM_JOB_NODELIST": "gpu[07-09,12]"})
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("slurm", 9, 16, 1)
    assert info.master_addr == "gpu07"


def test_torchrun_wins_over_slurm():
    # torchrun inside an sbatch allocation: torchrun's own ranks are the real ones
    info = resolve_launch({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0",
                           "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1"})
    assert info.launcher == "torchrun" and info.rank == 1


@pytest.mark.parametrize("env", [
    {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
    {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1"},
])
def test_mpi_env(env):
    info = resolve_launch({**env, "MASTER_ADDR": "head"})
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("mpi", 3, 4, 1)
    assert info.master_addr == "head"


def test_single_process_default():
    info = resolve_launch({})
    assert (info.launcher, info.rank, info.world_size) == ("single", 0, 1)


@pytest.mark.parametrize("nodelist,host", [
    ("node01", "node01"), ("a[1-4]", "a1"), ("gpu[07-09,12],cpu1", "gpu07"),
    ("x[003,005]", "x003"), ("h1,h2", "h1"),
])
def test_slurm_nodelist(nodelist, host):
    assert first_slurm_host(nodelist) == host
