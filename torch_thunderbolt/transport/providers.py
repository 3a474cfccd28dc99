"""Which verbs provider a job uses, chosen by THUNDERBOLT_VERBS (parsed by config.py): the system's verbs
library (`verbs.NativeProvider`) or the fake fabric (`fakeverbs.FakeProvider`). It sits above both, so the
binding never needs the fake's module and the fake builds on the binding alone (no import cycle)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..platform import Platform
from .verbs import NativeProvider, Provider, Verbs

if TYPE_CHECKING:
    from ..config import Config


def open_provider(spec: str = "system", fabric: str = "", plat: Platform | None = None) -> Provider:
    """"system" (the verbs library) or "fake" (the fake fabric in `fabric`)."""
    if spec == "fake":
        # Imported here, not at the top: a job on real hardware never loads the fake (ctypes callbacks,
        # mapped fabric files). It lives in this layer, so the runtime needs nothing from testing/.
        from .fakeverbs import FakeProvider

        return FakeProvider(fabric)
    if spec == "system":
        return NativeProvider(plat)
    raise ValueError(f"unknown verbs provider {spec!r}")


def load_verbs(spec: str = "system", fabric: str = "", plat: Platform | None = None) -> Verbs:
    return Verbs(open_provider(spec, fabric, plat))


def verbs_from_config(cfg: "Config", plat: Platform | None = None) -> Verbs:
    """The verbs of the provider THUNDERBOLT_VERBS names (as config.py parsed it)."""
    return load_verbs(cfg.verbs, cfg.verbs_fabric, plat)
