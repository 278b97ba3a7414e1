"""Admin HTTP against slow clients: headers and bodies have a deadline (a real server).

Before, aiohttp's defaults let a connection that never finished its headers stay open for an
hour, and a ``POST /json`` whose body never came held its handler for ever.
"""

import socket

import pytest

from servers import ROOT, ServerProcess

pytestmark = pytest.mark.process

SAFETY = 30.0  # a bound on each read here, far above the 1 s the server is given


def _serve() -> ServerProcess:
    return ServerProcess(["--config", str(ROOT / "descriptors"), "--admin-timeout", "1"])


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(SAFETY)
    chunks = []
    while chunk := sock.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks)


class TestAdminTimeouts:
    def test_headers_never_finished_close_the_connection(self) -> None:
        """Half a request line and headers, then silence: the server hangs up."""
        server = _serve()
        try:
            with socket.create_connection(("127.0.0.1", server.admin_port)) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
                reply = _read_all(sock)
            alive = server.process.poll() is None
        finally:
            server.stop()
        assert reply == b"" and alive

    def test_a_body_that_never_comes_is_408(self) -> None:
        """POST /json announcing 100 bytes and sending 10: 408, nothing charged."""
        server = _serve()
        try:
            with socket.create_connection(("127.0.0.1", server.admin_port)) as sock:
                sock.sendall(b"POST /json HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                             b"Content-Type: application/json\r\n\r\n{\"domain\"")  # fmt: skip
                reply = _read_all(sock)
        finally:
            server.stop()
        assert reply.startswith(b"HTTP/1.1 408")
        assert b"request body too slow" in reply

    def test_a_prompt_request_is_answered(self) -> None:
        """A whole request sent at once is answered as ever."""
        server = _serve()
        try:
            with socket.create_connection(("127.0.0.1", server.admin_port)) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                reply = _read_all(sock)
        finally:
            server.stop()
        assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"ok\n")

    def test_slow_requests_cannot_take_the_probes_down(self) -> None:
        """16 POST /json whose bodies trickle in hold the admin port's budget: a 17th
        request gets 503 at once, while /healthz and /readyz are still answered."""
        server = ServerProcess(["--config", str(ROOT / "descriptors"), "--admin-timeout", "20"])
        held: list[socket.socket] = []
        try:
            for _ in range(16):
                sock = socket.create_connection(("127.0.0.1", server.admin_port))
                held.append(sock)
                sock.sendall(b"POST /json HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                             b"Content-Type: application/json\r\n\r\n{")  # fmt: skip
            replies = {}
            for path in ("/metrics", "/healthz", "/readyz"):
                with socket.create_connection(("127.0.0.1", server.admin_port)) as sock:
                    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                                 .encode())  # fmt: skip
                    replies[path] = _read_all(sock).split(b" ", 2)[1]
        finally:
            for sock in held:
                sock.close()
            server.stop()
        assert replies == {"/metrics": b"503", "/healthz": b"200", "/readyz": b"200"}
