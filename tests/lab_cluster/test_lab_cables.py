"""Which cables the bytes take, read from the lab's per-interface byte counters.

On a chain mac0–mac1–mac2 the chain all-reduce crosses each cable once per direction, so every counter of
the middle host moves by about the payload N. A ring laid on the same line pushes its closing edge
(mac2→mac0) through mac1 and needs 4/3·N on each of them; forcing THUNDERBOLT_ALGO=ring is the control
that shows the check can tell the two apart. With two cables between a pair, the streams are striped
round-robin over both, so each carries about half.
"""
import pytest

from torch_thunderbolt.testing.lab import counter_delta, lab_setup, lab_world
from torch_thunderbolt.testing.ranks import run_ranks

from .programs import on_lab

pytestmark = [pytest.mark.lab, pytest.mark.multiprocess, pytest.mark.slow]

PAYLOAD = 16 << 20  # bytes per rank


def _all_reduce_counters(lab, tmp_path, host, env=None, per_rank=None):
    before = lab.counters(host)
    runs = run_ranks(on_lab, lab_world(lab), tmp_path, args=["all_reduce"], setup=lab_setup(lab), timeout=90,
                     env={"TEST_PAYLOAD": str(PAYLOAD), **(env or {})}, per_rank=per_rank)
    after = lab.counters(host)
    assert all(run.json()["ok"] for run in runs)
    return counter_delta(before, after), [run.json()["sent"] for run in runs]


@pytest.mark.timeout(150)
def test_chain_all_reduce_does_not_go_through_the_middle_host(chain3, tmp_path):
    delta, sent = _all_reduce_counters(chain3, tmp_path, "mac1")
    # rx and tx of both of mac1's cables: about N each (headers and ACKs add a few %), never 4/3·N.
    for dev, (rx, tx) in delta.items():
        assert 0.95 * PAYLOAD < rx < 1.15 * PAYLOAD, (dev, rx / PAYLOAD, delta)
        assert 0.95 * PAYLOAD < tx < 1.15 * PAYLOAD, (dev, tx / PAYLOAD, delta)
    # The transport agrees: the ends send N, the middle 2N (its partial up, the result down).
    assert [round(s / PAYLOAD, 2) for s in sent] == [1.0, 2.0, 1.0]


@pytest.mark.timeout(150)
def test_control_a_ring_on_the_chain_is_seen_forwarding(chain3, tmp_path):
    delta, _ = _all_reduce_counters(chain3, tmp_path, "mac1", env={"THUNDERBOLT_ALGO": "ring"})
    for dev, (rx, tx) in delta.items():
        assert rx > 1.25 * PAYLOAD and tx > 1.25 * PAYLOAD, (dev, rx / PAYLOAD, tx / PAYLOAD)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("cables", [2, 1])
def test_two_cables_carry_half_each(pair2cables, tmp_path, cables):
    # With one cable, each host names only its first one (what a user with one cable plugged in has).
    one = {0: {"THUNDERBOLT_IFNAME": "tb1_0"}, 1: {"THUNDERBOLT_IFNAME": "tb0_0"}}
    delta, _ = _all_reduce_counters(pair2cables, tmp_path, "mac0", per_rank=None if cables == 2 else one)
    first, second = delta["tb1_0"][1], delta["tb1_1"][1]
    assert 0.95 * PAYLOAD < first + second < 1.15 * PAYLOAD, delta
    if cables == 2:
        assert 0.4 < first / (first + second) < 0.6, delta
    else:
        assert second < 0.02 * PAYLOAD, delta
