"""Direct mode's address check (pure)."""

from __future__ import annotations

import pytest

from shoal.tunnel.direct import DirectAddressError, direct_rpc_address, rpc_server_args


def test_lan_and_loopback_addresses_are_accepted() -> None:
    assert direct_rpc_address("192.168.1.20", 50052) == "192.168.1.20:50052"
    assert direct_rpc_address("127.0.0.1", 1) == "127.0.0.1:1"
    assert rpc_server_args("10.0.0.5", 50052, threads=1) == [
        *("-H", "10.0.0.5", "-p", "50052", "-t", "1")
    ]


@pytest.mark.parametrize(
    ("host", "port", "message"),
    [
        ("gpu-box.local", 50052, "not an IPv4 address"),  # ggml-rpc-server: inet_addr only
        ("::1", 50052, "not an IPv4 address"),
        ("0.0.0.0", 50052, "cannot be dialled"),
        ("224.0.0.1", 50052, "cannot be dialled"),
        ("10.0.0.5", 0, "out of range"),
        ("10.0.0.5", 65536, "out of range"),
    ],
)
def test_addresses_ggml_rpc_server_cannot_use_are_refused(
    host: str, port: int, message: str
) -> None:
    with pytest.raises(DirectAddressError, match=message):
        direct_rpc_address(host, port)
    with pytest.raises(DirectAddressError, match=message):
        rpc_server_args(host, port)
