"""Who is on the other end of a loopback TCP connection (Linux), told exactly.

The kernel lists every TCP socket in /proc/net/tcp and tcp6 with its owner. A connection to llmd
shows twice there: llmd's own socket (local = the server) and the client's (local = the client,
remote = the server). Only the client's row, matched on the whole 4-tuple, in state ESTABLISHED,
with a live inode, names the client's user:
- another user's socket can share the client's local port when its remote end differs (Linux
  lets two connected sockets share an ephemeral port), so the remote end must match too;
- a client that closed after sending leaves an orphaned FIN_WAIT/TIME_WAIT row that the kernel
  prints with uid 0 and inode 0: it names nobody.

Standard library only: a test loads this file alone under another user's Python.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
ESTABLISHED = "01"
Address = tuple[str, int]


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(text)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _hex_address(field: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """/proc/net/tcp's 'ADDR:PORT': the address in 32-bit little-endian words, the port in hex."""
    addr, _, port = field.partition(":")
    raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, len(addr), 8))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped, int(port, 16)
    return ip, int(port, 16)


def _read_tables() -> list[str]:
    texts = []
    for table in TABLES:
        try:
            texts.append(Path(table).read_text())
        except OSError:
            continue
    return texts


def peer_uid(client: Address | None, server: Address | None, tables: Iterable[str] | None = None) -> int | None:
    """The uid owning the client's end of the connection client -> server, or None when it cannot
    be told exactly: no such row, more than one, not ESTABLISHED, or no inode (an orphaned socket).
    `tables` are the texts of /proc/net/tcp and tcp6 (read now when not given)."""
    if client is None or server is None or server[1] is None:
        return None
    try:
        want = ((_ip(client[0]), int(client[1])), (_ip(server[0]), int(server[1])))
    except ValueError:
        return None
    texts = _read_tables() if tables is None else list(tables)
    found: list[int] = []
    # rows are parsed only where the client's port appears: a full socket table is tens of
    # thousands of rows, read on every refused control request
    port = f":{want[0][1]:04X} "
    for text in texts:
        for line in text.splitlines()[1:]:
            if port not in line:
                continue
            f = line.split()
            if len(f) < 10:
                continue
            try:
                if (_hex_address(f[1]), _hex_address(f[2])) != want:
                    continue
            except ValueError:
                continue
            if f[3] != ESTABLISHED or f[9] == "0":
                return None  # the client's own row, closing or orphaned: it names no one
            found.append(int(f[7]))
    return found[0] if len(found) == 1 else None


def same_user(client: Address | None, server: Address | None, tables: Iterable[str] | None = None) -> bool:
    """True when the client's socket belongs to the user this process runs as, and that user is not
    root (uid 0 is also what the kernel prints for sockets no process owns any more)."""
    if not hasattr(os, "getuid"):
        return False
    uid = peer_uid(client, server, tables)
    return uid is not None and uid != 0 and uid == os.getuid()
