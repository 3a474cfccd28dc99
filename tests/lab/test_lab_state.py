import json

import pytest

from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.lab.blueprint import plan_lab
from torch_thunderbolt.lab.state import load_state, remove_state, save_state, state_dir, state_path


def test_round_trip(tmp_path):
    plan = plan_lab(4, "ring", 2, "10gbit", 9000, name="st1", cc="bbr")
    path = save_state(plan, tmp_path)
    assert path == tmp_path / "lab-st1.json"
    assert load_state("st1", tmp_path) == plan
    assert remove_state("st1", tmp_path) and not remove_state("st1", tmp_path)


def test_missing_and_damaged_files_say_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="no lab named 'st2'.*lab up"):
        load_state("st2", tmp_path)
    state_path("st2", tmp_path).write_text("{not json")
    with pytest.raises(ConfigError, match="lab down --name st2"):
        load_state("st2", tmp_path)
    state_path("st2", tmp_path).write_text(json.dumps({"format": 1, "name": "st2"}))
    with pytest.raises(ConfigError, match="damaged"):
        load_state("st2", tmp_path)


def test_state_dir_precedence():
    assert str(state_dir("/x", {"THUNDERBOLT_LAB_STATE_DIR": "/y"})) == "/x"
    assert str(state_dir(None, {"THUNDERBOLT_LAB_STATE_DIR": "/y"})) == "/y"
    assert str(state_dir(None, {})) == "/run/torch-thunderbolt"
