"""ckptfmt_tools.jaxjoin.wait_for_port: returns once the coordinator's port listens, and not before."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from ckptfmt_tools.jaxjoin import wait_for_port


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_waits_until_the_port_listens() -> None:
    port = _free_port()
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later() -> None:
        time.sleep(0.3)
        srv.bind(("127.0.0.1", port))
        srv.listen()

    t = threading.Thread(target=listen_later)
    t0 = time.monotonic()
    t.start()
    try:
        wait_for_port("127.0.0.1", port, timeout=30)
        waited = time.monotonic() - t0
    finally:
        t.join()
        srv.close()
    assert waited >= 0.3  # it did not return before the listener existed


def test_nothing_listening_is_a_timeout() -> None:  # the control: no listener, no return
    with pytest.raises(TimeoutError, match="nothing listens"):
        wait_for_port("127.0.0.1", _free_port(), timeout=0.3)
