"""Run a function on local gloo ranks (tests, the example, the bench): one process per rank.

    run_local(fn, world_size, *args, timeout=120.0)    # calls fn(rank, world_size, *args)

Ranks are fresh ``spawn`` processes, or, with ``preload``, forked from a fork server that
imported those modules once (torch's import and the first custom-op call cost seconds of CPU
per process otherwise). Each rank joins a gloo group on a free port of 127.0.0.1 (loopback only), runs with one torch
thread, and leaves the group when ``fn`` returns. A rank that raises, or a run that passes
``timeout`` seconds (a hang), ends every rank and raises here.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, port: int, threads: int, args: tuple) -> None:
    torch.set_num_threads(threads)
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_local(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, threads: int = 1,
              preload: Sequence[str] = ()) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes joined by gloo.

    Args:
        fn: a module-level function (it is pickled by name into the spawned processes).
        world_size: ranks.
        args: picklable arguments.
        timeout: seconds for the whole run; past it every rank is ended and TimeoutError raised.
        threads: torch threads per rank.
        preload: module names to import once in a fork server that then forks the ranks
            (``"forkserver"`` start method: each rank starts without importing torch again);
            empty: every rank is a fresh ``"spawn"`` process.

    Raises:
        TimeoutError: the run took longer than ``timeout`` (a hang).
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback included).
    """
    port = _free_port()
    start_method = "spawn"
    if preload:
        start_method = "forkserver"
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    processes = mp.start_processes(_rank_main, args=(fn, world_size, port, threads, args), nprocs=world_size,
                                   join=False, start_method=start_method)
    deadline = time.monotonic() + timeout
    try:
        while not processes.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"run_local: {world_size} ranks did not finish within {timeout} s")
    finally:
        for process in processes.processes:
            if process.is_alive():
                process.kill()
                process.join()
