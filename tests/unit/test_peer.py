"""peer_uid on rows recorded from /proc/net/tcp and tcp6 (Linux 6.x), uids edited to tell users apart.

The connection under test: a client at 127.0.0.1:53398 (0xD096) to a server at 127.0.0.1:57111
(0xDF17); over IPv6, [::1]:38414 (0x960E) to [::1]:48403 (0xBD13)."""

import pytest

from llmd.daemon import peer
from llmd.daemon.peer import peer_uid, same_user

HEADER = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n")
LISTEN = "   1: 0100007F:DF17 00000000:0000 0A 00000000:00000000 00:00000000 00000000  4242        0 11413 1 0 100 0 0 10 0\n"
SERVER_SIDE = ("   2: 0100007F:DF17 0100007F:D096 01 00000000:00000000 00:00000000 00000000  4242        0 11415 1 0 20 0 0"
               " 10 -1\n")
CLIENT = "   6: 0100007F:D096 0100007F:DF17 01 00000000:00000000 00:00000000 00000000  1000        0 11414 2 0 20 0 0 10 -1\n"
# another user's socket on the same local port, connected elsewhere (127.0.0.1:8080): Linux shares
# an ephemeral port between sockets whose 4-tuples differ
SHARED_PORT = ("   4: 0100007F:D096 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  1001        0 12001 1 0 20 0 0"
               " 10 -1\n")
# the client sent and closed: FIN_WAIT2, orphaned, printed with uid 0 and inode 0
CLOSED = "   7: 0100007F:D096 0100007F:DF17 05 00000000:00000000 03:0000175F 00000000     0        0 0 3 0\n"
TIME_WAIT = "   8: 0100007F:D096 0100007F:DF17 06 00000000:00000000 03:0000175F 00000000     0        0 0 3 0\n"

CLIENT_ADDR, SERVER_ADDR = ("127.0.0.1", 0xD096), ("127.0.0.1", 0xDF17)

HEADER6 = ("  sl  local_address                         remote_address                        st tx_queue rx_queue tr "
           "tm->when retrnsmt   uid  timeout inode\n")
CLIENT6 = ("   1: 00000000000000000000000001000000:960E 00000000000000000000000001000000:BD13 01 00000000:00000000 "
           "00:00000000 00000000  1000        0 11417 2 0 20 0 0 10 -1\n")
SERVER6 = ("   2: 00000000000000000000000001000000:BD13 00000000000000000000000001000000:960E 01 00000000:00000000 "
           "00:00000000 00000000  4242        0 11418 1 0 20 0 0 10 -1\n")
# an IPv4 client seen by a dual-stack (IPv6) server socket: ::ffff:127.0.0.1
MAPPED = ("   3: 0000000000000000FFFF00000100007F:D096 0000000000000000FFFF00000100007F:DF17 01 00000000:00000000 "
          "00:00000000 00000000  1000        0 11500 2 0 20 0 0 10 -1\n")


def test_the_clients_own_row_names_its_user():
    assert peer_uid(CLIENT_ADDR, SERVER_ADDR, [HEADER + LISTEN + SERVER_SIDE + CLIENT, HEADER6]) == 1000


def test_another_users_socket_on_the_same_local_port_is_not_the_client():
    # the old rule took the first row whose local address matched: this one, uid 1001
    assert peer_uid(CLIENT_ADDR, SERVER_ADDR, [HEADER + SHARED_PORT + CLIENT]) == 1000
    assert peer_uid(CLIENT_ADDR, SERVER_ADDR, [HEADER + SHARED_PORT + SERVER_SIDE]) is None


@pytest.mark.parametrize("row", [CLOSED, TIME_WAIT])
def test_a_closed_or_orphaned_socket_names_no_one(row: str):
    assert peer_uid(CLIENT_ADDR, SERVER_ADDR, [HEADER + SERVER_SIDE + row]) is None


def test_two_rows_for_one_connection_name_no_one():
    twin = CLIENT.replace(" 1000 ", " 1001 ").replace("11414", "11499")
    assert peer_uid(CLIENT_ADDR, SERVER_ADDR, [HEADER + CLIENT + twin]) is None


def test_ipv6_loopback_and_ipv4_mapped_rows():
    assert peer_uid(("::1", 0x960E), ("::1", 0xBD13), [HEADER, HEADER6 + SERVER6 + CLIENT6]) == 1000
    assert peer_uid(("::ffff:127.0.0.1", 0xD096), ("::ffff:127.0.0.1", 0xDF17), [HEADER6 + MAPPED]) == 1000
    assert peer_uid(CLIENT_ADDR, SERVER_ADDR, [HEADER6 + MAPPED]) == 1000


def test_nothing_to_match_against():
    assert peer_uid(None, SERVER_ADDR, [HEADER + CLIENT]) is None
    assert peer_uid(CLIENT_ADDR, None, [HEADER + CLIENT]) is None
    assert peer_uid(("not an address", 1), SERVER_ADDR, [HEADER + CLIENT]) is None


def test_same_user_is_never_root(monkeypatch: pytest.MonkeyPatch):
    root = CLIENT.replace(" 1000 ", "    0 ")
    monkeypatch.setattr(peer.os, "getuid", lambda: 0)
    assert peer_uid(CLIENT_ADDR, SERVER_ADDR, [HEADER + root]) == 0
    assert not same_user(CLIENT_ADDR, SERVER_ADDR, [HEADER + root])
    monkeypatch.setattr(peer.os, "getuid", lambda: 1000)
    assert same_user(CLIENT_ADDR, SERVER_ADDR, [HEADER + CLIENT])
    assert not same_user(CLIENT_ADDR, SERVER_ADDR, [HEADER + SHARED_PORT + CLOSED])


def test_authorize_takes_the_token_or_the_same_user_and_ignores_other_keys(monkeypatch: pytest.MonkeyPatch):
    import asyncio

    from starlette.requests import Request

    from llmd.daemon import security
    from llmd.errors import Unauthorized

    def request(headers: dict[str, str]) -> Request:
        return Request({"type": "http", "method": "POST", "path": "/api/pull", "client": CLIENT_ADDR,
                        "server": SERVER_ADDR, "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]})

    token = "t" * 43
    monkeypatch.setattr(security, "same_user", lambda client, server: (client, server) == (CLIENT_ADDR, SERVER_ADDR))
    asyncio.run(security.authorize(request({}), token))
    asyncio.run(security.authorize(request({"Authorization": "Bearer some-ollama-key"}), token))  # another key: still this user
    asyncio.run(security.authorize(request({"Authorization": f"Bearer {token}"}), token, reads_local_files=True))
    with pytest.raises(Unauthorized, match="file or an environment variable"):
        asyncio.run(security.authorize(request({}), token, reads_local_files=True))
    with pytest.raises(Unauthorized, match="token"):
        asyncio.run(security.authorize(request({"Origin": "http://127.0.0.1:8080"}), token))
    monkeypatch.setattr(security, "same_user", lambda client, server: False)
    with pytest.raises(Unauthorized):
        asyncio.run(security.authorize(request({"Authorization": "Bearer some-ollama-key"}), token))
