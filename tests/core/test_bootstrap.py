"""Pure parts of connection setup: interface choice and which cable each stream takes."""
from __future__ import annotations

import pytest

from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.rendezvous.tcp import stream_routes
from torch_thunderbolt.transport.netif import network_of, resolve_ifnames

TABLE = {"lo": ["127.0.0.1"], "en0": ["192.168.1.5"], "en2": ["10.77.0.1"], "en3": ["10.77.0.5"]}


def test_ifname_entries_resolve_names_and_addresses_in_order() -> None:
    assert resolve_ifnames(("en3", "10.77.0.1"), TABLE) == ["10.77.0.5", "10.77.0.1"]


@pytest.mark.parametrize("entry, match", [("en9", "no interface named 'en9'"), ("10.1.1.1", "not assigned")])
def test_unknown_ifname_is_a_config_error_listing_what_exists(entry: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        resolve_ifnames((entry,), TABLE)
    assert "en2=10.77.0.1" in str(info.value)


def test_network_of_uses_the_interface_mask() -> None:
    assert network_of("10.77.0.5", {"10.77.0.5": "255.255.255.252"}) == "10.77.0.4/30"
    assert network_of("127.0.0.1", {}) == "127.0.0.0/8"


def test_two_cables_carry_alternate_streams() -> None:
    routes = stream_routes(["10.0.0.1", "10.0.1.1"], ["10.0.0.0/30", "10.0.1.0/30"],
                           [["10.0.1.2", 6], ["10.0.0.2", 5]], ["10.0.1.0/30", "10.0.0.0/30"], 4)
    assert routes == [("10.0.0.1", ("10.0.0.2", 5)), ("10.0.1.1", ("10.0.1.2", 6))] * 2


def test_no_direct_cable_lets_routing_choose() -> None:
    assert stream_routes(["10.0.0.5"], ["10.0.0.4/30"], [["10.0.0.2", 5]], ["10.0.0.0/30"], 2) == [
        ("", ("10.0.0.2", 5))] * 2
