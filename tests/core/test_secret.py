"""A stranger who can reach the rendezvous store (MASTER_PORT, no authentication) reads everything in it.

With THUNDERBOLT_SECRET on the ranks that must not let it join; without one it can (documented, and each
rank warns); ranks with different secrets fail with an error naming the peer; the secret is parsed in one
place and never shown.
"""
from __future__ import annotations

import logging
import socket

import pytest
import torch

from torch_thunderbolt.config import Config, parse_secret
from torch_thunderbolt.errors import ConfigError, HandshakeError
from torch_thunderbolt.protocol import handshake as hs
from torch_thunderbolt.rendezvous.hosts import recv_exact as _recv_exact
from torch_thunderbolt.rendezvous.records import Records, unchecked_value
from torch_thunderbolt.rendezvous.tcp import connect_tcp
from torch_thunderbolt.testing.ranks import run_ranks
from torch_thunderbolt.testing.worlds import SetUpOnThreads, all_reduce_on_threads

from .programs import secret_warning

SECRET = b"0123456789abcdef" * 4  # 64 characters; what `launch` makes is secrets.token_hex(32)
OTHER = b"fedcba9876543210" * 4
WARNING = "THUNDERBOLT_SECRET is not set"


@pytest.fixture
def world():
    with SetUpOnThreads(2, connect_tcp) as w:
        yield w


def stranger_joins_as_rank_1(view, streams: int) -> list[socket.socket]:
    """The attack: read rank 0's endpoint and the group's nonce from the store (with no private secret the
    nonce is the key), publish our own address as rank 1's (rank 0 accepts rank 1 only from the address in
    the store, which anyone can write), then complete the handshake as rank 1 on every stream. Returns the
    accepted sockets; raises HandshakeError when rank 0 refuses."""
    view.wait(["tb/ep/0", "tb/group"])
    shared = unchecked_value(view.get("tb/group"))
    key, group = bytes.fromhex(shared["nonce"]), shared["group"]
    ep = tuple(unchecked_value(view.get("tb/ep/0"))["endpoints"][0])
    Records(view, 1, b"", 0.0).publish("tb/ep/1", {"endpoints": [["127.0.0.1", 9]], "nets": [], "host": "stranger"})
    Records(view, 1, b"", 0.0).publish("tb/done/1", 1)  # and says it read all it needs, as a rank does at the end
    socks = []
    try:
        for stream in range(streams):
            s = socket.create_connection(ep, timeout=10)
            socks.append(s)
            client = hs.ClientHandshake(key, 1, 0, stream, group, dialled=s.getpeername(), local=s.getsockname())
            s.sendall(client.receive_challenge(_recv_exact(s, hs.CHALLENGE_SIZE)))
            client.receive_reply(_recv_exact(s, hs.REPLY_SIZE))
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def _all_reduce_exact(transports: dict) -> None:
    results = all_reduce_on_threads(transports, lambda r: torch.arange(1000, dtype=torch.float32) * (r + 1))
    expected = torch.arange(1000, dtype=torch.float32) * 3
    assert set(results) == {0, 1}
    assert all(torch.equal(results[r], expected) for r in (0, 1))


@pytest.mark.timeout(60)
def test_with_a_secret_a_stranger_holding_the_store_is_refused_and_the_job_runs(world, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="torch_thunderbolt")
    cfg = Config(streams=2, secret=SECRET)
    world.start(0, cfg)
    with pytest.raises(HandshakeError, match="rank 0 refused our connection"):
        stranger_joins_as_rank_1(world.view, 2)
    world.start(1, cfg)
    world.join()
    assert not world.errors, world.errors
    _all_reduce_exact(world.results)
    assert any("refused a connection" in r.message for r in caplog.records)
    assert not [r for r in caplog.records if WARNING in r.getMessage()]


@pytest.mark.timeout(60)
def test_without_a_secret_the_store_alone_lets_a_stranger_in(world, caplog) -> None:
    """The weakness of jobs without a secret (torchrun users): the same attack succeeds, rank 0 takes the
    stranger for rank 1 — and every rank has warned about it."""
    caplog.set_level(logging.WARNING, logger="torch_thunderbolt")
    world.start(0, Config(streams=2))
    socks = stranger_joins_as_rank_1(world.view, 2)  # no HandshakeError: accepted as rank 1
    try:
        world.join()
        assert not world.errors, world.errors
        assert world.results[0] is not None  # rank 0's group is "complete", with the stranger in it
    finally:
        for s in socks:
            s.close()
    warned = [r for r in caplog.records if WARNING in r.getMessage()]
    assert len(warned) == 1 and warned[0].name == "torch_thunderbolt", warned
    assert warned[0].levelno == logging.WARNING and "rank 0" in warned[0].getMessage()
    assert "MASTER_PORT" in warned[0].getMessage() and "torch-thunderbolt launch" in warned[0].getMessage()


@pytest.mark.timeout(60)
def test_different_secrets_fail_naming_the_peer(world) -> None:
    """Rank 1 finds rank 0's group record signed with another key, says so and gives up; rank 0 reads rank
    1's failure (signed with rank 1's key) and says that rank 1 failed its handshake: both with the hint,
    at once rather than at the connect timeout, and neither shows a secret."""
    world.start(0, Config(streams=2, secret=SECRET, connect_timeout=20))
    world.start(1, Config(streams=2, secret=OTHER, connect_timeout=20))
    world.join()
    assert set(world.errors) == {0, 1}, world.errors
    client, server = world.errors[1], world.errors[0]
    assert isinstance(client, HandshakeError), repr(client)
    assert "rank 1: rank 0's record tb/group is signed with another key" in str(client)
    assert isinstance(server, HandshakeError), repr(server)
    assert "rank 0: rank 1 failed its handshake" in str(server)
    for exc in (client, server):
        assert "same THUNDERBOLT_SECRET" in str(exc) and "another THUNDERBOLT_SECRET" in str(exc)
        assert SECRET.decode() not in str(exc) and OTHER.decode() not in str(exc)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("secret_on", [0, 1])
def test_a_secret_on_one_rank_only_is_a_config_error_naming_the_peer(world, secret_on: int) -> None:
    for r in (0, 1):
        world.start(r, Config(streams=1, secret=SECRET if r == secret_on else b"", connect_timeout=4))
    world.join()
    assert set(world.errors) == {0, 1}, world.errors
    for r, exc in world.errors.items():
        assert isinstance(exc, ConfigError), repr(exc)
        assert f"rank {r}: rank {1 - r} " in str(exc) and "THUNDERBOLT_SECRET" in str(exc)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "shm", "hybrid"])
@pytest.mark.parametrize("secret", [None, SECRET.decode()])
def test_warning_once_per_process_only_when_strangers_can_join(transport: str, secret: str | None,
                                                                tmp_path) -> None:
    """Through torch's API: without a secret each rank with TCP peers warns once; with one, or over shared
    memory only (Unix sockets and segments on this host: nothing a stranger elsewhere could connect to),
    none does. The hybrid: 2 pretend hosts x 2 ranks, TCP between the hosts authenticated by the secret."""
    env = {"THUNDERBOLT_TRANSPORT": transport} if transport != "hybrid" else {"TEST_FAKE_HOSTS": "1"}
    if secret:
        env["THUNDERBOLT_SECRET"] = secret
    world = 4 if transport == "hybrid" else 2
    for res in run_ranks(secret_warning, world, tmp_path, timeout=90, env=env):
        assert res.json() == {"ok": True}
        want = 1 if transport != "shm" and secret is None else 0
        assert res.stderr.count(WARNING) == want, res.stderr[-3000:]
        if secret:
            assert secret not in res.stderr and secret not in res.stdout


# Parsing: one place, ConfigError naming the variable, never the value.

def test_secret_from_the_environment_or_a_file(tmp_path) -> None:
    assert Config.from_env({}).secret == b""
    assert Config.from_env({"THUNDERBOLT_SECRET": f"  {SECRET.decode()}\n"}).secret == SECRET
    path = tmp_path / "secret"
    path.write_bytes(OTHER + b"\n")
    path.chmod(0o600)  # a file others can read is refused (tests/core/test_config_text.py)
    assert Config.from_env({"THUNDERBOLT_SECRET": f"@{path}"}).secret == OTHER
    assert SECRET.decode() not in repr(Config(secret=SECRET))


@pytest.mark.parametrize("value, match", [
    ("tooshort-but-secret", "at least 32 characters"),
    ("a" * 40, "expected a random secret; this one has 1 distinct characters"),  # not random
    ("@/nonexistent/tb-secret", "THUNDERBOLT_SECRET=@/nonexistent/tb-secret: cannot read"),
])
def test_bad_secrets_are_config_errors_that_do_not_show_them(value: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        Config.from_env({"THUNDERBOLT_SECRET": value})
    assert "THUNDERBOLT_SECRET" in str(info.value)
    if not value.startswith("@"):
        assert value not in str(info.value)


def test_an_oversized_secret_file_is_refused(tmp_path) -> None:
    path = tmp_path / "big"
    path.write_bytes(SECRET * 100)
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="right file"):
        parse_secret(f"@{path}")


def test_the_derived_key_depends_on_secret_nonce_and_group() -> None:
    key = hs.derive_key(SECRET, b"n" * 32, "g")
    assert len(key) == 32
    others = [hs.derive_key(OTHER, b"n" * 32, "g"), hs.derive_key(SECRET, b"m" * 32, "g"),
              hs.derive_key(SECRET, b"n" * 32, "h")]
    assert key not in others and key != b"n" * 32
