"""Find out who we are (rank, world, master) from the launcher's environment, then init.

Supported launchers, in priority order:

1. torchrun / torch elastic (``RANK`` and ``WORLD_SIZE`` set);
2. MPI (``mpirun``/``mpiexec``: ``OMPI_COMM_WORLD_RANK``, ``PMI_RANK`` or ``PMIX_RANK`` set):
   through mpi4py when it is importable (local rank from a shared-memory communicator split,
   master address and a free port broadcast from rank 0), else from the launcher's env vars;
3. SLURM (``srun``: ``SLURM_PROCID`` set), master = first host of the step's node list;
4. a single process.

Libraries never read ``os.environ``: the app passes it to :func:`discover`.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mt_dist.exits import LaunchFailed
from mt_dist.groups import backend_for
from mt_dist.nodelist import expand_tasks_per_node, first_host

__all__ = [
    "LaunchError", "LaunchInfo", "PeerLost", "RendezvousFailed", "discover", "free_port",
    "finalize_distributed", "init_distributed", "local_device", "lost_peer",
]

LAUNCHERS = ("torchrun", "deepspeed", "mpi", "slurm", "single")
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


class LaunchError(ValueError):
    """The launcher environment is incomplete or inconsistent; ``fields``: the
    :class:`LaunchInfo` fields at fault (:func:`discover` names the variables they came from)."""

    def __init__(self, message: str, *fields: str) -> None:
        super().__init__(message)
        self.fields = fields


class RendezvousFailed(LaunchFailed):
    """The ranks did not meet at ``master_addr:master_port`` (a peer never came, the address
    is not reachable): a failed run, said in one line."""


class PeerLost(LaunchFailed):
    """A rank started by a launcher lost a peer mid-run (it died, hung past the timeout or
    its connection broke): a failed run, said in one line (:func:`lost_peer`)."""


#: What torch's communication errors say (gloo's are plain RuntimeErrors).
_COMM_MARKERS = ("gloo/transport", "Connection reset by peer", "Connection closed by peer",
                 "ProcessGroupGloo", "ProcessGroupNCCL")


def lost_peer(err: BaseException, info: LaunchInfo) -> PeerLost | None:
    """``err`` as one line when it is a failed collective (a peer died, hung or its
    connection broke: a torch ``DistError`` or gloo's errors), else None."""
    if not isinstance(err, RuntimeError):
        return None
    text = " ".join(str(err).split())
    if not (isinstance(err, dist.DistError) or any(m in text for m in _COMM_MARKERS)):
        return None
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # gloo's "[/path/pair.cc:537] "
    text = text.split(" Exception raised from ", 1)[0].split(". This is typically", 1)[0]
    return PeerLost(f"rank {info.rank} of {info.world_size} ({info.launcher}) lost its peers "
                    f"mid-run: {text.rstrip('.')}; another rank stopped, hung or lost its "
                    "connection: its own log says why")


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as told by its launcher.

    Attributes:
        rank: global rank in [0, world_size).
        world_size: number of processes in the job.
        local_rank: rank among the processes on this node (selects the GPU).
        local_world_size: number of processes on this node.
        master_addr: host of the rendezvous store (where rank 0 runs).
        master_port: TCP port of the rendezvous store (0: any free port, single process only).
        launcher: one of ``"torchrun"``, ``"mpi"``, ``"slurm"``, ``"single"``.
        attempt: how many times the launcher restarted the job (torchrun's
            ``TORCHELASTIC_RESTART_COUNT``); the rendezvous keys of each attempt are its own.
        agent_store: the launcher's agent hosts the rendezvous store (torchrun's
            ``TORCHELASTIC_USE_AGENT_STORE``), so rank 0 does not.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str
    attempt: int = 0
    agent_store: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise LaunchError(f"world size must be >= 1, got {self.world_size}", "world_size")
        if not 0 <= self.rank < self.world_size:
            raise LaunchError(f"rank {self.rank} is outside [0, {self.world_size})",
                              "rank", "world_size")
        if not 1 <= self.local_world_size <= self.world_size:
            raise LaunchError(
                f"local world size {self.local_world_size} is outside [1, {self.world_size}]",
                "local_world_size", "world_size",
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise LaunchError(
                f"local rank {self.local_rank} is outside [0, {self.local_world_size})",
                "local_rank", "local_world_size",
            )
        if not 0 <= self.master_port <= 65535 or (self.master_port == 0 and self.world_size > 1):
            raise LaunchError(
                f"master port {self.master_port} is invalid for world size {self.world_size} "
                "(1-65535; 0 means 'any' and is allowed only for a single process)",
                "master_port", "world_size",
            )
        if not self.master_addr.strip("[] "):
            raise LaunchError("master address is empty", "master_addr")
        if self.launcher not in LAUNCHERS:
            raise LaunchError(f"launcher {self.launcher!r} is not one of {LAUNCHERS}")


_INTEGER = re.compile(r"[+-]?[0-9]+")


def _int(environ: Mapping[str, str], *names: str, default: int | None = None) -> int:
    """The first of ``names`` present in ``environ``, as an int (ASCII digits only)."""
    for name in names:
        if name in environ:
            text = environ[name].strip()
            if _INTEGER.fullmatch(text) is None:
                raise LaunchError(f"{name}={environ[name]!r} is not an integer")
            return int(text)
    if default is None:
        raise LaunchError(f"none of {', '.join(names)} is set")
    return default


def discover(environ: Mapping[str, str], *, use_mpi4py: bool = True) -> LaunchInfo:
    """Read this process's :class:`LaunchInfo` from a launcher environment mapping.

    ``MASTER_ADDR`` / ``MASTER_PORT``, when set, override what a launcher would derive.
    With ``use_mpi4py=False`` (or when mpi4py is not installed) MPI jobs are read from the
    launcher's variables only; this is pure, needs ``MASTER_ADDR`` for multi-node jobs and
    cannot pick a free port.
    """
    if ("RANK" in environ) != ("WORLD_SIZE" in environ):
        given, missing = ("RANK", "WORLD_SIZE") if "RANK" in environ else ("WORLD_SIZE", "RANK")
        raise LaunchError(f"{given}={environ[given]!r} is set but {missing} is not: a "
                          "launcher (torchrun, deepspeed) sets both; unset it to run alone")
    if "RANK" in environ:
        return _from_torchrun(environ)
    if any(name in environ for name in _MPI_RANK_VARS):
        if use_mpi4py:
            try:
                from mpi4py import MPI  # noqa: F401  # pants: no-infer-dep (optional)
            except (ImportError, RuntimeError):  # RuntimeError: it finds no MPI library
                pass
            else:
                return _from_mpi4py(environ)
        return _from_mpi_env(environ)
    if "SLURM_PROCID" in environ:
        return _from_slurm(environ)
    return _info(environ, {"master_addr": ("MASTER_ADDR",), "master_port": ("MASTER_PORT",)},
                 rank=0, world_size=1, local_rank=0, local_world_size=1,
                 master_addr=environ.get("MASTER_ADDR", DEFAULT_MASTER_ADDR),
                 master_port=_int(environ, "MASTER_PORT", default=0),
                 launcher="single")


def _info(environ: Mapping[str, str], sources: Mapping[str, tuple[str, ...]],
          **fields: object) -> LaunchInfo:
    """``LaunchInfo(**fields)``; when it is inconsistent, its error names the variables
    (``sources``: the candidates of each field, the first set one counts) and their values."""
    try:
        return LaunchInfo(**fields)  # type: ignore[arg-type]
    except LaunchError as err:
        named = []
        for field in err.fields:
            name = next((n for n in sources.get(field, ()) if n in environ), None)
            if name is not None and name not in (n for n, _ in named):
                named.append((name, environ[name]))
        if not named:
            raise
        given = ", ".join(f"{name}={value!r}" for name, value in named)
        raise LaunchError(f"{err} (from {given})", *err.fields) from None


def _from_torchrun(environ: Mapping[str, str]) -> LaunchInfo:
    """torchrun's variables, or the DeepSpeed launcher's (the same, with ``LOCAL_SIZE``
    for ``LOCAL_WORLD_SIZE``)."""
    deepspeed = "LOCAL_SIZE" in environ and "LOCAL_WORLD_SIZE" not in environ
    local_size = "LOCAL_SIZE" if deepspeed else "LOCAL_WORLD_SIZE"
    if "LOCAL_RANK" in environ and local_size not in environ:
        raise LaunchError(f"LOCAL_RANK={environ['LOCAL_RANK']} is set but neither "
                          "LOCAL_WORLD_SIZE (torchrun) nor LOCAL_SIZE (deepspeed) is")
    sources = {"rank": ("RANK",), "world_size": ("WORLD_SIZE",), "local_rank": ("LOCAL_RANK",),
               "local_world_size": (local_size,), "master_addr": ("MASTER_ADDR",),
               "master_port": ("MASTER_PORT",)}
    return _info(
        environ, sources,
        rank=_int(environ, "RANK"),
        world_size=_int(environ, "WORLD_SIZE"),
        local_rank=_int(environ, "LOCAL_RANK", default=0),
        local_world_size=_int(environ, local_size, default=1),
        master_addr=environ.get("MASTER_ADDR", DEFAULT_MASTER_ADDR),
        master_port=_int(environ, "MASTER_PORT", default=DEFAULT_MASTER_PORT),
        launcher="deepspeed" if deepspeed else "torchrun",
        attempt=_int(environ, "TORCHELASTIC_RESTART_COUNT", default=0),
        agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )


def _from_mpi_env(environ: Mapping[str, str]) -> LaunchInfo:
    """Open MPI (OMPI_COMM_WORLD_*) or MPICH/Hydra (PMI_*, MPI_LOCAL*) variables."""
    world_size = _int(environ, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    local_world_size = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
    if "MASTER_ADDR" in environ:
        addr = environ["MASTER_ADDR"]
    elif local_world_size == world_size:
        addr = DEFAULT_MASTER_ADDR  # everyone is on this node
    else:
        raise LaunchError(
            f"MPI job spans nodes ({world_size} ranks, {local_world_size} on this node): set "
            "MASTER_ADDR or install mpi4py (with an MPI library it loads) so rank 0 can "
            "broadcast its address"
        )
    sources = {"rank": _MPI_RANK_VARS, "world_size": ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
               "local_rank": ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"),
               "local_world_size": ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"),
               "master_addr": ("MASTER_ADDR",), "master_port": ("MASTER_PORT",)}
    return _info(
        environ, sources,
        rank=_int(environ, *_MPI_RANK_VARS),
        world_size=world_size,
        local_rank=_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"),
        local_world_size=local_world_size,
        master_addr=addr,
        master_port=_int(environ, "MASTER_PORT", default=DEFAULT_MASTER_PORT),
        launcher="mpi",
    )


def _from_mpi4py(environ: Mapping[str, str]) -> LaunchInfo:
    """Ask MPI itself; rank 0 broadcasts the rendezvous address and a free port."""
    from mpi4py import MPI  # pants: no-infer-dep (optional: mt-dist[mpi])

    comm = MPI.COMM_WORLD
    rank, world_size = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_world_size = node.Get_rank(), node.Get_size()
    node.Free()
    single_node = local_world_size == world_size  # the same answer on every rank
    addr = environ.get("MASTER_ADDR")
    if addr is None:
        mine = (DEFAULT_MASTER_ADDR if single_node else socket.gethostname()) if rank == 0 else None
        addr = comm.bcast(mine, root=0)
    if "MASTER_PORT" in environ:
        port = _int(environ, "MASTER_PORT")
    else:
        port = comm.bcast(free_port() if rank == 0 else None, root=0)
    return _info(
        environ, {"master_addr": ("MASTER_ADDR",), "master_port": ("MASTER_PORT",)},
        rank=rank, world_size=world_size, local_rank=local_rank,
        local_world_size=local_world_size, master_addr=addr, master_port=port, launcher="mpi",
    )


def _from_slurm(environ: Mapping[str, str]) -> LaunchInfo:
    """srun tasks: SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and the step's node list."""
    world_size = _int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    nodelists = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    nodelist = next((n for n in nodelists if n in environ), None)
    if "MASTER_ADDR" in environ:
        addr = environ["MASTER_ADDR"]
    elif nodelist is not None:
        try:
            addr = first_host(environ[nodelist])
        except ValueError as err:
            raise LaunchError(f"{nodelist}: {err}") from None
    else:
        raise LaunchError("SLURM job without SLURM_JOB_NODELIST / SLURM_NODELIST or MASTER_ADDR")
    # All tasks of a job must agree on the port without talking: derive it from the job id
    # (so two jobs sharing a node do not collide) unless MASTER_PORT says otherwise.
    job_port = 15000 + _int(environ, "SLURM_JOB_ID", "SLURM_JOBID", default=14500) % 20000
    sources = {"rank": ("SLURM_PROCID",),
               "world_size": ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"),
               "local_rank": ("SLURM_LOCALID",),
               "local_world_size": ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                                    "SLURM_NTASKS_PER_NODE"),
               "master_addr": ("MASTER_ADDR", *nodelists),
               "master_port": ("MASTER_PORT", "SLURM_JOB_ID", "SLURM_JOBID")}
    return _info(
        environ, sources,
        rank=_int(environ, "SLURM_PROCID"),
        world_size=world_size,
        local_rank=_int(environ, "SLURM_LOCALID", default=0),
        local_world_size=_slurm_local_world_size(environ),
        master_addr=addr,
        master_port=_int(environ, "MASTER_PORT", default=job_port),
        launcher="slurm",
    )


def _slurm_local_world_size(environ: Mapping[str, str]) -> int:
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if name not in environ:
            continue
        try:
            counts = expand_tasks_per_node(environ[name])
        except ValueError as err:
            raise LaunchError(f"{name}: {err}") from None
        if "SLURM_NODEID" in environ:
            node = _int(environ, "SLURM_NODEID")
            if not 0 <= node < len(counts):
                raise LaunchError(f"SLURM_NODEID {node} is outside the {len(counts)} nodes "
                                  f"of {name}={environ[name]!r}")
            return counts[node]
        if len(set(counts)) == 1:
            return counts[0]
    if "SLURM_NTASKS_PER_NODE" in environ:
        return _int(environ, "SLURM_NTASKS_PER_NODE")
    raise LaunchError(
        "cannot tell how many SLURM tasks run on this node: set SLURM_TASKS_PER_NODE with "
        "SLURM_NODEID, or SLURM_NTASKS_PER_NODE"
    )


def free_port(host: str = "") -> int:
    """A TCP port that was free a moment ago (the OS's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def local_device(info: LaunchInfo, *, use_cuda: bool | None = None) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is used (default: when available), else ``cpu``."""
    if use_cuda is None:
        use_cuda = torch.cuda.is_available()
    return torch.device("cuda", info.local_rank) if use_cuda else torch.device("cpu")


def init_distributed(
    info: LaunchInfo,
    device: torch.device | str = "cpu",
    *,
    timeout: timedelta | float = timedelta(minutes=10),
) -> None:
    """Initialize the default process group for ``info`` (gloo on CPU, nccl on CUDA).

    Rendezvous is a TCP store at ``master_addr:master_port`` (hosted by rank 0, or by the
    launcher's agent); in the agent's store, the keys of each launcher attempt are under
    a prefix of their own: the ranks a launcher restarted never read the addresses their
    predecessors left there. The environment is neither read nor modified. ``timeout`` (a
    timedelta or seconds) bounds the rendezvous and every collective, so a missing rank
    fails instead of hanging.
    """
    if dist.is_initialized():
        raise RuntimeError("the default process group is already initialized")
    device = torch.device(device)
    backend = backend_for(device)
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    host = info.master_addr.strip("[]")
    try:
        socket.getaddrinfo(host, info.master_port)
    except (OSError, UnicodeError) as err:  # socket.gaierror; UnicodeError: a bad IDNA name
        raise LaunchError(f"master address {info.master_addr!r} (MASTER_ADDR, or the "
                          f"launcher's first host) does not resolve: {err}") from None
    hosts_store = info.rank == 0 and not info.agent_store
    if not hosts_store and (unreachable := _unanswered(host, info.master_port, timeout)):
        raise _rendezvous_error(TimeoutError(unreachable), info, timeout)
    try:
        store = dist.TCPStore(host, info.master_port, info.world_size, is_master=hosts_store,
                              timeout=timeout, multi_tenant=True)
        # The agent's store outlives an attempt: each attempt keys its rendezvous apart. A
        # store of rank 0's own is new with every attempt, and the agents' restart counts may
        # differ (one that joined an elastic job later counts from 0): there, one prefix for
        # all.
        prefix = f"mt/attempt-{info.attempt}" if info.agent_store else "mt"
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(prefix, store),
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    except dist.DistError as err:
        raise _rendezvous_error(err, info, timeout) from None


def _unanswered(host: str, port: int, timeout: timedelta) -> str | None:
    """Why no rendezvous store accepted a connection at ``host:port`` within ``timeout``, or
    None once one did. A rank that joins a store hosted elsewhere waits here, not in torch's
    store client, which logs every failed try with its C++ stack trace."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(left, 0.5)):
                return None
        except OSError as err:
            if left <= 0:
                return (f"no rendezvous store accepted a connection "
                        f"({err.strerror or str(err) or type(err).__name__})")
        time.sleep(min(0.2, max(deadline - time.monotonic(), 0.0)))


def _rendezvous_error(err: BaseException, info: LaunchInfo, timeout: timedelta) -> Exception:
    """One line for torch's failed rendezvous: a port rank 0 cannot listen on is bad input
    (:class:`LaunchError`), anything else (a peer that never came) a failed run."""
    where = f"{info.master_addr}:{info.master_port}"
    said = " ".join(str(err).split())  # torch's message, on one line
    said = said.split(" Exception raised from ", 1)[0]  # less its C++ trace
    if "EADDRINUSE" in said or "address already in use" in said:
        return LaunchError(f"rank {info.rank} of {info.world_size} cannot host the rendezvous at "
                           f"{where} (MASTER_PORT): the port is in use; choose another")
    return RendezvousFailed(
        f"rank {info.rank} of {info.world_size} ({info.launcher}) did not meet its peers at "
        f"{where} (MASTER_ADDR:MASTER_PORT) within the timeout of {timeout.total_seconds():g} s: "
        f"{said}; start every rank with the same MASTER_ADDR and MASTER_PORT, reachable from "
        "every node"
    )


def finalize_distributed(*, completed: bool = True) -> None:
    """Tear down the default process group; when ``completed``, first wait for every rank.

    gloo finishes a group's connection handshake asynchronously: a rank that tears down right
    after creating a group (the default one or a sub-group it never used) can make a slower
    peer, still connecting, fail with "Connection closed by peer". Measured on a loaded 2-core
    machine: 19 of 450 two-rank runs without the barrier, 0 of 450 with it. After a failure
    (``completed=False``) peers may never arrive, so no barrier is attempted.
    """
    if not dist.is_initialized():
        return
    if completed:
        dist.barrier()
    dist.destroy_process_group()
