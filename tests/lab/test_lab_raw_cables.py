"""scripts/lab_raw_cables.py: which flows it starts (no lab needed)."""
import importlib.util
import sys

from torch_thunderbolt.lab.blueprint import plan_lab
from torch_thunderbolt.testing.ranks import REPO


def _load():
    spec = importlib.util.spec_from_file_location("lab_raw_cables", REPO / "scripts" / "lab_raw_cables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("lab_raw_cables", module)
    spec.loader.exec_module(module)
    return module


raw = _load()


def test_one_flow_each_way_on_every_cable_to_the_far_end_with_its_own_port():
    plan = plan_lab(3, "ring", 2, "1gbit", None, name="rc1")
    flows = raw.flows(plan)
    assert len(flows) == 2 * len(plan.cables) == 12
    assert len({port for *_, port in flows}) == len(flows)
    for cable, (there, back) in zip(plan.cables, zip(flows[::2], flows[1::2])):
        a, b = plan.namespaces[cable.a], plan.namespaces[cable.b]
        assert there[:3] == (a, b, cable.addr_b) and back[:3] == (b, a, cable.addr_a)
