"""The listening socket: accepted connections must have Nagle off, or SSE chunks bunch up."""

from __future__ import annotations

import asyncio
import socket

from splitphase.server.launch import bind


class _Record(asyncio.Protocol):
    nodelay: list[int] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        self.nodelay.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        transport.close()


async def _accept_one() -> list[int]:
    sock = bind("127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Record, sock=sock)
    port = sock.getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(100):  # bounded wait for the accept
        if _Record.nodelay:
            break
        await asyncio.sleep(0.01)
    writer.close()
    server.close()
    await server.wait_closed()
    return _Record.nodelay


def test_accepted_connections_have_tcp_nodelay() -> None:
    # Without it a keep-alive client's delayed ACK held every chunk after the headers ~40 ms.
    assert asyncio.run(_accept_one()) == [1]
