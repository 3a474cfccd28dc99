import pytest

from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.lab.executor import CommandResult
from torch_thunderbolt.lab.blueprint import plan_lab
from torch_thunderbolt.lab.view import Lab, format_status, status_rows


@pytest.fixture
def ring4():
    return Lab(plan_lab(4, "ring", 1, "10gbit", None, name="v1"))


def test_host_lookup_by_index_name_and_namespace(ring4):
    assert ring4.hosts() == ["mac0", "mac1", "mac2", "mac3"]
    assert ring4.index(2) == ring4.index("2") == ring4.index("mac2") == ring4.index("v1-mac2") == 2
    with pytest.raises(ConfigError, match="no host 'mac9'.*mac0, mac1"):
        ring4.index("mac9")
    with pytest.raises(ConfigError, match="no host '4'"):
        ring4.index(4)


def test_per_host_addresses_and_interfaces(ring4):
    assert ring4.ifnames("mac0") == ["tb1_0", "tb3_0"]
    assert ring4.ifname_env(0) == "tb1_0,tb3_0"
    assert ring4.addresses("mac0") == ["10.213.0.1", "10.213.0.13"]
    assert ring4.neighbours("mac0") == ["mac1", "mac3"]
    assert ring4.exec_argv("mac3", ["hostname"]) == ["ip", "netns", "exec", "v1-mac3", "hostname"]


def test_hostfile_is_launcher_ready(ring4):
    hf = ring4.hostfile()
    assert hf[1] == {"name": "mac1", "exec": "lab", "lab": "v1", "namespace": "v1-mac1",
                     "addresses": ["10.213.0.2", "10.213.0.5"], "ifname": "tb0_0,tb2_0"}


def test_counters_use_the_runner():
    seen = []

    def runner(argv):
        seen.append(argv)
        return CommandResult(0, "1\n2\n3\n4\n")
    lab = Lab(plan_lab(3, "chain", name="v2"), runner)
    assert lab.counters("mac1") == {"tb0_0": (1, 2), "tb2_0": (3, 4)}
    assert seen[0][3] == "v2-mac1"


def test_status_table(ring4):
    rows = status_rows(ring4.plan, {"mac0": {"tb1_0": (5, 6)}})
    assert len(rows) == 8
    assert rows[0] == {"host": "mac0", "namespace": "v1-mac0", "ifname": "tb1_0", "address": "10.213.0.1",
                       "peer": "mac1", "rate": "10gbit", "rx_bytes": 5, "tx_bytes": 6}
    text = format_status(ring4.plan, rows)
    assert "4 hosts, ring, 4 cables, rate 10gbit" in text
    assert "forwarding on mac0, mac1, mac2, mac3" in text
    assert text.splitlines()[3].split()[-2:] == ["-", "-"]  # mac0 tb3_0: no counters given
