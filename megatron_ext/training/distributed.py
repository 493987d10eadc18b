"""One place that knows the launchers: torchrun, SLURM (srun), mpiexec, or a plain process.

:func:`resolve_launch` reads rank / world size / master address from whichever launcher started
us; :func:`initialize` brings up torch.distributed (gloo on CPU, NCCL on GPU, chosen
automatically) and megatron-core's model-parallel groups.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_ext.errors import UsageError

DEFAULT_MASTER_PORT = 29500
HAND_LAUNCH_RENDEZVOUS_S = 30
"""How long ranks started by hand (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` set, no launcher
agent) wait for each other: a stale environment fails in seconds, not after the timeout."""
_STALE = "unset them to train in one process, or start the job with torchrun, srun or mpiexec"


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as told by its launcher."""

    launcher: str
    """``torchrun``, ``slurm``, ``mpi`` or ``single``."""
    rank: int
    """Global rank."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank on this node (selects the GPU)."""
    master_addr: str
    """Host of rank 0 (rendezvous)."""
    master_port: int
    """TCP port of the rendezvous on rank 0."""


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist: ``gpu[07-09,12],cpu1`` -> ``gpu07``."""
    match = re.match(r"([^\[,]+)(\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ValueError(f"cannot parse SLURM nodelist '{nodelist}'")
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _mpi_rank_and_size(env) -> tuple[int, int, int] | None:
    for rank_key, size_key, local_key in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
        ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK"),
    ):
        if rank_key in env and size_key in env:
            return int(env[rank_key]), int(env[size_key]), int(env.get(local_key, 0))
    return None


def _mpi_master_addr(rank: int) -> str:
    """Rank 0's hostname, broadcast through mpi4py (falls back to localhost without it)."""
    try:
        from mpi4py import MPI
    except ImportError:
        return "127.0.0.1"
    import socket
    return MPI.COMM_WORLD.bcast(socket.gethostname() if rank == 0 else None, root=0)


def resolve_launch(env=None) -> LaunchInfo:
    """Read the launcher's environment; torchrun wins, then SLURM, then MPI, else one process."""
    env = os.environ if env is None else env
    port = int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT))
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchInfo("torchrun", int(env["RANK"]), int(env["WORLD_SIZE"]),
                          int(env.get("LOCAL_RANK", 0)), env.get("MASTER_ADDR", "127.0.0.1"), port)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST",
                                                                   env.get("SLURM_NODELIST", "")))
        return LaunchInfo("slurm", int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                          int(env.get("SLURM_LOCALID", 0)), addr, port)
    mpi = _mpi_rank_and_size(env)
    if mpi is not None:
        rank, size, local = mpi
        addr = env.get("MASTER_ADDR") or _mpi_master_addr(rank)
        return LaunchInfo("mpi", rank, size, local, addr, port)
    return LaunchInfo("single", 0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"), port)


def check_launch_env(env=None) -> None:
    """``UsageError`` for a launch environment no launcher made: ``WORLD_SIZE`` > 1 without
    ``RANK`` (nothing else tells this process its place), or ``RANK`` / ``WORLD_SIZE``
    without ``MASTER_ADDR`` (torchrun sets all three; without it no rendezvous is possible)."""
    env = os.environ if env is None else env
    size = env.get("WORLD_SIZE", "1")
    if resolve_launch(env).launcher == "single" and size not in ("", "0", "1"):
        raise UsageError(f"WORLD_SIZE={size} is set but RANK is not, and no launcher started "
                         f"this process: {_STALE}")
    if "RANK" in env and size != "1" and "MASTER_ADDR" not in env:
        raise UsageError(f"RANK={env['RANK']} WORLD_SIZE={size} are set but MASTER_ADDR is not, "
                         f"and no launcher started this process: {_STALE}")


def _hand_launched(info: LaunchInfo) -> bool:
    return info.launcher == "torchrun" and "TORCHELASTIC_RUN_ID" not in os.environ


def _listening(addr: str, port: int, deadline: float) -> bool:
    """Whether something accepts TCP connections at ``addr:port`` before ``deadline``."""
    import socket
    while time.monotonic() < deadline:
        try:
            socket.create_connection((addr, port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.2)
    return False


def _all_joined(store, world_size: int, deadline: float) -> bool:
    """Rank 0: whether every rank set its ``joined/<rank>`` key before ``deadline``."""
    keys = [f"joined/{rank}" for rank in range(world_size)]
    while time.monotonic() < deadline:
        if store.check(keys):
            return True
        time.sleep(0.2)
    return False


def _rendezvous(info: LaunchInfo, port: int, seconds: float):
    """The TCP store of a hand-launched job, every rank joined within ``seconds`` (polled, so
    that a rank left alone by a stale environment says so at once in one line)."""
    deadline = time.monotonic() + seconds
    store = None
    if info.rank == 0 or _listening(info.master_addr, port, deadline):
        store = dist.TCPStore(info.master_addr, port, info.world_size, info.rank == 0,
                              timeout=timedelta(seconds=seconds), wait_for_workers=False)
        store.set(f"joined/{info.rank}", "1")
    if store is None or info.rank == 0 and not _all_joined(store, info.world_size, deadline):
        who = "the other ranks did not join" if info.rank == 0 else "rank 0 is not listening"
        error = UsageError(f"rank {info.rank} of WORLD_SIZE={info.world_size}: {who} at "
                           f"MASTER_ADDR={info.master_addr}:{port} within {seconds:g} s; if RANK"
                           f" / WORLD_SIZE / MASTER_ADDR are left over in the shell, {_STALE}")
        error.every_rank = True  # no rank 0 to say it
        raise error
    return store


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(info: LaunchInfo, backend: str = "auto", timeout_minutes: float = 10):
    """torch.distributed over TCP rendezvous at rank 0; a no-op if already initialised. A
    collective that waits longer than ``timeout_minutes`` for a peer fails (training/peers);
    a stale launch environment is refused first (:func:`check_launch_env`), and ranks started
    by hand must all join within ``HAND_LAUNCH_RENDEZVOUS_S``."""
    if dist.is_initialized():
        return
    if backend == "auto":
        backend = default_backend()
    port = info.master_port
    if info.world_size == 1 and "MASTER_PORT" not in os.environ:
        port = _free_port()  # several single-process runs may share a machine
    if torch.cuda.is_available():
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
    check_launch_env()
    if _hand_launched(info) and info.world_size > 1:
        store = _rendezvous(info, port, HAND_LAUNCH_RENDEZVOUS_S)
        store.set_timeout(timedelta(minutes=timeout_minutes))
        dist.init_process_group(backend=backend, store=store, rank=info.rank,
                                world_size=info.world_size,
                                timeout=timedelta(minutes=timeout_minutes))
        return
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{info.master_addr}:{port}",
        rank=info.rank,
        world_size=info.world_size,
        timeout=timedelta(minutes=timeout_minutes),
    )


def initialize(args) -> LaunchInfo:
    """Process group + megatron-core parallel state + seeded RNGs for this run's layout."""
    from megatron.core import parallel_state, tensor_parallel

    from megatron_ext.compat import cpu
    from megatron_ext.training.peers import record_peers

    cpu.activate()
    info = resolve_launch()
    init_process_group(info, args.distributed_backend, args.distributed_timeout_minutes)
    record_peers(args.distributed_timeout_minutes)  # to name a lost rank (training/peers.py)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,  # megatron's groups too
    )
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    return info


def device() -> torch.device:
    """This rank's compute device: its CUDA device on a GPU node, else the CPU."""
    return (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))


def gather_objects(obj) -> list:
    """``obj`` from every rank, in rank order (just ``[obj]`` without torch.distributed)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
