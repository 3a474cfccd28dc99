import json

import pytest

from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.launch.hostfile import Host, local_hosts, parse_hostfile, read_hostfile


def test_plain_strings_are_ssh_hosts():
    hosts = parse_hostfile(["mac-a.local", "me@mac-b.local"])
    assert hosts == [Host(name="mac-a.local", exec="ssh", ssh="mac-a.local"),
                     Host(name="me@mac-b.local", exec="ssh", ssh="me@mac-b.local")]
    assert hosts[1].ssh_address == "mac-b.local"


def test_full_entries_and_topo_style_object():
    data = {"cables": [["a", "b"]], "hosts": [
        {"name": "a", "ssh": "me@10.0.0.1", "addresses": ["169.254.10.1/30"], "ifname": ["en2", "en3"],
         "env": {"X": 1}},
        {"name": "b", "ssh": "me@10.0.0.2", "addresses": "169.254.10.2", "ifname": "en2"}]}
    a, b = parse_hostfile(data)
    assert (a.name, a.exec, a.addresses, a.ifname, a.env) == ("a", "ssh", ("169.254.10.1",), "en2,en3", {"X": "1"})
    assert b.addresses == ("169.254.10.2",)


def test_via_overrides_and_lab_entries():
    entry = {"name": "mac0", "exec": "lab", "lab": "l1", "addresses": ["10.213.0.1"], "ifname": "tb1_0"}
    assert parse_hostfile([entry])[0].exec == "lab"
    assert parse_hostfile([entry], default_exec="local")[0].exec == "local"
    assert parse_hostfile([{"name": "x"}])[0].exec == "local"


@pytest.mark.parametrize("data,needle", [
    ([], "non-empty"), ({"nodes": []}, "'hosts' list"), ([3], "got int"), ([""], "empty host"),
    ([{"name": "a", "exec": "telnet"}], "'exec' 'telnet' is invalid"),
    ([{"name": "a", "exec": "ssh"}], "needs an 'ssh' field"),
    ([{"name": "a", "exec": "lab"}], "needs a 'lab'"),
    ([{"ssh": "a", "addresses": ["mac-a"]}], "not an IP address"),
    ([{"ssh": "a", "ifname": "en2,,en3"}], "comma list"), ([{"ssh": "a", "ifname": 5}], "'ifname' must be"),
    ([{"ssh": "a", "env": ["X=1"]}], "'env' must be"), (["a", "a"], "unique"),
])
def test_bad_hostfiles_say_what_was_expected(data, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_hostfile(data)


def test_read_hostfile_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_hostfile(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[{]")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_hostfile(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(["h1", "h2"]))
    assert [h.name for h in read_hostfile(good)] == ["h1", "h2"]


def test_local_hosts():
    assert local_hosts() == [Host(name="localhost", exec="local", addresses=("127.0.0.1",))]


def test_topo_written_hostfile_with_cables():
    # The shape `topo --hostfile` writes: hosts in ring order, each with its cable ends.
    data = [
        {"name": "a", "ssh": "a.local", "addresses": ["169.254.0.1", "169.254.0.9"], "ifname": "en2,en3",
         "cables": [{"ifname": "en2", "address": "169.254.0.1", "peer": "b", "peer_address": "169.254.0.2",
                     "network": "169.254.0.0/30", "speed_gbps": 40.0},
                    {"ifname": "en3", "address": "169.254.0.9", "peer": "c", "peer_address": "169.254.0.10"}]},
        {"name": "b", "ssh": "b.local", "addresses": ["169.254.0.2"], "ifname": "en2", "cables": "junk"}]
    a, b = parse_hostfile(data)
    assert a.links == (("169.254.0.1", "b"), ("169.254.0.9", "c")) and b.links == ()
    assert a.exec == "ssh" and a.ifname == "en2,en3"
