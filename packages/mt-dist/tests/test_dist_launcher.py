"""Launcher discovery from plain dict environments (pure), and a real tcp:// init."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mt_dist import LaunchError, LaunchInfo, discover, free_port, init_distributed, local_device

TORCHRUN = {
    "RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29400",
}
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "8",
}
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
SLURM = {
    "SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456",
}


def test_torchrun() -> None:
    assert discover(TORCHRUN) == LaunchInfo(5, 16, 1, 4, "10.0.0.7", 29400, "torchrun")


def test_torchrun_defaults_and_missing_local_world_size() -> None:
    info = discover({"RANK": "0", "WORLD_SIZE": "2"})
    assert info == LaunchInfo(0, 2, 0, 1, "127.0.0.1", 29500, "torchrun")
    with pytest.raises(LaunchError, match="LOCAL_RANK=1 is set but neither LOCAL_WORLD_SIZE"):
        discover({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})


def test_deepspeed_launcher() -> None:
    # deepspeed's launcher (deepspeed/launcher/launch.py) names the local size LOCAL_SIZE.
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2",
           "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29501"}
    assert discover(env) == LaunchInfo(3, 4, 1, 2, "10.0.0.2", 29501, "deepspeed")


def test_bad_integer_names_the_variable() -> None:
    with pytest.raises(LaunchError, match=r"WORLD_SIZE='two' is not an integer"):
        discover({"RANK": "0", "WORLD_SIZE": "two"})
    with pytest.raises(LaunchError, match=r"rank 4 is outside \[0, 4\)"):
        discover({"RANK": "4", "WORLD_SIZE": "4"})


def test_open_mpi_env_single_node() -> None:
    info = discover(OPEN_MPI, use_mpi4py=False)
    assert info == LaunchInfo(3, 8, 3, 8, "127.0.0.1", 29500, "mpi")


def test_mpich_env_with_master_overrides() -> None:
    env = {**MPICH, "MASTER_ADDR": "head", "MASTER_PORT": "1234"}
    assert discover(env, use_mpi4py=False) == LaunchInfo(1, 2, 1, 2, "head", 1234, "mpi")


def test_pmix_rank_is_recognised() -> None:
    env = {"PMIX_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert discover(env, use_mpi4py=False).rank == 2


def test_multi_node_mpi_without_mpi4py_needs_master_addr() -> None:
    env = {**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3"}
    with pytest.raises(LaunchError, match=r"spans nodes \(8 ranks, 4 on this node\)"):
        discover(env, use_mpi4py=False)
    info = discover({**env, "MASTER_ADDR": "n0"}, use_mpi4py=False)
    assert (info.master_addr, info.local_world_size) == ("n0", 4)


def test_slurm() -> None:
    info = discover(SLURM)
    assert info == LaunchInfo(6, 8, 2, 4, "gpu07", 15000 + 123456 % 20000, "slurm")


def test_slurm_uneven_nodes_step_nodelist_and_overrides() -> None:
    env = {
        "SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0", "SLURM_NODEID": "3",
        "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_STEP_NODELIST": "node[01-03,07]",
        "SLURM_NODELIST": "ignored[1-9]", "MASTER_PORT": "4000",
    }
    assert discover(env) == LaunchInfo(6, 7, 0, 1, "node01", 4000, "slurm")
    with pytest.raises(LaunchError, match=r"SLURM_NODEID 4 is outside the 4 nodes"):
        discover({**env, "SLURM_NODEID": "4"})


def test_slurm_ntasks_per_node_fallback_and_missing_counts() -> None:
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
           "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODELIST": "solo", "MASTER_ADDR": "elsewhere"}
    info = discover(env)
    assert (info.local_world_size, info.master_addr) == (2, "elsewhere")
    del env["SLURM_NTASKS_PER_NODE"]
    with pytest.raises(LaunchError, match="how many SLURM tasks run on this node"):
        discover(env)


def test_priority_torchrun_then_mpi_then_slurm() -> None:
    assert discover({**SLURM, **MPICH, **TORCHRUN}, use_mpi4py=False).launcher == "torchrun"
    assert discover({**SLURM, **MPICH}, use_mpi4py=False).launcher == "mpi"
    assert discover(SLURM).launcher == "slurm"


def test_single_process() -> None:
    assert discover({}) == LaunchInfo(0, 1, 0, 1, "127.0.0.1", 0, "single")
    assert discover({"MASTER_PORT": "2222"}).master_port == 2222


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        ((0, 0, 0, 1, "h", 1, "single"), r"world size must be >= 1, got 0"),
        ((0, 2, 2, 2, "h", 1, "mpi"), r"local rank 2 is outside \[0, 2\)"),
        ((0, 2, 0, 3, "h", 1, "mpi"), r"local world size 3 is outside \[1, 2\]"),
        ((0, 2, 0, 1, "h", 0, "mpi"), r"master port 0 is invalid for world size 2"),
        ((0, 2, 0, 1, "h", 70000, "mpi"), r"master port 70000"),
        ((0, 1, 0, 1, "", 1, "single"), r"master address is empty"),
        ((0, 1, 0, 1, "h", 1, "pbs"), r"launcher 'pbs'"),
    ],
)
def test_launch_info_validation(args: tuple, pattern: str) -> None:
    with pytest.raises(LaunchError, match=pattern):
        LaunchInfo(*args)


def test_local_device() -> None:
    info = LaunchInfo(3, 8, 3, 4, "h", 1, "torchrun")
    assert local_device(info, use_cuda=False) == torch.device("cpu")
    assert local_device(info, use_cuda=True) == torch.device("cuda", 3)


def _init_and_reduce(info: LaunchInfo, out: mp.SimpleQueue) -> None:
    torch.set_num_threads(1)
    init_distributed(info, "cpu", timeout=timedelta(seconds=30))
    try:
        value = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(value)
        out.put((info.rank, dist.get_backend(), value.item()))
    finally:
        dist.destroy_process_group()


def test_init_distributed_tcp_two_processes() -> None:
    """Real tcp:// rendezvous without the test harness: two forked torchrun-like ranks."""
    ctx = mp.get_context("fork")
    out = ctx.SimpleQueue()
    port = free_port()
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": str(port)}
    infos = [discover({**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    procs = [ctx.Process(target=_init_and_reduce, args=(info, out)) for info in infos]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0]
        results = sorted(out.get() for _ in procs)
        assert results == [(0, "gloo", 3.0), (1, "gloo", 3.0)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def test_init_distributed_refuses_a_second_init() -> None:
    info = discover({})
    init_distributed(info, "cpu", timeout=10.0)
    try:
        assert dist.get_world_size() == 1
        with pytest.raises(RuntimeError, match="already initialized"):
            init_distributed(info, "cpu")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "2", "WORLD_SIZE": "2"},
         "rank 2 is outside [0, 2) (from RANK='2', WORLD_SIZE='2')"),
        ({**TORCHRUN, "LOCAL_RANK": "4"},
         "local rank 4 is outside [0, 4) (from LOCAL_RANK='4', LOCAL_WORLD_SIZE='4')"),
        ({**TORCHRUN, "MASTER_PORT": "70000"},
         "master port 70000 is invalid for world size 16 (1-65535; 0 means 'any' and is "
         "allowed only for a single process) (from MASTER_PORT='70000', WORLD_SIZE='16')"),
        ({**TORCHRUN, "MASTER_ADDR": ""}, "master address is empty (from MASTER_ADDR='')"),
        ({**OPEN_MPI, "OMPI_COMM_WORLD_RANK": "8"},
         "rank 8 is outside [0, 8) (from OMPI_COMM_WORLD_RANK='8', OMPI_COMM_WORLD_SIZE='8')"),
        ({**SLURM, "SLURM_LOCALID": "5"},
         "local rank 5 is outside [0, 4) (from SLURM_LOCALID='5', SLURM_TASKS_PER_NODE='4(x2)')"),
        ({**SLURM, "SLURM_JOB_NODELIST": "node[1-"},
         "SLURM_JOB_NODELIST: unclosed '[' in node list 'node[1-'"),
        ({**SLURM, "SLURM_JOB_NODELIST": "n[1-99999999999999999999]"},
         "SLURM_JOB_NODELIST: [1-99999999999999999999] names more than 1,048,576 hosts in "
         "node list 'n[1-99999999999999999999]'"),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "2(x1000000000)"},
         "SLURM_TASKS_PER_NODE: tasks-per-node list '2(x1000000000)' names more than "
         "1,048,576 nodes"),
        ({"RANK": "0"}, "RANK='0' is set but WORLD_SIZE is not: a launcher (torchrun, "
         "deepspeed) sets both; unset it to run alone"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE='2' is set but RANK is not: a launcher (torchrun, "
         "deepspeed) sets both; unset it to run alone"),
        ({**TORCHRUN, "MASTER_PORT": "1_000"}, "MASTER_PORT='1_000' is not an integer"),
        ({**TORCHRUN, "RANK": "\u0663"}, "RANK='\u0663' is not an integer"),
    ],
)
def test_hostile_launcher_variables_are_named(env: dict[str, str], message: str) -> None:
    """Out-of-range, malformed (a 10**20-host node list must not hang, a 10**9-node task list
    must not fill the memory) or half-set launcher variables: one error naming them."""
    with pytest.raises(LaunchError) as caught:
        discover(env, use_mpi4py=False)
    assert str(caught.value) == message


def test_mpi4py_without_an_mpi_library_reads_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """mpi4py installed without an MPI library it can load raises RuntimeError on import:
    the job is read from the launcher's variables, as without mpi4py."""
    import sys
    import types

    fake = types.ModuleType("mpi4py")

    def no_library(name: str) -> object:
        raise RuntimeError("cannot load MPI library")

    fake.__getattr__ = no_library  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "mpi4py", fake)
    assert discover(MPICH) == LaunchInfo(1, 2, 1, 2, "127.0.0.1", 29500, "mpi")


def test_rendezvous_failures_are_one_line() -> None:
    """An address that does not resolve and a port in use: bad input; a peer that never
    comes: a failed run. Each one line, no traceback."""
    from mt_dist.exits import exit_code
    from mt_dist.launcher import RendezvousFailed

    info = LaunchInfo(1, 2, 1, 2, "no.such.host.invalid", 29500, "torchrun")
    with pytest.raises(LaunchError, match=r"^master address 'no.such.host.invalid' \(MASTER_ADDR, "
                       r"or the launcher's first host\) does not resolve: "):
        init_distributed(info, "cpu", timeout=2.0)
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(LaunchError) as caught:
            init_distributed(LaunchInfo(0, 2, 0, 2, "127.0.0.1", port, "torchrun"), "cpu",
                             timeout=2.0)
    assert str(caught.value) == (f"rank 0 of 2 cannot host the rendezvous at 127.0.0.1:{port} "
                                 "(MASTER_PORT): the port is in use; choose another")
    with pytest.raises(RendezvousFailed) as failed:
        init_distributed(LaunchInfo(0, 2, 0, 2, "127.0.0.1", free_port(), "slurm"), "cpu",
                         timeout=1.0)
    text = str(failed.value)
    assert "\n" not in text and exit_code(failed.value) == 1
    assert text.startswith("rank 0 of 2 (slurm) did not meet its peers at 127.0.0.1:")
    assert "within the timeout of 1 s: " in text and "1/2 clients joined" in text
    assert not dist.is_initialized()


def test_a_rank_whose_store_never_answers_fails_in_one_line_alone(capfd: Any) -> None:
    """Rank 1 of 2, with nothing listening at the rendezvous address: one line naming the
    address and the refusal, within the timeout and a try, and nothing else on stderr (torch's
    store client logs each failed connection with its C++ stack trace)."""
    import time

    from mt_dist.launcher import RendezvousFailed

    port = free_port()
    start = time.monotonic()
    with pytest.raises(RendezvousFailed) as failed:
        init_distributed(LaunchInfo(1, 2, 1, 2, "127.0.0.1", port, "torchrun"), "cpu",
                         timeout=2.0)
    assert time.monotonic() - start < 4.0
    assert str(failed.value) == (
        f"rank 1 of 2 (torchrun) did not meet its peers at 127.0.0.1:{port} (MASTER_ADDR:"
        "MASTER_PORT) within the timeout of 2 s: no rendezvous store accepted a connection "
        "(Connection refused); start every rank with the same MASTER_ADDR and MASTER_PORT, "
        "reachable from every node")
    assert capfd.readouterr().err == ""
    assert not dist.is_initialized()


def test_a_lost_peer_is_one_line() -> None:
    from mt_dist.launcher import lost_peer

    info = LaunchInfo(0, 2, 0, 2, "127.0.0.1", 29500, "torchrun")
    gloo = RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read "
                        "error [127.0.0.1]:33493: Connection reset by peer. This is typically "
                        "caused by a remote worker hanging")
    assert str(lost_peer(gloo, info)) == (
        "rank 0 of 2 (torchrun) lost its peers mid-run: Read error [127.0.0.1]:33493: "
        "Connection reset by peer; another rank stopped, hung or lost its connection: its own "
        "log says why")
    assert lost_peer(RuntimeError("shape mismatch"), info) is None
    assert lost_peer(ValueError("Connection reset by peer"), info) is None
