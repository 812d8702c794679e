"""Join a ``jax.distributed`` job without the one-second reconnect stall.

A process that calls :func:`jax.distributed.initialize` before the coordinator process has
started its service fails its first connection, and gRPC waits its initial reconnect backoff
(one second) before trying again. When every process of a (replacement) job is launched at
once, that happens to about half the launches: the job's framework start-up is then about one
second longer, at random. Measured on this 2-core machine, two processes of a 2 x 4 job:
``initialize`` took 0.00-0.01 s in 3 of 6 launches and 0.90-0.99 s in the other 3; with the
non-coordinator processes waiting for the port first, 0.00-0.01 s in every launch.

:func:`join` is that wait plus the call. The harnesses (drill, benchmarks, receipt) and the
multi-process test jobs use it, so that their timings and run times do not carry the stall.
"""
from __future__ import annotations

import socket
import time

__all__ = ["join", "wait_for_port"]


def wait_for_port(host: str, port: int, timeout: float = 120.0) -> None:
    """Return once ``host:port`` accepts a TCP connection; :class:`TimeoutError` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f} s "
                                   "(the coordinator process of the jax.distributed job)") from None
            time.sleep(0.005)


def join(port: int, num_processes: int, process_id: int, *, host: str = "127.0.0.1",
         timeout: float = 120.0) -> None:
    """``jax.distributed.initialize`` for a job whose coordinator (process 0) serves on ``host:port``.

    Processes other than 0 first wait (polling every 5 ms) until the coordinator's service
    listens, so their first connection succeeds.
    """
    import jax

    if process_id != 0:
        wait_for_port(host, port, timeout)
    jax.distributed.initialize(coordinator_address=f"{host}:{port}", num_processes=num_processes,
                               process_id=process_id, initialization_timeout=int(timeout))
