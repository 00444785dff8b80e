"""The console's steps panel says what a role still loading said last (issue 40 item 5): its elapsed time against
``expected_cold_start_s`` and its last log line, in the running step's row. Real processes: the SGLang stand-in
(loading for seconds) under the process supervisor and the real smg router."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdctl.console._confirm import YesNoScreen
from pdctl.console._steps import StepsPanel
from pdctl.console.app import ConsoleApp
from pdctl.console.views import StepView, loading_summary, with_progress

from .conftest import ConsoleDemo, wait_for


def test_a_running_rows_summary_is_its_roles_last_progress_and_no_other_rows():
    steps = (StepView("kernels_built", "skipped", "skipped: disabled in spec"), StepView("prefill_up", "running",
                                                                                       "running…"),
             StepView("decode_up", "pending"))
    text = loading_summary({"role": "prefill", "elapsed_s": 12.4, "expected_cold_start_s": 600,
                            "log_line": "Load weight begin."})
    assert text == "prefill loading 12s of ~10m00s · Load weight begin."
    assert loading_summary({"role": "decode", "elapsed_s": 3, "expected_cold_start_s": None, "log_line": ""}) == \
        "decode loading 3.0s · (no log line yet)"
    shown = with_progress(steps, {"prefill_up": text, "kernels_built": "stale"})
    assert [s.summary for s in shown] == ["skipped: disabled in spec", text, ""]


@pytest.mark.smg
@pytest.mark.slow
async def test_the_steps_panel_shows_a_loading_roles_elapsed_time_and_last_log_line(tmp_path):
    def slow(d: dict) -> None:
        d["engine"]["env"]["PDCTL_SIM_LOAD_SECONDS"] = "4"
        d["prefill"][0]["expected_cold_start_s"] = 60

    demo = ConsoleDemo(tmp_path, slow)
    try:
        app = ConsoleApp(demo.load(), refresh_s=0.3, nvml=False,
                         timeouts=replace(demo.timeouts(), progress=0.5))
        seen: list[str] = []

        def prefill_row() -> StepView:
            row = next(s for s in app.query_one(StepsPanel).steps if s.name == "prefill_up")
            if row.status == "running":
                seen.append(row.summary)
            return row

        async with app.run_test(size=(120, 30)) as pilot:
            await wait_for(pilot, lambda: app.plan is not None, timeout=20)
            await pilot.press("a")
            await wait_for(pilot, lambda: isinstance(app.screen, YesNoScreen))
            await pilot.press("y")
            # (until a summary names a log line: the first, before the engine logged, says it has none)
            await wait_for(pilot, lambda: prefill_row().summary.startswith("prefill loading ")
                           and not prefill_row().summary.endswith("(no log line yet)"), timeout=60)
            await wait_for(pilot, lambda: not app.applying, timeout=150)
            assert app.last_apply_error is None, app.last_apply_error
            assert prefill_row().status == "done"  # (its proof's summary again once proven)
            assert not prefill_row().summary.startswith("prefill loading")
        log = (demo.state / "supervisor" / "services" / f"pdctl-{demo.name}-prefill.service" / "output.log")
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
        loading = [s for s in seen if s.startswith("prefill loading ")]
        assert any(" of ~1m00s · " in s and s.split(" · ", 1)[1] in lines for s in loading), (loading, lines[-10:])
    finally:
        demo.down()
