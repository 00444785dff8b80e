"""Progress while a role loads (issue 40 item 5): every ``Timeouts.progress`` seconds of a role's wait, a
``progress`` event with its elapsed time against ``expected_cold_start_s`` and the last line its log holds. Real
processes: the SGLang stand-in (loading for seconds) under pdctl's process supervisor and the real smg router."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pdctl.statemachine.events import ListSink
from pdctl.statemachine.steps import PROGRESS_LINE_CHARS

pytestmark = [pytest.mark.smg, pytest.mark.slow]


def _output_log(demo, role: str) -> list[str]:  # noqa: ANN001
    """The role's log as the process supervisor wrote it, read here whole."""
    path = demo.state / "supervisor" / "services" / f"pdctl-{demo.name}-{role}.service" / "output.log"
    return [line.strip() for line in path.read_text(errors="replace").splitlines()]


def _slow_prefill(load_s: str):  # noqa: ANN202
    def mutate(d: dict) -> None:
        d["engine"]["env"]["PDCTL_SIM_LOAD_SECONDS"] = load_s
        d["prefill"][0]["expected_cold_start_s"] = 60
    return mutate


def test_a_loading_role_reports_elapsed_against_its_expected_cold_start_and_its_last_log_line(make_demo):
    demo = make_demo(_slow_prefill("3"))
    sink = ListSink()
    result = demo.apply(sink=sink, timeouts=replace(demo.timeouts(), progress=0.5))
    assert result.state == "parsers_configured"
    loading = [e for e in sink.events if e.kind == "progress"]
    prefill = [e for e in loading if e.data["role"] == "prefill"]
    assert len(prefill) >= 3, [e.message for e in loading]  # (3 s of loading, said every 0.5 s)
    assert all(e.step == "prefill_up" and e.data["unit"] == f"pdctl-{demo.name}-prefill.service" for e in prefill)
    elapsed = [e.data["elapsed_s"] for e in prefill]
    assert elapsed == sorted(elapsed) and elapsed[0] >= 0.5 and elapsed[-1] >= 2, elapsed
    assert all(e.data["expected_cold_start_s"] == 60 for e in prefill)
    assert "of an expected cold start of 60 s" in prefill[-1].message, prefill[-1].message
    # each line said is one the prefill's own log holds (read here whole), and the message quotes it
    log = _output_log(demo, "prefill")
    said = [e for e in prefill if e.data["log_line"]]
    assert said, [e.message for e in prefill]
    for e in said:
        assert e.data["log_line"] in log, (e.data["log_line"], log[-10:])
        line = e.data["log_line"]  # (quoted whole up to PROGRESS_LINE_CHARS; the supervisor's argv line is longer)
        quoted = line if len(line) <= PROGRESS_LINE_CHARS else line[:PROGRESS_LINE_CHARS - 1] + "…"
        assert e.message.endswith(f"last log line: {quoted}"), e.message
    # decode sets no expected cold start: said against the wait's bound instead
    for e in (e for e in loading if e.data["role"] == "decode"):
        assert e.step == "decode_up" and e.data["expected_cold_start_s"] is None
        assert "(no expected_cold_start_s; waiting up to 60 s)" in e.message, e.message
    # progress comes while the step runs: after its step_started, before its step_verified
    kinds = [(e.kind, e.step) for e in sink.events]
    first = kinds.index(("progress", "prefill_up"))
    assert kinds.index(("step_started", "prefill_up")) < first < kinds.index(("step_verified", "prefill_up"))


def test_apply_json_streams_progress_events_and_the_text_reporter_says_them(make_demo, capsys):
    # the CLI's own interval (Timeouts' default, 5 s) against a stand-in that loads for 6 s
    demo = make_demo(_slow_prefill("6"))
    r = demo.cli("apply", str(demo.spec), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    events = [json.loads(line) for line in r.stdout.splitlines()]
    loading = [e for e in events if e["kind"] == "progress" and e["data"]["role"] == "prefill"]
    assert loading, [e["kind"] for e in events]
    e = loading[0]
    assert e["step"] == "prefill_up" and 5 <= e["data"]["elapsed_s"] < 60 and e["elapsed_s"] >= 5
    assert e["data"]["expected_cold_start_s"] == 60
    assert e["data"]["log_line"] and e["data"]["log_line"] in _output_log(demo, "prefill")
    # the text output renders the same event as one line on stderr
    from pdctl.console.cli import _Reporter
    from pdctl.statemachine.events import Event

    _Reporter(as_json=False).emit(Event(e["kind"], e["message"], step=e["step"], elapsed_s=e["elapsed_s"],
                                        data=e["data"]))
    err = capsys.readouterr().err
    assert err == f"… {e['message']}\n", err
    assert "prefill loading: " in err and "of an expected cold start of 60 s; last log line: " in err
