"""An `hpcml` on PATH for shell scripts the tests run (the docs pages' commands), whose verbs that
run to their end are forked from this process's pre-imported server (tests/forked.py) instead of
starting a new interpreter that imports torch again.

The shim is a small Python program that imports no more than the standard library: it sends its
arguments, working folder, environment and its three standard descriptors to `ShimServer` over a
Unix socket, passes SIGINT/SIGTERM/SIGHUP/SIGUSR1 on to the forked command, and ends with its exit
code (or its signal). Any other verb (`serve`, `observe`: servers a page starts in the background
and stops by process group) runs `python -m hpcml` itself. Should the shim die (a page's time-out
kills its session), the server kills the forked command and what it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import struct
import sys
import tempfile
import threading
from multiprocessing import reduction
from pathlib import Path

from tests import forked

FORKED_VERBS = (
    "train", "plan", "data", "registry", "model", "report", "launch", "tune", "export", "profile",
)  # fmt: skip

SHIM = """#!{python} -S
import json, os, signal, socket, struct, sys
if len(sys.argv) < 2 or sys.argv[1] not in {verbs!r}:
    os.execv({python!r}, [{python!r}, "-m", "hpcml", *sys.argv[1:]])
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect({socket!r})
msg = json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode()
socket.send_fds(conn, [struct.pack("!I", len(msg)) + msg], [0, 1, 2])
def read_int():
    data = b""
    while len(data) < 4:
        more = conn.recv(4 - len(data))
        if not more:
            sys.exit(1)
        data += more
    return struct.unpack("!i", data)[0]
pid = read_int()
def forward(signum, frame):
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
    signal.signal(s, forward)
code = read_int()
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = conn.recv(n - len(data))
        if not more:
            raise ConnectionError("the shim went away")
        data += more
    return data


class ShimServer:
    """Serves the shim in `folder/bin/hpcml` from a thread of this process; `bin_dir` goes first
    on the script's PATH. One connection per command; several may run at once."""

    def __init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="hpcml-shim-")
        folder = Path(self._tmp.name)
        self.bin_dir = folder / "bin"
        self.bin_dir.mkdir()
        self._path = str(folder / "fork.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self._path)
        self._sock.listen(16)
        shim = self.bin_dir / "hpcml"
        shim.write_text(SHIM.format(python=sys.executable, verbs=FORKED_VERBS, socket=self._path))
        shim.chmod(0o755)
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
        self._tmp.cleanup()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            msg, fds, _, _ = socket.recv_fds(conn, 4, 3)
            if len(msg) < 4 or len(fds) != 3:
                return
            request = json.loads(_recv_exact(conn, struct.unpack("!I", msg)[0]))
            usage = tempfile.mktemp(prefix="hpcml-shim-usage-")
            stdio = tuple(reduction.DupFd(fd) for fd in fds)
            proc = forked.server_context().Process(
                target=forked._command,
                args=(request["argv"], request["cwd"], request["env"], stdio, usage),
            )
            proc.start()
            for fd in fds:
                os.close(fd)
            conn.sendall(struct.pack("!i", proc.pid))
            while True:
                ready, _, _ = select.select([proc.sentinel, conn], [], [])
                if proc.sentinel in ready:
                    break
                if not conn.recv(64):  # the shim died: end the command and what it started
                    forked.kill_tree(proc)
                    break
            proc.join()
            forked.add_cpu(usage)
            with contextlib.suppress(OSError):
                os.unlink(usage)
            with contextlib.suppress(OSError):
                conn.sendall(struct.pack("!i", proc.exitcode or 0))
