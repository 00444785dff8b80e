"""View models: step rows from the journal, log tails that follow."""

from __future__ import annotations

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
