"""Settings that must agree are compared at set-up (a ConfigError on every rank naming the variable and each
rank's value, before any collective), settings a rank may choose for itself are not, and the store's host
leaves the set-up only once every rank has read what it needs from the store. Ranks are threads running
the real set-up (`rendezvous.group.connect`, `connect_shm`, `connect_tcp`) over a TCPStore on loopback; the
multi-process runs are in test_agree_ranks.py."""
from __future__ import annotations

import dataclasses
import datetime
import gc
import threading
import time
from typing import Any, Callable

import pytest
import torch.distributed as dist

from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import ConfigError, PeerLostError
from torch_thunderbolt.rendezvous import agree
from torch_thunderbolt.rendezvous.group import connect
from torch_thunderbolt.rendezvous.records import Records
from torch_thunderbolt.rendezvous.shm import connect_shm
from torch_thunderbolt.rendezvous.tcp import connect_tcp
from torch_thunderbolt.testing.worlds import on_threads


def _server(world: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)


def _client(port: int, world: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=30))


def _connect_all(cfgs: list[Config], timeout: float = 20.0) -> dict[int, BaseException]:
    """group.connect on one thread per Config; every transport is closed; the errors by rank."""
    world = len(cfgs)
    server = _server(world)

    def body(r: int) -> Any:
        store = dist.PrefixStore("g/", _client(server.port, world))
        return connect(store, r, world, cfgs[r], timeout).transport

    run = on_threads(world, body, timeout + 10)
    for t in run.results:
        if t is not None:
            t.close()
    assert not run.hung, "a rank hung in set-up"
    return run.errors


def _differ(field: str, a: Any, b: Any, **common: Any) -> dict[int, BaseException]:
    base = Config(transport="tcp", streams=1, **common)
    return _connect_all([dataclasses.replace(base, **{field: a}), dataclasses.replace(base, **{field: b})])


# (Config field, rank 0's value, rank 1's value, what the error must show, common settings)
MUST_AGREE = [
    ("compression", "fp16", "bf16", "THUNDERBOLT_COMPRESSION differs between ranks: rank 0 fp16, rank 1 bf16", {}),
    ("compression_block", 256, 128, "THUNDERBOLT_COMPRESSION_BLOCK differs between ranks: rank 0 256, rank 1 128",
     {"compression": "int8"}),
    ("small_bytes", 1 << 10, 64 << 10, "THUNDERBOLT_SMALL differs between ranks: rank 0 1K, rank 1 64K", {}),
    ("chunk_bytes", 64 << 10, 1 << 20, "THUNDERBOLT_CHUNK differs between ranks: rank 0 64K, rank 1 1M", {}),
    ("algo", "ring", "auto", "THUNDERBOLT_ALGO differs between ranks: rank 0 ring, rank 1 auto", {}),
    ("stripe_bytes", 256 << 10, 1 << 20, "THUNDERBOLT_STRIPE differs between ranks: rank 0 256K, rank 1 1M", {}),
    ("streams", 1, 2, "THUNDERBOLT_STREAMS differs between ranks: rank 0 1, rank 1 2", {}),
    ("transport", "tcp", "auto", "THUNDERBOLT_TRANSPORT differs between ranks: rank 0 tcp, rank 1 auto", {}),
]


@pytest.mark.parametrize("field,a,b,shown,common", MUST_AGREE, ids=[m[0] for m in MUST_AGREE])
def test_a_setting_that_differs_is_a_config_error_on_every_rank_naming_each_value(field, a, b, shown, common):
    errors = _differ(field, a, b, **common)
    assert set(errors) == {0, 1}, errors
    for r, e in errors.items():
        assert isinstance(e, ConfigError), (r, e)
        assert shown in str(e) and "every rank of a job needs the same value" in str(e), (r, str(e))


# The shared-memory layout: ranks on one host map each other's segments.
SHM_AGREE = [("shm_slot_bytes", 4 << 10, 8 << 10, "THUNDERBOLT_SHM_SLOT differs between ranks: rank 0 4K, rank 1 8K"),
             ("shm_slots", 2, 4, "THUNDERBOLT_SHM_SLOTS differs between ranks: rank 0 2, rank 1 4"),
             ("shm_window_bytes", 0, None, "THUNDERBOLT_SHM_WINDOW differs between ranks: rank 0 0, rank 1 auto")]


@pytest.mark.parametrize("field,a,b,shown", SHM_AGREE, ids=[m[0] for m in SHM_AGREE])
@pytest.mark.parametrize("transport", ["shm", "auto"])
def test_a_shared_memory_layout_that_differs_on_one_host_is_a_config_error(field, a, b, shown, transport):
    base = Config(transport=transport)
    errors = _connect_all([dataclasses.replace(base, **{field: a}), dataclasses.replace(base, **{field: b})])
    assert set(errors) == {0, 1}, errors
    for r, e in errors.items():
        assert isinstance(e, ConfigError) and shown in str(e), (r, e)
        assert "every rank sharing memory" in str(e), str(e)


def test_a_different_package_version_is_a_config_error(monkeypatch):
    real = agree.my_settings

    def versioned(cfg: Config) -> dict:
        out = real(cfg)
        out["job"][agree.VERSION_KEY] = cfg.extra.get("version", out["job"][agree.VERSION_KEY])
        return out

    monkeypatch.setattr(agree, "my_settings", versioned)
    cfgs = [Config(transport="tcp", streams=1), Config(transport="tcp", streams=1, extra={"version": "0.0.9"})]
    errors = _connect_all(cfgs)
    assert set(errors) == {0, 1} and all(isinstance(e, ConfigError) for e in errors.values()), errors
    assert "torch-thunderbolt version differs between ranks" in str(errors[0]) and "0.0.9" in str(errors[0])


# Settings each rank may choose for itself (config.job_settings says why): a job where they differ runs.
MAY_DIFFER = [("spin_us", 0, 200), ("connect_timeout", 30.0, 60.0), ("socket_buffer", 1 << 20, 4 << 20),
              ("link_timeout_ms", 1000, 3000), ("debug", False, True), ("shm_spin_us", 0, 100),
              ("compression_block", 256, 128)]  # (the block size counts only under int8)


@pytest.mark.parametrize("field,a,b", MAY_DIFFER, ids=[m[0] for m in MAY_DIFFER])
def test_settings_a_rank_may_choose_for_itself_may_differ(field, a, b):
    assert _differ(field, a, b) == {}


def test_three_ranks_name_every_value_once():
    cfgs = [Config(transport="tcp", streams=1, compression=c) for c in ("fp16", "bf16", "fp16")]
    errors = _connect_all(cfgs)
    assert set(errors) == {0, 1, 2}
    assert "THUNDERBOLT_COMPRESSION differs between ranks: ranks [0, 2] fp16, rank 1 bf16" in str(errors[1])


def test_per_host_settings_are_compared_among_the_ranks_of_each_host_only():
    """Hosts A (ranks 0, 1) and B (ranks 2, 3) with different slot sizes: fine. Within B: refused."""
    settings = [{"job": {}, "host": {"THUNDERBOLT_SHM_SLOT": s}} for s in ("4K", "4K", "8K", "8K")]
    records = Records(dist.HashStore(), 1, b"", time.monotonic() + 5)
    agree.Agreement(records, 1, 4, settings, None).check_hosts(["A", "A", "B", "B"], "auto")
    settings[3]["host"]["THUNDERBOLT_SHM_SLOT"] = "16K"
    with pytest.raises(ConfigError, match=r"THUNDERBOLT_SHM_SLOT differs between ranks: rank 2 8K, rank 3 16K; "
                                          r"every rank sharing memory on one host \(B\)"):
        agree.Agreement(records, 1, 4, settings, None).check_hosts(["A", "A", "B", "B"], "auto")
    # TCP maps no memory: nothing to compare
    agree.Agreement(records, 1, 4, settings, None).check_hosts(None, "tcp")


class SlowStore:
    """A store that answers `get` of one key only after `delay` seconds: a rank still reading its last set-up
    key when the others are done (a busy machine)."""

    def __init__(self, inner: Any, slow_key: str, delay: float) -> None:
        self.underlying_store, self.slow_key, self.delay = inner, slow_key, delay

    def get(self, key: str) -> bytes:
        if key == self.slow_key:
            time.sleep(self.delay)
        return self.underlying_store.get(key)

    def __getattr__(self, name: str) -> Callable:
        return getattr(self.underlying_store, name)


# How each set-up is made, the rank that reads late and the key it reads last (after rank 0 has finished):
# the shared-memory ready marks, and a higher rank's endpoint that TCP set-up reads once connected.
SETUPS = {"shm": (lambda store, r, w: connect_shm(store, r, w, Config(), 20), 2, "tbshm/ready/0"),
          "tcp": (lambda store, r, w: connect_tcp(store, r, w, Config(streams=1), 20), 1, "tb/ep/2"),
          "group": (lambda store, r, w: connect(store, r, w, Config(transport="shm"), 20).transport, 2,
                    "tbshm/ready/0")}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_the_store_host_does_not_leave_set_up_while_a_peer_still_reads_from_its_store(setup):
    """Rank 0 hosts the store and drops it the moment its set-up returns (its process exits); another rank
    reads its last key late. Its set-up must still succeed: rank 0 returns only once it has read it."""
    make, slow, slow_key = SETUPS[setup]
    world = 3
    holder = {"server": _server(world)}
    port = holder["server"].port
    events: dict[str, float] = {}

    def body(r: int) -> Any:
        if r == 0:
            store = dist.PrefixStore("g/", holder.pop("server"))
        else:
            store = dist.PrefixStore("g/", _client(port, world))
            if r == slow:
                store = SlowStore(store, slow_key, 1.0)
        t = make(store, r, world)
        events[f"returned{r}"] = time.monotonic()
        if r == 0:
            del store  # the process would exit here: the store's server goes with it
            gc.collect()
        return t

    run = on_threads(world, body, 40)
    for t in run.results:
        if t is not None:
            t.close()
    assert not run.hung and not run.errors, run.errors
    assert events["returned0"] >= events[f"returned{slow}"] - 0.5, events  # rank 0 waited for the late read


def test_the_store_host_names_a_rank_that_never_finishes_set_up():
    """A rank that never says it is done (it died between its last read and the end): rank 0 gives up at the
    set-up deadline with an error naming it, instead of waiting forever."""
    store = dist.HashStore()
    Records(store, 1, b"", 0.0).publish(agree.DONE.format(rank=1), 1)
    with pytest.raises(PeerLostError, match=r"waiting for rank 2 to publish that it finished its set-up"):
        agree.leave_together(Records(store, 0, b"", time.monotonic() + 0.5), 0, 3)


def test_the_store_host_raises_the_reason_a_rank_gave_up_for():
    store = dist.HashStore()
    Records(store, 1, b"", 0.0).publish(agree.DONE.format(rank=1), 1)
    Records(store, 2, b"", 0.0).announce(ConfigError("rank 2: something of its own"))
    with pytest.raises(ConfigError, match=r"rank 2 gave up during set-up: ConfigError: rank 2: something of its own"):
        agree.leave_together(Records(store, 0, b"", time.monotonic() + 30), 0, 3)


def test_leaving_together_costs_the_other_ranks_no_wait():
    store = dist.HashStore()
    t0 = time.monotonic()
    agree.leave_together(Records(store, 1, b"", time.monotonic() + 30), 1, 3)  # rank 2 is not done: rank 1 goes on
    assert time.monotonic() - t0 < 5
    assert store.check([agree.DONE.format(rank=1)])
