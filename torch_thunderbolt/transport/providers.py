"""Which verbs provider a job uses, chosen by THUNDERBOLT_VERBS (parsed by config.py): the system's verbs
library (`verbs.NativeProvider`), or a provider module named by the setting (`fake:DIR`: the fake fabric,
a test double in torch_thunderbolt.testing.fake_verbs).

A named provider is imported by module name, only when a job names it, as a plugin would be: the runtime
holds no import of testing/ (a job on real hardware never loads the fake's ctypes callbacks and mapped
files), the fake builds on the binding alone, and a package shipped without its test doubles fails here
with a ConfigError instead of at import."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..config import VERBS_PROVIDERS
from ..errors import ConfigError
from ..platform import Platform
from .verbs import NativeProvider, Provider, Verbs

if TYPE_CHECKING:
    from ..config import Config


def open_provider(spec: str = "system", arg: str = "", plat: Platform | None = None) -> Provider:
    """"system" (the verbs library), or a name of config.VERBS_PROVIDERS: its module's
    `open_provider(arg)` ("fake": the fake fabric in directory `arg`)."""
    if spec == "system":
        return NativeProvider(plat)
    module_name = VERBS_PROVIDERS.get(spec)
    if module_name is None:
        raise ValueError(f"unknown verbs provider {spec!r}; known: system, {', '.join(sorted(VERBS_PROVIDERS))}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"THUNDERBOLT_VERBS={spec}:{arg}: the verbs provider {spec!r} is module {module_name}, "
                          f"which cannot be imported here ({exc}); install torch-thunderbolt with its testing "
                          f"package, or unset THUNDERBOLT_VERBS to use the system's verbs library") from exc
    opener = getattr(module, "open_provider", None)
    if not callable(opener):
        raise ConfigError(f"THUNDERBOLT_VERBS={spec}:{arg}: module {module_name} has no open_provider(arg), so it "
                          f"is no verbs provider")
    return opener(arg)


def load_verbs(spec: str = "system", arg: str = "", plat: Platform | None = None) -> Verbs:
    return Verbs(open_provider(spec, arg, plat))


def verbs_from_config(cfg: "Config", plat: Platform | None = None) -> Verbs:
    """The verbs of the provider THUNDERBOLT_VERBS names (as config.py parsed it)."""
    return load_verbs(cfg.verbs, cfg.verbs_fabric, plat)
