"""The lab's state file: the plan it was built from, as JSON, so `status`/`exec`/`down` need no arguments.

Kept in /run (cleared at boot, like the namespaces themselves) unless THUNDERBOLT_LAB_STATE_DIR or an
explicit directory says otherwise.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Mapping

from ..config import lab_state_dir
from ..errors import ConfigError
from .blueprint import Cable, LabPlan, Route, check_name

DEFAULT_STATE_DIR = "/run/torch-thunderbolt"
_FORMAT = 1


def state_dir(explicit: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(explicit or lab_state_dir(env, DEFAULT_STATE_DIR))


def state_path(name: str, directory: str | os.PathLike | None = None) -> Path:
    return state_dir(directory) / f"lab-{check_name(name)}.json"


def plan_to_dict(plan: LabPlan) -> dict:
    return {"format": _FORMAT, **asdict(plan)}


def plan_from_dict(data: dict) -> LabPlan:
    try:
        if data.get("format") != _FORMAT:
            raise ConfigError(f"lab state has format {data.get('format')!r}, expected {_FORMAT}")
        fields = {k: v for k, v in data.items() if k != "format"}
        fields["cables"] = [Cable(**c) for c in fields["cables"]]
        fields["routes"] = [Route(**r) for r in fields["routes"]]
        return LabPlan(**fields)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"lab state file is damaged ({exc}); run `lab down --name NAME` to clean up") from exc


def save_state(plan: LabPlan, directory: str | os.PathLike | None = None) -> Path:
    path = state_path(plan.name, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(plan_to_dict(plan), indent=1))
    tmp.replace(path)  # atomic: a crash never leaves half a state file
    return path


def load_state(name: str, directory: str | os.PathLike | None = None) -> LabPlan:
    path = state_path(name, directory)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no lab named {name!r} (no state file {path}); start one with `lab up`") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"lab state file {path} is not JSON ({exc}); run `lab down --name {name}`") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"lab state file {path} is damaged; run `lab down --name {name}`")
    return plan_from_dict(data)


def remove_state(name: str, directory: str | os.PathLike | None = None) -> bool:
    try:
        state_path(name, directory).unlink()
        return True
    except FileNotFoundError:
        return False
