"""Channels to one address share one connection unless each asks for its own: the load test's simulated
workers, a thousand in a process, connect as that many pods would (tests/scale/load_workers.py)."""

from __future__ import annotations

import json

import grpc
import pytest
from grpc._cython import cygrpc

from edl_argo.rpc.channel import make_channel, make_server

pytestmark = pytest.mark.timeout(60)


def _server_ids() -> set[int]:
    return {
        int(server["ref"]["serverId"])
        for server in json.loads(cygrpc.channelz_get_servers(0)).get("server", [])
    }


@pytest.mark.parametrize(("own_connection", "connections"), [(False, 1), (True, 5)])
def test_channels_share_a_connection_unless_each_has_its_own(own_connection: bool, connections: int) -> None:
    others = _server_ids()
    server = make_server()
    echo = grpc.unary_unary_rpc_method_handler(lambda request, _context: request)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", {"M": echo}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    (server_id,) = _server_ids() - others
    channels = [make_channel(f"127.0.0.1:{port}", None, own_connection=own_connection) for _ in range(5)]
    try:
        for channel in channels:
            assert channel.unary_unary("/t.S/M")(b"x", timeout=10) == b"x"
        sockets = json.loads(cygrpc.channelz_get_server_sockets(server_id, 0, 0)).get("socketRef", [])
        assert len(sockets) == connections
    finally:
        for channel in channels:
            channel.close()
        server.stop(None)
