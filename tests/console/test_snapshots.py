"""SVG snapshots of the console at 80x24 (the smallest terminal it supports) and one larger size.

Deterministic: no worker runs (``live=False``), the clock is fixed, and every panel is fed fixed
samples (a journal with fixed times, fixed throughput samples, a fixed GPU sample or the no-GPU
state). Update with ``pytest tests/console/test_snapshots.py --snapshot-update`` and review the
SVGs in ``__snapshots__``.
"""

from __future__ import annotations

import pytest

from pdctl.console.app import ConsoleApp
from pdctl.console.collect import gpu_owners

from .conftest import FIXED_NOW, ConsoleDemo, demo_dict, dump_toml, fixed_gpu, fixed_snapshot


@pytest.fixture
def spec(tmp_path):
    """The demo spec with its fixed name and ports, in a temporary state directory."""
    p = tmp_path / "demo.toml"
    p.write_text(dump_toml(demo_dict()))
    return p


def _app(spec, tmp_path, *, deployed_mutation=None, gpu=False, readonly=False, tab=None, bench=None):  # noqa: ANN001, ANN202
    from pdctl.statemachine.service import load, plan_spec

    state = tmp_path / "state"
    if deployed_mutation is not None:
        d = ConsoleDemo.__new__(ConsoleDemo)
        d.dict, d.tmp, d.state, d.name, d.spec = demo_dict(), tmp_path, state, "demo", spec
        d.pretend_deployed(deployed_mutation)
    loaded = load(spec, state_dir=state)
    app = ConsoleApp(loaded, live=False, clock=lambda: FIXED_NOW, nvml=False, readonly=readonly)
    snap = fixed_snapshot(loaded, gpu=fixed_gpu(gpu_owners(loaded.deployment, fixed_snapshot(loaded).topology)) if gpu else None)
    if bench is not None:
        import dataclasses

        snap = dataclasses.replace(snap, bench=bench)
    plan = plan_spec(loaded)

    async def before(pilot) -> None:  # noqa: ANN001
        pilot.app.show_snapshot(snap)
        pilot.app.on_console_app_planned(ConsoleApp.Planned(loaded, plan, None))
        await pilot.pause()
        if tab is not None:  # the tab's own key, and the shot taken once it shows (under CI load a pressed "3"
            # was screenshotted before the switch: the main tab came out)
            from textual.widgets import TabbedContent

            await pilot.press({"gpu": "2", "throughput": "3"}[tab])
            for _ in range(100):  # (bounded: 5 s)
                if pilot.app.query_one(TabbedContent).active == tab:
                    break
                await pilot.pause(0.05)
            await pilot.pause()

    return app, before


def _gpus_changed(d: dict) -> None:
    d["prefill"][0]["gpus"] = [0, 1]
    d["prefill"][0]["tp"] = 2


def test_main_screen_with_a_pending_topology_change(snap_compare, spec, tmp_path):
    app, before = _app(spec, tmp_path, deployed_mutation=_gpus_changed)
    assert snap_compare(app, terminal_size=(80, 24), run_before=before)


def test_gpu_panel_without_nvml(snap_compare, spec, tmp_path):
    app, before = _app(spec, tmp_path, tab="gpu")
    assert snap_compare(app, terminal_size=(80, 24), run_before=before)


def test_gpu_panel_with_gpus_and_an_affinity_mismatch(snap_compare, spec, tmp_path):
    app, before = _app(spec, tmp_path, gpu=True, tab="gpu")
    assert snap_compare(app, terminal_size=(100, 30), run_before=before)


def test_throughput_panel_with_a_router_down(snap_compare, spec, tmp_path):
    app, before = _app(spec, tmp_path, tab="throughput")
    assert snap_compare(app, terminal_size=(80, 24), run_before=before)


def test_throughput_panel_with_a_saved_bench_result(snap_compare, spec, tmp_path):
    """The newest ``pdctl bench`` result below the live figures (issue 42 item 5): a real AIPerf run's, recorded once
    (tests/statemachine/fixtures/bench), of another plan than the fixed journal's."""
    import json
    from pathlib import Path

    res = json.loads((Path(__file__).parents[1] / "statemachine/fixtures/bench/results.json").read_text())
    app, before = _app(spec, tmp_path, tab="throughput", bench={**res, "dir": "/state/bench/20261205T135450.272409Z"})
    assert snap_compare(app, terminal_size=(100, 40), run_before=before)


def test_step_proof(snap_compare, spec, tmp_path):
    app, before = _app(spec, tmp_path)
    assert snap_compare(app, terminal_size=(80, 24), run_before=before, press=["down", "down", "down", "enter"])


def test_topology_confirmation_modal(snap_compare, spec, tmp_path):
    app, before = _app(spec, tmp_path, deployed_mutation=_gpus_changed)
    assert snap_compare(app, terminal_size=(80, 24), run_before=before, press=["a", *"dem"])


def test_readonly_footer(snap_compare, spec, tmp_path):
    app, before = _app(spec, tmp_path, readonly=True)
    assert snap_compare(app, terminal_size=(80, 24), run_before=before)
