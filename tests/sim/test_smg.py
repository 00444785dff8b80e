"""End to end with the real smg router (1.13.0) in PD mode in front of a stand-in prefill + decode."""

from __future__ import annotations

import json
import urllib.request

import pytest

from harness.sim import http_get, http_post, pd_pair, smg_binary, sse_events, start_smg

pytestmark = pytest.mark.smg

PARSERS = ["--reasoning-parser", "deepseek-v3", "--tool-call-parser", "deepseekv32", "--enable-metrics"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["city", "days"]}}}]
CHAT = {"model": "deepseek-ai/DeepSeek-V3.2", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": TOOLS, "chat_template_kwargs": {"thinking": True}}


@pytest.fixture(scope="module")
def stack():
    try:
        smg_binary()
    except FileNotFoundError:
        from harness import skip_or_fail

        skip_or_fail("smg binary not installed")
    p, d = pd_pair(PARSERS)
    r = None
    try:
        r = start_smg(["--pd-disaggregation", "--prefill", p.url, str(p.bootstrap_port), "--decode", d.url,
                       "--health-check-interval-secs", "1", "--shutdown-grace-period-secs", "0"])
        r.wait_ready(2, timeout=60)
        yield p, d, r
    finally:
        if r is not None:
            r.stop()
        p.stop()
        d.stop()


def test_workers_registered_healthy_with_roles(stack):
    p, d, r = stack
    workers = r.workers()["workers"]
    by_url = {w["url"]: w for w in workers}
    assert by_url[p.url]["worker_type"] == "prefill" and by_url[p.url]["is_healthy"]
    assert by_url[p.url]["bootstrap_port"] == p.bootstrap_port
    assert by_url[d.url]["worker_type"] == "decode" and by_url[d.url]["is_healthy"]
    assert http_get(r.url + "/readiness")[0] == 200
    # smg read the workers' metadata from /server_info and /model_info
    log = p.log_text()
    for probe in ('"GET /health HTTP/1.1" 200', '"GET /server_info HTTP/1.1" 200', '"GET /model_info HTTP/1.1" 200'):
        assert probe in log, probe


def test_chat_with_tools_and_thinking_through_router(stack):
    p, d, r = stack
    code, out = http_post(r.url + "/v1/chat/completions", CHAT)
    assert code == 200, out
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"]
    (tc,) = choice["message"]["tool_calls"]
    assert tc["function"]["name"] == "get_weather"
    args = json.loads(tc["function"]["arguments"])
    assert isinstance(args["city"], str) and 1 <= args["days"] <= 5
    # both engines saw the request (router sends the same body to both, bootstrap fields injected)
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in p.log_text()
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in d.log_text()


def test_generate_through_router_matches_decode_directly(stack):
    p, d, r = stack
    body = {"text": "route me", "sampling_params": {"max_new_tokens": 6}}
    code, out = http_post(r.url + "/generate", body)
    assert code == 200 and len(out["output_ids"]) == 6
    code, m = http_get(p.url + "/metrics")
    assert b"sglang:kv_transfer_latency_ms_count" in m


def test_streaming_chat_through_router(stack):
    _, _, r = stack
    req = urllib.request.Request(r.url + "/v1/chat/completions", data=json.dumps({**CHAT, "stream": True}).encode(),
                                 headers={"content-type": "application/json"})
    events = list(sse_events(urllib.request.urlopen(req, timeout=30).read()))
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e.get("choices")]
    assert any(dl.get("reasoning_content") for dl in deltas)
    assert any(dl.get("tool_calls") for dl in deltas)


def test_router_health_generate_checks_the_pair(stack):
    _, _, r = stack
    code, body = http_get(r.url + "/health_generate")
    assert code == 200 and b"passed" in body


def test_wrong_bootstrap_port_fails_requests_through_router():
    """The router passes the --prefill URL's port as bootstrap_port; a wrong one fails on decode."""
    from harness.sim import free_port

    p, d = pd_pair([], {"PDCTL_SIM_ENSURE_RETRY_INTERVAL": "0.02"})
    r = None
    try:
        r = start_smg(["--pd-disaggregation", "--prefill", p.url, str(free_port()), "--decode", d.url,
                       "--health-check-interval-secs", "1", "--shutdown-grace-period-secs", "0",
                       "--disable-retries"])
        r.wait_ready(2, timeout=60)  # health checks never touch the KV link
        code, out = http_post(r.url + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}})
        assert code >= 500
        assert "Decode handshake failed" in d.log_text()
        assert "Could not fetch prefill parallel info" in d.log_text()
    finally:
        if r is not None:
            r.stop()
        p.stop()
        d.stop()
