"""Fetching another executor's offered blocks (KvTransfer.FetchBlocks), on the event loop.

The executor calls its peers with its own credentials: its token under the same metadata key a
scheduler uses, and under mutual TLS a client certificate (--tls-peer-cert, else its server
certificate), checked against its client CA (the CA that signs the executors' certificates in a
deployment of one CA). Chunks are only checked and kept here; the worker thread writes them
(kv_moves.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from protos.executor_access import EXECUTOR_TOKEN_METADATA
from protos.limits import MAX_MESSAGE_BYTES
from protos.splitserve.executor.v1 import executor_pb2, executor_pb2_grpc
from service_support.transport_security import (
    ClientTls,
    ServerTls,
    aio_channel,
    allows_client_auth,
)

logger = logging.getLogger(__name__)

# A fetch that has not finished in this long is failed (the scheduler recomputes instead): a
# source that accepts the call and then stalls must not hold the destination's blocks forever.
FETCH_DEADLINE_S = 120.0


def peer_tls(
    server: ServerTls | None,
    cert_pem: bytes | None = None,
    key_pem: bytes | None = None,
    server_name: str | None = None,
) -> ClientTls | None:
    """How this executor calls its peers, from how it serves: plaintext without TLS; under mutual
    TLS the peer certificate and key when given, else its own server certificate, trusting its
    client CA; under server-only TLS, trusting the system's roots (it holds no CA of its own
    then). server_name: what a source's certificate must name when it is dialled by IP."""
    if server is None:
        return None
    if not server.mutual:
        return ClientTls(server_name=server_name)
    if cert_pem is None:
        cert_pem, key_pem = server.cert_pem, server.key_pem
    return ClientTls(server.client_ca_pem, cert_pem, key_pem, server_name)


def peer_certificate_problem(server: ServerTls | None, peer: ClientTls | None) -> str | None:
    """Why other executors will refuse this one's K/V fetches at the handshake (so every move
    is recomputed), or None: under mutual TLS, a client certificate whose ExtendedKeyUsage
    leaves out clientAuth, as make_certs' serverAuth-only executor.pem does. Where that cannot
    be told (no cryptography package), only the fallback to the server certificate is named."""
    if server is None or not server.mutual or peer is None or peer.cert_pem is None:
        return None
    allowed = allows_client_auth(peer.cert_pem)
    if peer.cert_pem != server.cert_pem:
        if allowed is False:
            return "the --tls-peer-cert certificate does not allow clientAuth, so peers refuse it"
        return None
    if allowed is True:
        return None
    why = (
        "does not allow clientAuth"
        if allowed is False
        else "may not allow clientAuth (unchecked: no cryptography package)"
    )
    return (
        f"no --tls-peer-cert: K/V fetches present this executor's server certificate, which {why}; "
        "peers then refuse them and every move is recomputed. Give --tls-peer-cert/--tls-peer-key "
        "(deploy/make_certs.py's executor-peer.pem)"
    )


class FetchFailed(Exception):
    """Why an import's blocks cannot be written (the message goes to KvImportResult.error)."""


@dataclass(slots=True)
class FetchedBlocks:
    """An import's K/V, checked and complete: for each chunk, the destination blocks and their
    bytes; and the recurrent state the offer's last chunk carried (empty: none). num_bytes counts
    both."""

    chunks: list[tuple[list[int], bytes]] = field(default_factory=list)
    num_bytes: int = 0
    state: bytes = b""


class KvFetcher:
    """kv_layout, block_bytes: this executor's, which every chunk must match. received: called
    with the size of each chunk as it comes (metrics)."""

    def __init__(
        self,
        kv_layout: str,
        block_bytes: int,
        token: str | None,
        tls: ClientTls | None,
        received: Callable[[int], None],
    ) -> None:
        self._layout = kv_layout
        self._block_bytes = block_bytes
        self._metadata = ((EXECUTOR_TOKEN_METADATA, token),) if token else ()
        self._tls = tls
        self._received = received
        # One channel per source: an executor moves many requests from the same few peers.
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> executor_pb2_grpc.KvTransferStub:
        channel = self._channels.get(address)
        if channel is None:
            # Keepalive as on the plan stream: a source that froze or is cut off fails the fetch
            # in about 20 s rather than at the fetch deadline.
            options = [
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_timeout_ms", 10_000),
                ("grpc.http2.ping_timeout_ms", 10_000),
            ]
            channel = self._channels[address] = aio_channel(address, options, self._tls)
        return executor_pb2_grpc.KvTransferStub(channel)

    async def fetch(self, entry: executor_pb2.KvImport) -> FetchedBlocks:
        """The offer's blocks from entry.first_block on, one per entry.block_ids; FetchFailed when
        the source cannot give exactly those, in this executor's layout."""
        request = executor_pb2.FetchBlocksRequest(transfer_id=entry.transfer_id, first_block=entry.first_block)
        call = self._stub(entry.source_address).FetchBlocks(
            request, metadata=self._metadata, timeout=FETCH_DEADLINE_S
        )
        fetched = FetchedBlocks()
        destinations = list(entry.block_ids)
        done = 0
        try:
            async for chunk in call:
                self._received(len(chunk.data) + len(chunk.state))
                problem = (
                    "a chunk after the one with the offer's recurrent state" if fetched.state
                    else self._chunk_problem(chunk, entry.first_block + done, len(destinations) - done)
                )
                if problem is not None:
                    raise FetchFailed(f"from {entry.source_address}: {problem}")
                if chunk.num_blocks:
                    fetched.chunks.append((destinations[done : done + chunk.num_blocks], chunk.data))
                fetched.state = chunk.state
                fetched.num_bytes += len(chunk.data) + len(chunk.state)
                done += chunk.num_blocks
        except grpc.aio.AioRpcError as error:
            raise FetchFailed(f"from {entry.source_address}: {error.code().name}: {error.details()}") from None
        finally:
            # Ends the stream on an early exit (a bad chunk, or the import cancelled).
            call.cancel()
        if done != len(destinations):
            raise FetchFailed(
                f"from {entry.source_address}: the offer has {done} blocks from position "
                f"{entry.first_block}, the import names {len(destinations)}"
            )
        return fetched

    def _chunk_problem(self, chunk: executor_pb2.KvBlockChunk, position: int, room: int) -> str | None:
        if chunk.kv_layout != self._layout:
            return f"its kv_layout {chunk.kv_layout!r} is not this executor's {self._layout!r}"
        if chunk.first_block != position:
            return f"a chunk starts at offer position {chunk.first_block}, expected {position}"
        # Only the chunk of the state, the offer's last, may hold no block.
        if (chunk.num_blocks == 0 and not chunk.state) or chunk.num_blocks > room:
            return f"a chunk of {chunk.num_blocks} blocks where {room} more are expected"
        if chunk.state and chunk.num_blocks != room:
            return f"the offer's recurrent state came with {room - chunk.num_blocks} of its blocks still to come"
        if len(chunk.data) != chunk.num_blocks * self._block_bytes:
            return f"a chunk of {chunk.num_blocks} blocks carries {len(chunk.data)} bytes, not {chunk.num_blocks * self._block_bytes}"
        return None

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
