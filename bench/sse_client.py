"""A lean HTTP/1.1 client for streamed completions: what `serve_load` times the server with.

The benchmark's clients share the machine's cores with the server, so their own per-chunk work
is taken from the server. This client does the least per chunk during a stream: it reads one
chunk of the chunked body and notes its arrival time (no header objects, no line decoding, no
JSON). The events are split and parsed after the stream ended, each with the arrival time of
the chunk that completed it, so TTFT and every inter-chunk gap are still measured per chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field


@dataclass
class RawStream:
    """One response: its status and the body's chunks with their arrival times."""

    status: int
    sent_s: float  # when the request was written
    chunks: list[tuple[float, bytes]] = field(default_factory=list)

    def events(self) -> list[tuple[float, dict]]:
        """The `data:` events (JSON, `[DONE]` left out), each with its arrival time."""
        out: list[tuple[float, dict]] = []
        buf = b""
        for at_s, data in self.chunks:
            buf += data
            *done, buf = buf.split(b"\n\n")
            for event in done:
                if event.startswith(b"data: ") and event != b"data: [DONE]":
                    out.append((at_s, json.loads(event[6:])))
        return out


class Connection:
    """A keep-alive connection to host:port that posts JSON and reads streamed answers."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._reader is None or self._writer is None or self._reader.at_eof():
            await self.close()
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        return self._reader, self._writer

    async def post(self, path: str, body: dict) -> RawStream:
        """POST `body` as JSON; read the whole (chunked or sized) response."""
        payload = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
        sent_s = time.perf_counter()  # connecting (rarely: keep-alive) counts, as for httpx
        reader, writer = await self._open()
        writer.write(head.encode() + payload)
        header = await reader.readuntil(b"\r\n\r\n")
        lines = header.decode("latin-1").split("\r\n")
        out = RawStream(int(lines[0].split()[1]), sent_s)
        pairs = (ln.partition(":") for ln in lines[1:])
        fields = {k.strip().lower(): v.strip() for k, _, v in pairs}
        if "content-length" in fields:
            data = await reader.readexactly(int(fields["content-length"]))
            out.chunks.append((time.perf_counter(), data))
        else:  # chunked: size line, data, CRLF; a zero size ends the body
            while (size := int(await reader.readuntil(b"\r\n"), 16)) > 0:
                data = await reader.readexactly(size + 2)
                out.chunks.append((time.perf_counter(), data[:-2]))
            await reader.readuntil(b"\r\n")
        if fields.get("connection", "").lower() == "close":
            await self.close()
        return out

    async def close(self) -> None:
        """Close the socket (the next post opens a new one)."""
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()
        self._reader = self._writer = None
