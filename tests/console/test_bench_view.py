"""The console's view of a saved ``pdctl bench`` result (issue 42 item 5), from a real AIPerf run recorded once
(``tests/statemachine/fixtures/bench/README.md``): the table ``pdctl bench`` prints and the throughput tab's block."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from pdctl.console.bench_view import bench_summary, bench_table

RECORDED = Path(__file__).parents[1] / "statemachine" / "fixtures" / "bench" / "results.json"


def _text(renderable, width: int = 80) -> str:  # noqa: ANN001
    con = Console(width=width, record=True, color_system=None)
    con.print(renderable)
    return con.export_text()


def test_the_table_has_a_row_per_level_with_throughput_and_percentiles_in_80_columns():
    res = json.loads(RECORDED.read_text())
    lines = _text(bench_table(res)).splitlines()
    assert lines[0].split() == ["conc", "reqs", "err", "out", "tok/s", "req/s", "TTFT", "p50", "p90", "p99", "ITL",
                                "p50", "p90", "p99"]
    assert lines[3].split() == ["16", "128", "0", "5,857.9", "185.0", "59.5", "77.0", "85.5", "0.103", "0.444",
                                "0.640"]
    assert max(len(x) for x in lines) <= 80


def test_the_throughput_tab_block_says_when_which_plan_and_that_it_is_the_stand_in():
    res = {**json.loads(RECORDED.read_text()), "dir": "/state/bench/20261205T135450.272409Z"}
    text = _text(bench_summary(res, current_plan=res["plan_id"]), width=100)
    assert "last bench 2026-12-05 13:54:50 UTC  ISL 256 / OSL 128  plan a147b3dfdb9718c5" in text
    assert "stand-in" in text and "aiperf 0.13.0" in text and res["dir"] in text
    assert "(now plan" not in text
    moved = " ".join(_text(bench_summary(res, current_plan="0123456789abcdef"), width=100).split())
    assert "(now plan 0123456789abcdef)" in moved


def test_without_a_saved_result_the_block_says_how_to_make_one_and_that_the_console_starts_none():
    assert "`pdctl bench SPEC` runs one (the console starts no load)" in _text(bench_summary(None), width=100)
