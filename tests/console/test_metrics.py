"""Throughput math against fixture text: percentiles from merged buckets, rates, resets, stale and
down sources. Fixtures were captured from the SGLang stand-in (real ``sglang:`` names and labels)
and from the real smg 1.13 router's prometheus port after one chat request."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pdctl.console._throughput import render_throughput
from pdctl.console.metrics import (
    Histogram,
    ThroughputTracker,
    counter_rate,
    filter_exposition,
    parse_scrape,
    quantile,
    sparkline,
)

FIX = Path(__file__).parent / "fixtures"


def _text(name: str) -> str:
    return (FIX / name).read_text()


def _hist_text(name: str, label: str, counts: dict[float, int], total_sum: float) -> str:
    lines = [f"# TYPE {name} histogram"]
    for le, c in counts.items():
        les = "+Inf" if math.isinf(le) else repr(le)
        lines.append(f'{name}_bucket{{{label},le="{les}"}} {c}')
    lines.append(f"{name}_sum{{{label}}} {total_sum}")
    lines.append(f"{name}_count{{{label}}} {counts[math.inf]}")
    return "\n".join(lines) + "\n"


def test_quantile_interpolates_inside_the_bucket_like_prometheus():
    h = Histogram(((0.1, 10.0), (0.2, 20.0), (0.4, 40.0), (math.inf, 40.0)), 6.0, 40.0)
    assert quantile(0.5, h) == pytest.approx(0.2)  # rank 20 is the top of (0.1, 0.2]
    assert quantile(0.25, h) == pytest.approx(0.1)
    assert quantile(0.75, h) == pytest.approx(0.3)  # rank 30: halfway through (0.2, 0.4]
    assert quantile(0.05, h) == pytest.approx(0.02)  # first bucket starts at 0


def test_a_rank_in_the_inf_bucket_answers_the_highest_finite_bound():
    h = Histogram(((1.0, 1.0), (math.inf, 10.0)), 50.0, 10.0)
    assert quantile(0.99, h) == 1.0


def test_an_empty_histogram_has_no_quantile():
    assert quantile(0.5, Histogram(((1.0, 0.0), (math.inf, 0.0)))) is None
    assert quantile(0.5, None) is None


def test_percentiles_come_from_merged_buckets_not_averaged_percentiles():
    # Two TP ranks: one fast (100 requests under 0.1 s), one slow (100 requests in (0.8, 1.0]).
    bounds = (0.1, 0.2, 0.4, 0.8, 1.0, math.inf)
    fast = {b: 100 for b in bounds}
    slow = {b: (0 if b < 1.0 else 100) for b in bounds}
    text = _hist_text("sglang:time_to_first_token_seconds", 'tp_rank="0"', fast, 5.0) + _hist_text(
        "sglang:time_to_first_token_seconds", 'tp_rank="1"', slow, 95.0
    ).replace("# TYPE sglang:time_to_first_token_seconds histogram\n", "")
    sc = parse_scrape(text, 0.0)
    h = sc.histograms["sglang:time_to_first_token_seconds"]
    assert h.count == 200 and h.buckets[-1] == (math.inf, 200.0)
    p99 = quantile(0.99, h)
    # The merged p99 lies in the slow rank's bucket; the mean of the two p99s (0.099 and 0.998)
    # would claim ~0.55 s, a latency no request had.
    assert 0.8 < p99 <= 1.0
    p99_fast = quantile(0.99, Histogram(tuple((b, float(c)) for b, c in fast.items())))
    p99_slow = quantile(0.99, Histogram(tuple((b, float(c)) for b, c in slow.items())))
    assert abs(p99 - (p99_fast + p99_slow) / 2) > 0.3


def test_histogram_delta_and_reset():
    old = Histogram(((1.0, 5.0), (math.inf, 6.0)), 3.0, 6.0)
    new = Histogram(((1.0, 8.0), (math.inf, 10.0)), 6.0, 10.0)
    d = new.minus(old)
    assert d.buckets == ((1.0, 3.0), (math.inf, 4.0)) and d.count == 4.0
    restarted = Histogram(((1.0, 1.0), (math.inf, 1.0)), 0.1, 1.0)
    assert restarted.minus(old) is restarted


def test_counter_rate_handles_reset_and_missing():
    assert counter_rate(150.0, 100.0, 5.0) == 10.0
    assert counter_rate(20.0, 100.0, 2.0) == 10.0  # reset: the increase is the new value
    assert counter_rate(None, 1.0, 1.0) is None
    assert counter_rate(1.0, 1.0, 0.0) is None


def test_filter_keeps_only_the_families_the_panel_reads():
    text = _text("smg_metrics.txt")
    kept = filter_exposition(text)
    assert len(kept) < len(text) / 5
    assert "smg_router_requests_total{" in kept and "smg_tokio_" not in kept
    # The filtered text parses the same for what we read.
    a, b = parse_scrape(text, 0.0, only=None), parse_scrape(text, 0.0)
    for name in ("smg_router_requests_total", "smg_http_responses_total", "smg_worker_health"):
        assert a.total(name) == b.total(name)


def test_parse_the_servers_real_metric_names():
    sc = parse_scrape(_text("decode_metrics.txt"), 0.0)
    assert sc.total("sglang:max_total_num_tokens") > 0
    assert sc.total("sglang:prompt_tokens_total") is not None
    assert "sglang:inter_token_latency_seconds" in sc.histograms
    assert "sglang:time_to_first_token_seconds" in sc.histograms
    # engine_type is a label of every series (PD: prefill / decode)
    assert all(dict(labels)["engine_type"] == "decode" for labels, _v in sc.samples["sglang:num_running_reqs"])


def _smg_responses(ok: int, s503: int, s429: int, s499: int) -> str:
    return (
        "# TYPE smg_http_responses_total counter\n"
        f'smg_http_responses_total{{path="/v1/chat/completions",status_code="200",error_code=""}} {ok}\n'
        f'smg_http_responses_total{{path="/v1/chat/completions",status_code="503",error_code="x"}} {s503}\n'
        f'smg_http_responses_total{{path="/v1/chat/completions",status_code="429",error_code="y"}} {s429}\n'
        f'smg_http_responses_total{{path="/v1/chat/completions",status_code="499",error_code="client_closed_request"}} {s499}\n'
        f'smg_http_responses_total{{path="/readiness",status_code="503",error_code="no_healthy_workers"}} {s503 * 10}\n'
        f'smg_http_responses_total{{path="/workers",status_code="404",error_code="x"}} {s429 * 10}\n'
    )


def test_router_server_errors_are_counted_apart_from_client_errors():
    tr = ThroughputTracker(smooth_s=2.0, window_s=10.0)
    tr.observe("router", "router", "u", 100.0, parse_scrape(_smg_responses(7, 2, 1, 4), 100.0))
    s = tr.observe("router", "router", "u", 102.0, parse_scrape(_smg_responses(9, 6, 9, 40), 102.0))
    assert (s.errors, s.client_errors) == (6, 49)
    assert s.err_s == pytest.approx(2.0)  # (6 - 2) 5xx over 2 s; the 4xx (client closed, rate-limited) are not failures
    # the router's own /readiness 503s (while workers start) and probe paths count in neither
    text = "\n".join(t.plain for t in render_throughput((s,), 120).renderables)
    assert "5xx 2.0/s" in text and "5xx 6  4xx 49" in text


def test_a_router_without_path_labels_says_its_errors_include_probe_answers():
    # sglang-router 0.3.2 labels responses {status_code,error_code} only (reference §2.3): its /readiness 503s while
    # workers start cannot be told from failed requests, and were shown as the deployment's server errors unqualified
    legacy = "\n".join(line.replace('path="/v1/chat/completions",', "").replace('path="/readiness",', "")
                        .replace('path="/workers",', "") for line in _smg_responses(9, 6, 9, 40).splitlines()) + "\n"
    tr = ThroughputTracker(smooth_s=2.0, window_s=10.0)
    s = tr.observe("router", "router", "u", 100.0, parse_scrape(legacy, 100.0))
    assert s.errors_include_probes and s.errors == 66  # 6 + the 60 probe 503s it cannot leave out
    text = "\n".join(t.plain for t in render_throughput((s,), 120).renderables)
    assert "(since start incl. probes (no path labels))" in text, text
    s = ThroughputTracker(smooth_s=2.0, window_s=10.0).observe("router", "router", "u", 100.0,
                                                               parse_scrape(_smg_responses(9, 6, 9, 40), 100.0))
    assert not s.errors_include_probes and "incl. probes" not in "\n".join(
        t.plain for t in render_throughput((s,), 120).renderables)


def _server_text(prompt: float, gen: float, ttft_counts: dict[float, int], failed: float = 0.0) -> str:
    lbl = 'engine_type="decode",model_name="m"'
    return (
        "# TYPE sglang:prompt_tokens_total counter\n"
        f"sglang:prompt_tokens_total{{{lbl}}} {prompt}\n"
        "# TYPE sglang:generation_tokens_total counter\n"
        f"sglang:generation_tokens_total{{{lbl}}} {gen}\n"
        "# TYPE sglang:num_running_reqs gauge\n"
        f"sglang:num_running_reqs{{{lbl}}} 3\n"
        "# TYPE sglang:num_queue_reqs gauge\n"
        f"sglang:num_queue_reqs{{{lbl}}} 1\n"
        "# TYPE sglang:token_usage gauge\n"
        f"sglang:token_usage{{{lbl}}} 0.25\n"
        "# TYPE sglang:num_transfer_failed_reqs_total counter\n"
        f"sglang:num_transfer_failed_reqs_total{{{lbl}}} {failed}\n"
        + _hist_text("sglang:time_to_first_token_seconds", lbl, ttft_counts, 1.0)
    )


def test_tracker_rates_window_percentiles_and_history():
    tr = ThroughputTracker(smooth_s=2.0, window_s=10.0)
    b = (0.1, 0.2, 0.4, math.inf)
    s0 = tr.observe("decode", "decode", "u", 100.0, parse_scrape(_server_text(0, 0, dict.fromkeys(b, 0)), 100.0))
    assert s0.state == "ok" and s0.gen_tok_s is None  # one scrape: no rate yet
    tr.observe("decode", "decode", "u", 101.0, parse_scrape(_server_text(100, 50, {0.1: 0, 0.2: 10, 0.4: 10, math.inf: 10}), 101.0))
    s2 = tr.observe("decode", "decode", "u", 102.0, parse_scrape(_server_text(200, 100, {0.1: 0, 0.2: 10, 0.4: 20, math.inf: 20}), 102.0))
    assert s2.input_tok_s == pytest.approx(100.0)  # 200 prompt tokens over 2 s
    assert s2.gen_tok_s == pytest.approx(50.0)
    assert (s2.running, s2.queued, s2.kv_usage) == (3.0, 1.0, 0.25)
    assert s2.ttft_s[0] == pytest.approx(0.2)  # 20 observations: 10 in (0.1,0.2], 10 in (0.2,0.4]
    assert not s2.pct_all_time
    assert s2.history[-1] == pytest.approx(50.0) and len(s2.history) == 3


def test_a_source_going_down_keeps_its_last_numbers_marked_down_then_recovers():
    tr = ThroughputTracker(smooth_s=1.0, stale_after_s=3.0)
    b = {0.1: 1, math.inf: 1}
    tr.observe("prefill", "prefill", "u", 10.0, parse_scrape(_server_text(0, 0, b), 10.0))
    ok = tr.observe("prefill", "prefill", "u", 11.0, parse_scrape(_server_text(500, 0, b), 11.0))
    assert ok.input_tok_s == pytest.approx(500.0)
    down = tr.observe("prefill", "prefill", "u", 12.0, None, "connection refused")
    assert down.state == "down" and down.error == "connection refused"
    assert down.input_tok_s == pytest.approx(500.0)  # last numbers kept
    assert down.age_s == pytest.approx(1.0)
    assert down.history[-1] is None  # a gap in the sparkline
    stale = tr.mark("prefill", 20.0)
    assert stale is not None and stale.state == "down"
    back = tr.observe("prefill", "prefill", "u", 21.0, parse_scrape(_server_text(600, 0, b), 21.0))
    assert back.state == "ok" and back.error is None


def test_a_source_without_a_recent_scrape_is_stale():
    tr = ThroughputTracker(stale_after_s=3.0)
    tr.observe("router", "router", "u", 0.0, parse_scrape(_text("smg_metrics.txt"), 0.0))
    assert tr.mark("router", 1.0).state == "ok"
    assert tr.mark("router", 10.0).state == "stale"


def test_router_sample_from_real_smg_text():
    tr = ThroughputTracker()
    s = tr.observe("router", "router", "u", 0.0, parse_scrape(_text("smg_metrics.txt"), 0.0))
    assert (s.workers_healthy, s.workers_total) == (2, 2)
    assert s.errors == 0


def test_sparkline_scales_pads_and_resamples():
    assert sparkline([], 4) == "    "
    assert sparkline([0, 1, 2, 4], 4) == "▁▃▅█"
    assert sparkline([None, 4], 3) == "  █"
    line = sparkline([1.0] * 50 + [8.0] + [1.0] * 49, 10)
    assert len(line) == 10 and "█" in line  # a burst survives resampling


def test_percentiles_inside_the_first_bucket_read_as_at_most_its_bound():
    # (any TTFT under SGLang's first 100 ms bound read "TTFT 50/90/99ms": interpolation from 0 inside the bucket)
    tr = ThroughputTracker(smooth_s=2.0, window_s=10.0)
    tr.observe("prefill", "prefill", "u", 100.0, parse_scrape(_server_text(0, 0, {0.1: 0, 0.2: 0, math.inf: 0}), 100.0))
    s = tr.observe("prefill", "prefill", "u", 102.0, parse_scrape(_server_text(10, 0, {0.1: 6, 0.2: 6, math.inf: 6}), 102.0))
    assert s.ttft_s[0] == pytest.approx(0.05) and s.ttft_first_bound_s == pytest.approx(0.1)  # the estimate is kept
    text = "\n".join(t.plain for t in render_throughput((s,), 120).renderables)
    assert "TTFT ≤100ms" in text and "50/90/99" not in text, text
    # the median inside the first bucket, the tail beyond it: each said as it is known
    s = tr.observe("prefill", "prefill", "u", 104.0, parse_scrape(_server_text(20, 0, {0.1: 12, 0.2: 16, math.inf: 16}), 104.0))
    text = "\n".join(t.plain for t in render_throughput((s,), 120).renderables)
    assert "TTFT ≤100/160/196ms" in text, text  # window: 6 of 10 in (0, 0.1], 4 in (0.1, 0.2]


def test_a_long_role_name_keeps_its_own_column_apart_from_the_state():
    # (helper-99: a 9-character role read "prefill-1ok" in the Throughput tab)
    tr = ThroughputTracker(smooth_s=2.0, window_s=10.0)
    long = tr.observe("prefill-extra-long-name", "prefill", "u", 100.0, parse_scrape("", 100.0))
    short = tr.observe("router", "router", "u", 100.0, parse_scrape(_smg_responses(1, 0, 0, 0), 100.0))
    lines = [t.plain for t in render_throughput((long, short), 120).renderables]
    assert lines[0].startswith(f"prefill-extra-long-name {long.state}"), lines
    assert lines[2].startswith(f"router{' ' * 18}{short.state}"), lines
    assert lines[1].startswith(" " * 24) and not lines[1][24:25].isspace(), lines
