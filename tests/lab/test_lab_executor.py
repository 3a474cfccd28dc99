import pytest

from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.lab.executor import (
    CommandResult, LabCommandError, counters_argv, lab_down, lab_namespaces, lab_up, parse_counters,
    parse_netns_list, read_counters)
from torch_thunderbolt.lab.blueprint import plan_lab
from torch_thunderbolt.lab.state import load_state, state_path

ROOT = lambda: True  # noqa: E731


def test_up_runs_every_planned_command_in_order_and_saves_state(tmp_path, fake_runner):
    plan = plan_lab(3, "chain", 1, "10gbit", None, name="ex1")
    lab_up(plan, fake_runner, tmp_path, is_root=ROOT)
    assert fake_runner.calls[0] == ["ip", "netns", "list"]
    assert fake_runner.calls[1:] == plan.commands
    assert load_state("ex1", tmp_path) == plan


def test_up_failure_removes_what_it_built_and_names_the_command(tmp_path, make_runner):
    runner = make_runner(fail_on="tbf")
    plan = plan_lab(3, "chain", 1, "10gbit", None, name="ex2")
    with pytest.raises(LabCommandError, match=r"`tc -n ex2-mac0 qdisc replace .*File exists"):
        lab_up(plan, runner, tmp_path, is_root=ROOT)
    assert runner.namespaces == []  # all three were added, then deleted
    assert not state_path("ex2", tmp_path).exists()


def test_up_refuses_an_existing_lab(tmp_path, make_runner):
    runner = make_runner(["ex3-mac0"])
    with pytest.raises(ConfigError, match="already exists.*lab down --name ex3"):
        lab_up(plan_lab(2, "pair", name="ex3"), runner, tmp_path, is_root=ROOT)
    assert runner.namespaces == ["ex3-mac0"]


def test_up_and_down_need_root(tmp_path, fake_runner):
    with pytest.raises(ConfigError, match="needs root"):
        lab_up(plan_lab(2, "pair", name="ex4"), fake_runner, tmp_path, is_root=lambda: False)
    with pytest.raises(ConfigError, match="needs root"):
        lab_down("ex4", fake_runner, tmp_path, is_root=lambda: False)
    assert fake_runner.calls == []


def test_down_without_state_file_removes_only_this_labs_namespaces(tmp_path, make_runner):
    others = ["ex5x-mac0", "ex5-macx", "ex5-mac1b", "other", "ex-mac0", "ex5-mac"]
    runner = make_runner(["ex5-mac0", "ex5-mac10", "ex5-mac2", *others])
    assert lab_down("ex5", runner, tmp_path, is_root=ROOT) == ["ex5-mac0", "ex5-mac2", "ex5-mac10"]
    assert runner.namespaces == others


def test_down_uses_state_and_prefix_together(tmp_path, make_runner):
    runner = make_runner()
    plan = plan_lab(3, "chain", name="ex6")
    lab_up(plan, runner, tmp_path, is_root=ROOT)
    runner.namespaces.append("ex6-mac7")  # left over from something older with the same prefix
    assert lab_down("ex6", runner, tmp_path, is_root=ROOT) == ["ex6-mac0", "ex6-mac1", "ex6-mac2", "ex6-mac7"]
    assert runner.namespaces == [] and not state_path("ex6", tmp_path).exists()
    assert lab_down("ex6", runner, tmp_path, is_root=ROOT) == []


def test_netns_list_parsing(make_runner):
    assert parse_netns_list("a-mac0 (id: 3)\nb\n\n") == ["a-mac0", "b"]
    assert lab_namespaces("a", make_runner(["a-mac1", "a-mac0", "ab-mac0"])) == ["a-mac0", "a-mac1"]


def test_counters_read_through_the_namespace():
    argv = counters_argv("n-mac1", ["tb0_0", "tb2_0"])
    assert argv[:5] == ["ip", "netns", "exec", "n-mac1", "cat"]
    assert argv[5:] == ["/sys/class/net/tb0_0/statistics/rx_bytes", "/sys/class/net/tb0_0/statistics/tx_bytes",
                        "/sys/class/net/tb2_0/statistics/rx_bytes", "/sys/class/net/tb2_0/statistics/tx_bytes"]
    assert parse_counters(["tb0_0", "tb2_0"], "10\n20\n30\n40\n") == {"tb0_0": (10, 20), "tb2_0": (30, 40)}
    with pytest.raises(LabCommandError, match="expected 4 byte counters, read 1"):
        parse_counters(["tb0_0", "tb2_0"], "10\n")


def test_read_counters_reports_a_failing_command():
    def runner(argv):
        return CommandResult(1, "", "Cannot open network namespace \"gone\": No such file or directory\n")
    with pytest.raises(LabCommandError, match="No such file"):
        read_counters("gone", ["tb1_0"], runner)
