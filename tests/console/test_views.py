"""View models: step rows from the journal, log tails that follow."""

from __future__ import annotations

import io

from pdctl.console.views import fmt_duration, new_lines, step_views
from pdctl.statemachine.journal import JournalState, StepRecord
from pdctl.statemachine.machine import PD_STATES


def test_every_step_has_a_row_pending_until_the_journal_says_otherwise():
    rows = step_views(PD_STATES, None, 0.0)
    assert [r.name for r in rows] == list(PD_STATES)
    assert {r.status for r in rows} == {"pending"}


def test_rows_carry_summary_elapsed_age_and_the_running_step_ticks():
    j = JournalState(name="demo")
    j.steps["kernels_built"] = StepRecord("skipped", {"summary": "skipped: disabled in spec"}, None, 100.0, 100.5)
    j.steps["prefill_up"] = StepRecord("failed", None, "prefill not healthy", 101.0, 104.0)
    j.steps["decode_up"] = StepRecord("running", None, None, 105.0, None)
    rows = {r.name: r for r in step_views(PD_STATES, j, 110.0, {"prefill_up": "check the log"})}
    assert rows["kernels_built"].summary == "skipped: disabled in spec"
    assert rows["kernels_built"].elapsed_s == 0.5 and rows["kernels_built"].age_s == 9.5
    assert rows["prefill_up"].summary == "prefill not healthy" and rows["prefill_up"].hint == "check the log"
    assert rows["decode_up"].elapsed_s == 5.0 and rows["decode_up"].summary == "running…"
    assert rows["router_exposed"].status == "pending"


def test_an_interrupted_step_says_what_stopped_it_in_its_row_and_proof_aligned():
    # (its row was blank, "interrupted" pushed the elapsed column out of line, the proof said only "took 1.3s")
    from rich.console import Console

    from pdctl.console._proof import render_proof
    from pdctl.console._steps import render_steps
    from pdctl.statemachine.journal import INTERRUPTED_SUMMARY

    j = JournalState(name="demo")
    j.steps["kernels_built"] = StepRecord("skipped", {"summary": "skipped: disabled in spec"}, None, 100.0, 100.5)
    j.steps["prefill_up"] = StepRecord("interrupted", None, None, 101.0, 102.3)
    rows = step_views(PD_STATES, j, 110.0)
    assert rows[1].summary == INTERRUPTED_SUMMARY
    lines = render_steps(rows, None, 200).plain.splitlines()
    assert "the next apply resumes it" in lines[1]
    assert len({line.index("s ", 30) for line in lines[:2]}) == 1, lines  # the elapsed column stays aligned
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(render_proof(rows[1]))
    assert "stopped by Ctrl-C, a signal or the console" in console.export_text()


def test_fmt_duration():
    assert [fmt_duration(x) for x in (None, 0.44, 12.2, 185, 7440)] == ["-", "0.4s", "12s", "3m05s", "2h04m"]


def test_log_tail_appends_only_new_lines():
    assert new_lines((), ("a", "b")) == (("a", "b"), False)
    assert new_lines(("a", "b", "c"), ("a", "b", "c")) == ((), False)
    assert new_lines(("a", "b", "c"), ("b", "c", "d")) == (("d",), False)
    assert new_lines(("a", "b", "c"), ("c", "d", "e")) == (("d", "e"), False)
    assert new_lines(("a", "b"), ("a", "b", "c")) == (("c",), False)  # tail not yet full


def test_a_rotated_log_is_shown_afresh():
    assert new_lines(("a", "b", "c"), ("x", "y")) == (("x", "y"), True)


def test_the_topology_panel_keeps_each_prefill_groups_kv_pair_apart():
    # (two prefill groups ran together: "… via bootstrap 127.0.0.1:37098nixl: prefill-1 ⇢ decode …")
    import copy

    from rich.console import Console

    from pdctl.console._topology import render_topology
    from pdctl.statemachine.spec import parse_spec
    from pdctl.statemachine.topology import topology_of

    from ..statemachine.specs import seed_dict

    d = seed_dict()
    extra = copy.deepcopy(d["prefill"][0])
    extra.update(gpus=[8, 9, 10, 11], port=30011, bootstrap_port=8999, nccl_port=30111)
    d["prefill"].append(extra)
    out = io.StringIO()
    Console(file=out, width=400).print(render_topology(topology_of(parse_spec(d))))
    line = next(x for x in out.getvalue().splitlines() if "KV link" in x)
    assert line.rstrip().endswith(": prefill ⇢ decode via bootstrap 127.0.0.1:8998; prefill-1 ⇢ decode via bootstrap "
                                  "127.0.0.1:8999"), line


def test_the_topology_panel_says_a_kept_role_and_one_removed_already_as_the_plan_does():
    # during an interrupted change the prefill row was marked "=" (kept) while the line under it said "+ prefill: new
    # prefill", and a role the apply had removed already read "stopped and removed"
    import copy

    from rich.console import Console

    from pdctl.console._topology import render_topology
    from pdctl.statemachine.plan import NOT_INSTALLED, Runs, make_plan
    from pdctl.statemachine.spec import parse_spec
    from pdctl.statemachine.topology import topology_of

    from ..statemachine.specs import seed_dict

    d = seed_dict()
    wider = copy.deepcopy(d)
    extra = copy.deepcopy(d["decode"][0])
    extra.update(gpus=[8, 9, 10, 11], port=30021, nccl_port=30121)
    wider["decode"].append(extra)
    deployed, desired = topology_of(parse_spec(wider)), topology_of(parse_spec(d))
    kept = "the unfinished apply started it with this spec's definition and proved it"
    def shown(plan) -> str:  # noqa: ANN001
        out = io.StringIO()
        Console(file=out, width=400).print(render_topology(desired, plan))
        return out.getvalue()

    text = shown(make_plan(None, desired, runs={"prefill": Runs(kept=kept)}))  # (a first deployment, interrupted)
    assert f"= prefill: kept ({kept})" in text and "prefill: new prefill" not in text, text
    assert "+ decode: new decode" in text, text
    text = shown(make_plan(deployed, desired, not_running={"decode-1": NOT_INSTALLED}))
    assert "- decode-1: removed already, nothing left to stop" in text and "decode-1: stopped and removed" not in text, text
    assert "decode-1: stopped and removed" in shown(make_plan(deployed, desired))


def test_the_topology_panel_says_why_a_unit_is_failed_or_waiting_to_restart():
    # the panel showed "failed" for a unit past its start limit and "activating" for a crashed server waiting its
    # RestartSec, where `pdctl status` said why
    from rich.console import Console

    from pdctl.console._topology import render_topology
    from pdctl.console.views import state_word
    from pdctl.statemachine.spec import parse_spec
    from pdctl.statemachine.topology import topology_of
    from pdctl.units import ServiceStatus

    from ..statemachine.specs import seed_dict

    topo = topology_of(parse_spec(seed_dict()))
    services = {"prefill": ServiceStatus(name="p", state="activating", restarts=1, sub_state="auto-restart"),
                "decode": ServiceStatus(name="d", state="failed", restarts=5, sub_state="start-limit-hit")}
    out = io.StringIO()
    Console(file=out, width=400).print(render_topology(topo, services=services))
    rows = {x.split()[0]: x for x in out.getvalue().splitlines() if x.split()[:1] in (["prefill"], ["decode"])}
    assert "activating (auto-restart) ↻1" in rows["prefill"], rows
    assert "failed (start-limit-hit) ↻5" in rows["decode"], rows
    # starting, or a failure with nothing more to say: the state alone
    assert state_word("activating", "start") == "activating"
    assert state_word("failed", "failed") == "failed"
    assert state_word("active", "running") == "active"


def test_status_text_columns_fit_a_long_role_name():
    # (helper-100: "decode-longname-b22 inactive" pushed the later columns out of line)
    from pdctl.console.cli import _status_text

    def role(name: str) -> dict:
        return {"name": name, "kind": "decode", "unit": f"pdctl-x-{name}.service", "state": "active", "main_pid": 12,
                "restarts": 0, "sub_state": "running", "url": "http://127.0.0.1:1", "health": 200, "error": None,
                "port_owned": True, "supervised": True, "healthy": True}

    st = {"deployment": "x", "mode": "pd", "recorded_mode": "pd", "deployed": True, "applying": False, "healthy": True,
          "matches_spec": True, "reached": "parsers_configured", "roles": [role("prefill"), role("decode-longname-b22")],
          "router": None, "leftover": [], "removed": [], "steps": {}}
    lines = _status_text(st).splitlines()[1:]
    assert [line.index(" active") for line in lines] == [len("  decode-longname-b22")] * 2, lines
    assert len({line.index("pid") for line in lines}) == 1, lines
