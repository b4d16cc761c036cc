"""A pooled keep-alive connection the backend closed while it was idle: the next request's write fails
("Can not write request body"), nothing reached the backend, and the proxy sends it again on a new
connection instead of failing the client with a 502."""

import asyncio
import errno

import aiohttp

from kvoffload_proxy import upstream
from kvoffload_proxy.balancer import Balancer
from kvoffload_proxy.config import parse_args

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def _server(requests: list[int]) -> asyncio.AbstractServer:
    """Answers each connection's first request, keeping it open (keep-alive); the next request on it
    finds the server closing it (as one whose idle timeout ends at that moment): its head read, then
    the connection reset under the client's write of the body."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
        await reader.readexactly(length)
        requests.append(length)
        writer.write(ANSWER)
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # the next request's head: closed under its body
        writer.transport.abort()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def test_a_request_whose_write_fails_on_a_closed_pooled_connection_is_sent_again():
    requests: list[int] = []
    server = await _server(requests)
    port = server.sockets[0].getsockname()[1]
    hosts = ["--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(port)]
    cfg = parse_args([*hosts, "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(port)])
    balancer = Balancer(cfg.decoders)
    big = {"prompt": "x" * 4_000_000}  # larger than the socket buffers: the write itself fails
    async with server, aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for _ in range(2):
            lease, resp = await upstream.post(session, balancer, cfg, "/v1/completions", big, headers={}, num_tokens=1)
            assert resp.status == 200 and await resp.json() == {}
            resp.release()
            lease.release()
    assert len(requests) == 2  # each request reached the backend once


def test_only_a_failed_connect_or_write_counts_as_undelivered():
    assert upstream.undelivered(aiohttp.ClientOSError(None, "Can not write request body for http://x/v1"))
    assert upstream.undelivered(aiohttp.ClientOSError(errno.ECONNRESET, "Connection reset by peer"))
    assert not upstream.undelivered(aiohttp.ServerDisconnectedError())  # it may have read the request
    assert not upstream.undelivered(aiohttp.ClientOSError(errno.ETIMEDOUT, "timed out"))
