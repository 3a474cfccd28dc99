"""Real namespaces (root only): build a 3-host chain, send traffic across it, tear it down."""
import subprocess
import sys

import pytest

from torch_thunderbolt.cli.main import main
from torch_thunderbolt.lab.executor import lab_down, lab_namespaces
from torch_thunderbolt.lab.state import state_path
from torch_thunderbolt.testing.lab import skip_unless_lab, tcp_ping, unique_lab_name

pytestmark = [pytest.mark.lab]


@pytest.mark.timeout(60)
def test_chain3_forwards_shapes_and_counts(chain3_lab):
    lab = chain3_lab
    assert lab_namespaces(lab.name) == [f"{lab.name}-mac{i}" for i in range(3)]
    # Neighbours directly, and the ends through the middle host.
    assert tcp_ping(lab, "mac1", "mac0", lab.addresses("mac0")[0])
    before = lab.counters("mac1")
    assert tcp_ping(lab, "mac2", "mac0", lab.addresses("mac0")[0])
    after = lab.counters("mac1")
    assert all(after[dev][0] > before[dev][0] and after[dev][1] > before[dev][1] for dev in after)
    for host in lab.hosts():
        assert all(kinds == ["tbf"] for kinds in lab.qdiscs(host).values())
    forwarding = [lab.run(h, ["sysctl", "-n", "net.ipv4.ip_forward"], capture_output=True, text=True).stdout.strip()
                  for h in lab.hosts()]
    assert forwarding == ["0", "1", "0"]
    cc = lab.run("mac2", ["sysctl", "-n", "net.ipv4.tcp_congestion_control"], capture_output=True, text=True)
    assert cc.stdout.strip() == "reno"


@pytest.mark.timeout(60)
def test_chain_without_forwarding_cannot_reach_the_far_end(chain3_lab):
    lab = chain3_lab
    lab.run("mac1", ["sysctl", "-qw", "net.ipv4.ip_forward=0"], check=True)
    assert not tcp_ping(lab, "mac2", "mac0", lab.addresses("mac0")[0], timeout=1.0)


@pytest.mark.timeout(60)
def test_cli_up_status_exec_down_and_down_without_state(tmp_path, capsys):
    skip_unless_lab()
    name, sd = unique_lab_name(), str(tmp_path)
    try:
        assert main(["lab", "up", "--hosts", "2", "--topology", "pair", "--cables", "2", "--rate", "5gbit",
                     "--mtu", "9000", "--name", name, "--state-dir", sd]) == 0
        assert main(["lab", "status", "--name", name, "--state-dir", sd]) == 0
        status = capsys.readouterr().out
        assert f"{name}-mac1" in status and "rate 5gbit" in status and "tb0_1" in status
        assert main(["lab", "exec", "--name", name, "--state-dir", sd, "1", "--",
                     sys.executable, "-c", "import sys; sys.exit(3)"]) == 3
        mtu = subprocess.run(["ip", "-n", f"{name}-mac0", "-o", "link", "show", "tb1_1"],
                             capture_output=True, text=True, check=True).stdout
        assert "mtu 9000" in mtu
        state_path(name, sd).unlink()  # `down` must still find the namespaces by prefix
        assert main(["lab", "down", "--name", name, "--state-dir", sd]) == 0
        assert lab_namespaces(name) == []
    finally:
        lab_down(name, directory=sd)
