"""`torch-thunderbolt lab`: an emulated N-Mac Thunderbolt cluster built from Linux network namespaces.

One namespace per Mac, one veth pair per cable (own /30 each), tbf at the cable rate, routes and
forwarding through middle hosts for chains and rings. `plan_lab` is pure; `lab_up`/`lab_down` run it.
"""
from .executor import CommandResult, LabCommandError, lab_down, lab_namespaces, lab_up, read_counters
from .blueprint import Cable, LabPlan, Route, parse_rate, plan_lab
from .state import load_state
from .view import Lab

__all__ = ["Cable", "CommandResult", "Lab", "LabCommandError", "LabPlan", "Route", "lab_down",
           "lab_namespaces", "lab_up", "load_state", "parse_rate", "plan_lab", "read_counters"]
