"""The store probe runs inside torch's env:// and tcp:// rendezvous only for a thunderbolt group: the backend
comes from init_process_group, wrapped to record it (backend/registration.py). In this process with torch's
own function (a blocked store is our error at once; gloo is created, and fails, as torch alone does), and
with fakes of torch for the forms of the call, the wrapper's bookkeeping and a torch it cannot read."""
from __future__ import annotations

import functools
import gc
import importlib
import inspect
import pickle
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torch_thunderbolt  # noqa: F401 - registers the backend and the probe
from torch_thunderbolt.backend import registration
from torch_thunderbolt.backend.registration import TorchPlaces, install_probe, names_thunderbolt, ours, remove_probe
from torch_thunderbolt.errors import PeerLostError
from torch_thunderbolt.rendezvous import store_probe
from torch_thunderbolt.testing.ranks import free_port

c10d = importlib.import_module("torch.distributed.distributed_c10d")
rdzv = importlib.import_module("torch.distributed.rendezvous")


@pytest.fixture
def probes(monkeypatch) -> list[str]:
    """The URLs the probe was run for; the probe itself still runs."""
    seen: list[str] = []
    real = store_probe.probe_url

    def spy(url: str, timeout: Any = None, env: Any = None) -> None:
        seen.append(url)
        real(url, timeout, env)

    monkeypatch.setattr(store_probe, "probe_url", spy)
    return seen


@pytest.fixture
def refused_store(monkeypatch) -> int:
    """Rank 1 of a job whose store (127.0.0.1, a port nobody serves) refuses every connection."""
    port = free_port()
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "1", "WORLD_SIZE": "2",
                        "THUNDERBOLT_CONNECT_TIMEOUT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    return port


def test_torchs_init_process_group_is_wrapped_under_its_own_name_docs_and_signature() -> None:
    hooked = dist.init_process_group
    assert ours(hooked) and c10d.init_process_group is hooked
    torchs = hooked.__wrapped__
    assert not ours(torchs) and torchs.__module__ == "torch.distributed.distributed_c10d"
    assert inspect.signature(hooked) == inspect.signature(torchs)
    assert (hooked.__name__, hooked.__qualname__, hooked.__module__, hooked.__doc__) == (
        torchs.__name__, torchs.__qualname__, torchs.__module__, torchs.__doc__)
    assert pickle.loads(pickle.dumps(hooked)) is hooked
    for scheme in ("env", "tcp"):
        assert ours(rdzv._rendezvous_handlers[scheme])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("init_method", ["env://", "tcp://127.0.0.1:{port}?rank=1&world_size=2"])
def test_a_blocked_store_is_our_error_for_a_thunderbolt_group(init_method, refused_store, probes) -> None:
    # torch alone would retry for the group's timeout and then raise its own DistStoreError
    with pytest.raises(PeerLostError, match=f"rank 1: could not connect to the rendezvous store at "
                                            f"127.0.0.1:{refused_store}.*refused"):
        dist.init_process_group("thunderbolt", init_method=init_method.format(port=refused_store),
                                timeout=timedelta(seconds=30))
    assert len(probes) == 1 and not dist.is_initialized()


@pytest.mark.timeout(120)
def test_gloo_meets_a_blocked_store_as_torch_alone_does(refused_store, probes) -> None:
    with pytest.raises(Exception) as info:
        dist.init_process_group("gloo", timeout=timedelta(seconds=2))
    assert not isinstance(info.value, PeerLostError) and "rendezvous store" not in str(info.value)
    assert probes == [] and not dist.is_initialized()


@pytest.mark.timeout(120)
def test_gloo_is_created_without_our_settings_or_probe(monkeypatch, probes) -> None:
    """A setting thunderbolt refuses (a secret that is not one) is none of gloo's business."""
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                        "WORLD_SIZE": "1", "THUNDERBOLT_SECRET": "not-a-secret"}.items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        assert dist.get_backend() == "gloo" and dist.get_world_size() == 1
        x = torch.ones(3)
        dist.all_reduce(x)
        assert x.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()
        gc.collect()  # the store's listening socket closes with it
    assert probes == []


class FakeTorch:
    """distributed_c10d, torch.distributed and rendezvous.py in miniature: `init_process_group` (with `init`'s
    signature) resolves nothing and calls the env:// handler, which records its URL."""

    def __init__(self, init: Any = None) -> None:
        self.rendezvous: list[str] = []

        def torch_handler(url: str, **kwargs: Any) -> str:
            self.rendezvous.append(url)
            return "store"

        def init_process_group(backend: Any = None, init_method: Any = None, timeout: Any = None,
                               world_size: int = -1, rank: int = -1, store: Any = None, group_name: str = "",
                               pg_options: Any = None, device_id: Any = None) -> str:
            if init_method == "fail":
                raise ValueError("torch says no")
            return self.places.handlers["env"]("env://?rank=1&world_size=2", timeout=None)

        self.torch_handler = torch_handler
        self.init = init or init_process_group
        self.places = TorchPlaces(SimpleNamespace(init_process_group=self.init),
                                  (SimpleNamespace(init_process_group=self.init),),
                                  {"env": torch_handler, "file": torch_handler})


@pytest.fixture
def fake_probes(monkeypatch) -> list[str]:
    seen: list[str] = []
    monkeypatch.setattr(store_probe, "probe_url", lambda url, timeout=None, env=None: seen.append(url))
    return seen


@pytest.mark.parametrize("call, probed", [
    ((("thunderbolt",), {}), True),
    (((), {"backend": "thunderbolt"}), True),
    (((), {"backend": dist.Backend("thunderbolt")}), True),
    (((), {"backend": "cpu:thunderbolt,cuda:nccl"}), True),
    (((), {"backend": "THUNDERBOLT"}), True),
    ((("gloo",), {}), False),
    (((), {"backend": "cpu:gloo,cuda:nccl"}), False),
    (((), {}), False),
    (((), {"device_id": torch.device("cpu")}), False),  # torch's default for cpu: gloo
    (((), {"device_id": torch.device("meta")}), True),  # mapped to thunderbolt below
])
def test_the_probe_follows_the_backend_asked_for(call, probed, fake_probes, monkeypatch) -> None:
    monkeypatch.setitem(dist.Backend.default_device_backend_map, "meta", "thunderbolt")
    fake = FakeTorch()
    assert install_probe(fake.places)
    args, kwargs = call
    assert fake.places.c10d.init_process_group(*args, **kwargs) == "store"
    assert fake.rendezvous == ["env://?rank=1&world_size=2"]  # torch's handler, called as before
    assert fake_probes == (["env://?rank=1&world_size=2"] if probed else [])


def test_the_request_lasts_only_as_long_as_the_call(fake_probes) -> None:
    fake = FakeTorch()
    install_probe(fake.places)
    with pytest.raises(ValueError, match="torch says no"):
        fake.places.c10d.init_process_group("thunderbolt", "fail")
    fake.places.handlers["env"]("env://")  # a rendezvous of nobody's init_process_group: torch's alone
    fake.places.c10d.init_process_group("gloo")
    with pytest.raises(TypeError, match="nonsense"):  # arguments torch refuses: torch's own error
        fake.places.c10d.init_process_group(backend="thunderbolt", nonsense=1)
    assert fake_probes == [] and len(fake.rendezvous) == 2
    assert not names_thunderbolt(registration._REQUESTED.get())


def test_install_is_idempotent_and_remove_puts_torchs_objects_back(fake_probes) -> None:
    fake = FakeTorch()
    assert install_probe(fake.places)
    hooked, handler = fake.places.c10d.init_process_group, fake.places.handlers["env"]
    assert install_probe(fake.places)
    assert fake.places.c10d.init_process_group is hooked and fake.places.reexports[0].init_process_group is hooked
    assert fake.places.handlers["env"] is handler and fake.places.handlers["file"] is fake.torch_handler
    assert hooked.__wrapped__ is fake.init and handler.__wrapped__ is fake.torch_handler
    remove_probe(fake.places)
    assert fake.places.c10d.init_process_group is fake.init and fake.places.reexports[0].init_process_group is fake.init
    assert fake.places.handlers == {"env": fake.torch_handler, "file": fake.torch_handler}
    fake.init("thunderbolt")
    assert fake_probes == []
    assert install_probe(fake.places)
    fake.places.reexports[0].init_process_group("thunderbolt")
    assert len(fake_probes) == 1


def test_a_wrapper_around_ours_is_not_taken_for_ours() -> None:
    fake = FakeTorch()
    install_probe(fake.places)
    hooked = fake.places.c10d.init_process_group

    def theirs(*args: Any, **kwargs: Any) -> Any:
        return hooked(*args, **kwargs)

    theirs = functools.wraps(hooked)(theirs)  # copies our mark
    fake.places.c10d.init_process_group = theirs
    assert ours(hooked) and not ours(theirs)
    remove_probe(fake.places)
    assert fake.places.c10d.init_process_group is theirs


def test_a_torch_whose_init_process_group_has_no_backend_is_left_alone(fake_probes) -> None:
    """A torch with another init_process_group: nothing is wrapped, so every group gets torch's rendezvous."""
    def init_process_group(store: Any = None, *, comm_backend: str = "gloo", init_method: str = "env://") -> str:
        return fake.places.handlers["env"](init_method, timeout=None)

    fake = FakeTorch(init_process_group)
    assert not install_probe(fake.places)
    assert fake.places.c10d.init_process_group is init_process_group
    assert fake.places.reexports[0].init_process_group is init_process_group
    assert fake.places.handlers["env"] is fake.torch_handler
    assert fake.places.c10d.init_process_group(comm_backend="thunderbolt") == "store"
    assert fake_probes == [] and fake.rendezvous == ["env://"]
    assert not install_probe(TorchPlaces(SimpleNamespace(init_process_group=type), (), {}))  # no signature to read
