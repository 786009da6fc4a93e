"""The same-user rule with real users: llmd.daemon.peer, loaded alone under the system Python,
serves as user A; clients connect as A, as root and as user C. CI runs as root, which creates the
two users (and removes them after)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import llmd.daemon.peer

SYSTEM_PYTHON = "/usr/bin/python3"  # readable by any user (the test's own Python may sit in /root)
USERS = ("llmd-peer-a", "llmd-peer-c")

# user A's server: prints each connection's label and what peer.py says of it
SERVER = r"""
import importlib.util, json, socket, sys, time
spec = importlib.util.spec_from_file_location("peer", sys.argv[1])
peer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer)
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(16)
other = socket.socket(); other.bind(("127.0.0.1", 0)); other.listen(16)  # another service A's clients use
print(json.dumps({"port": srv.getsockname()[1], "other": other.getsockname()[1]}), flush=True)
while True:
    conn, client = srv.accept()
    label = conn.recv(100).decode().strip()
    time.sleep(0.3)  # a client that closed after sending has closed by now
    print(json.dumps({"label": label, "uid": peer.peer_uid(client, conn.getsockname()),
                      "same": peer.same_user(client, conn.getsockname())}), flush=True)
    conn.close()
"""

# a client: connect (from a given local port, with SO_REUSEADDR, when asked), send a label, then
# close at once or hold the connection open
CLIENT = r"""
import socket, sys, time
port, label, mode, local = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", local))
s.connect(("127.0.0.1", port))
print(s.getsockname()[1], flush=True)
s.sendall(label.encode() + b"\n")
if mode == "close":
    s.close()
else:
    time.sleep(float(mode))
"""


@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, int]]:
    if os.getuid() != 0 or not shutil.which("useradd"):
        if os.environ.get("CI"):
            pytest.fail("CI runs as root: this test creates two users and must run")
        pytest.skip("needs root to create two users")
    made = []
    for name in USERS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
            made.append(name)
    try:
        yield {name: pwd.getpwnam(name).pw_uid for name in USERS}
    finally:
        for name in made:
            subprocess.run(["userdel", name], check=False)


def _as(uid: int | None, folder: Path, script: str, *args: str) -> subprocess.Popen[str]:
    kw = {} if uid is None else {"user": uid, "group": pwd.getpwuid(uid).pw_gid, "extra_groups": []}
    python = SYSTEM_PYTHON if uid is not None else sys.executable
    return subprocess.Popen([python, str(folder / script), *args], cwd=folder, stdout=subprocess.PIPE, text=True,
                            env={"PATH": "/usr/bin:/bin"}, **kw)  # type: ignore[call-overload]


def test_only_the_same_non_root_user_on_the_exact_connection(users: dict[str, int]):
    a, c = users["llmd-peer-a"], users["llmd-peer-c"]
    folder = Path(tempfile.mkdtemp(prefix="llmd-peer-"))
    folder.chmod(0o755)
    shutil.copy(llmd.daemon.peer.__file__, folder / "peer.py")
    (folder / "server.py").write_text(SERVER)
    (folder / "client.py").write_text(CLIENT)
    for f in folder.iterdir():
        f.chmod(0o644)
    server = _as(a, folder, "server.py", str(folder / "peer.py"))
    held: list[subprocess.Popen[str]] = []
    try:
        assert server.stdout is not None
        ports = json.loads(server.stdout.readline())
        port = str(ports["port"])

        def connect(uid: int | None, label: str, mode: str = "1", local: int = 0) -> int:
            p = _as(uid, folder, "client.py", port if label else str(ports["other"]), label or "db", mode, str(local))
            assert p.stdout is not None
            used = int(p.stdout.readline())
            held.append(p)
            return used

        def verdict() -> dict[str, object]:
            assert server.stdout is not None
            return json.loads(server.stdout.readline())

        connect(a, "a")
        assert verdict() == {"label": "a", "uid": a, "same": True}
        connect(None, "root")
        assert verdict() == {"label": "root", "uid": 0, "same": False}
        connect(c, "c")
        assert verdict() == {"label": "c", "uid": c, "same": False}
        connect(a, "a-closed", mode="close")  # sent, then closed: an orphaned socket is no one
        assert verdict() == {"label": "a-closed", "uid": None, "same": False}
        # user A holds a connection to another service from port P; user C connects to A's server
        # from the same port P (Linux allows it: the two 4-tuples differ). Matching on the local port
        # alone could take A's row for C's connection.
        shared = connect(a, "", mode="20")
        connect(c, "c-shared", local=shared)
        assert verdict() == {"label": "c-shared", "uid": c, "same": False}
    finally:
        for p in [server, *held]:
            p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
        shutil.rmtree(folder, ignore_errors=True)
