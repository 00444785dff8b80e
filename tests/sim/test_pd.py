"""Prefill-decode disaggregation in the stand-in: bootstrap server, paired requests, KV transfer and
the failure modes SGLang 0.5.23 has (disaggregation/common/conn.py, disaggregation/decode.py)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.sim import free_port, http_get, http_post, pd_pair, start_sim, wait_http

ROUTE_Q = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
FAST_FAIL = {"PDCTL_SIM_ENSURE_RETRY_INTERVAL": "0.02", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "1",
             "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "2"}


@pytest.fixture(scope="module")
def pair():
    p, d = pd_pair(["--enable-metrics"], FAST_FAIL)
    try:
        yield p, d
    finally:
        p.stop()
        d.stop()


def counter(url: str, name: str) -> float:
    code, body = http_get(url + "/metrics")
    assert code == 200
    for fam in text_string_to_metric_families(body.decode()):
        if fam.name == name:
            return sum(s.value for s in fam.samples if s.name == name + "_total")
    raise AssertionError(f"{name} missing")


def gauge(url: str, name: str) -> float:
    code, body = http_get(url + "/metrics")
    assert code == 200
    fam = next((f for f in text_string_to_metric_families(body.decode()) if f.name == name), None)
    assert fam is not None, f"{name} missing"
    return sum(s.value for s in fam.samples)


def wait_until(pred, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"not seen in {timeout} s: {what}"
        time.sleep(0.05)


def paired(p, d, body: dict, path: str = "/generate") -> tuple[tuple, tuple]:
    """Send the same body to prefill and decode concurrently, as the router does."""
    out: dict[str, tuple] = {}

    def go(key, url):
        out[key] = http_post(url + path, body, timeout=30)

    ts = [threading.Thread(target=go, args=(k, u)) for k, u in (("p", p.url), ("d", d.url))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(40)
    return out["p"], out["d"]


def test_bootstrap_server_routes(pair):
    p, _ = pair
    assert http_get(p.bootstrap_url + "/health") == (200, b"OK")
    code, body = http_get(p.bootstrap_url + ROUTE_Q)
    assert code == 200
    info = json.loads(body)
    assert info["page_size"] == 64 and info["kv_cache_dtype"] == "bfloat16"  # DeepSeek DSA default
    assert info["attn_tp_size"] == 1 and info["dp_size"] == 1 and info["pp_size"] == 1
    assert info["follow_bootstrap_room"] is True and info["prefill_http_port"] == p.port
    assert http_get(p.bootstrap_url + "/route?prefill_dp_rank=-1") == (400, b"Missing inputs for bootstrap server.")
    assert http_get(p.bootstrap_url + "/nothing")[0] == 404


def test_route_registers_the_kv_cache_dtype_as_server_args_hold_it():
    # register_to_bootstrap sends server_args.kv_cache_dtype: "auto" for a model without the DSA override (the
    # stand-in had reported "bfloat16" there, which no /server_info of the decode showed)
    p, d = pd_pair(["--model-path", "deepseek-ai/DeepSeek-V3"], FAST_FAIL)
    try:
        info = json.loads(http_get(p.bootstrap_url + ROUTE_Q)[1])
        dinfo = json.loads(http_get(d.url + "/server_info")[1])
        assert info["kv_cache_dtype"] == dinfo["kv_cache_dtype"] == "auto"
        code, _ = paired(p, d, {"text": "hi", "sampling_params": {"max_new_tokens": 4},
                                "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port,
                                "bootstrap_room": 7})[1]
        assert code == 200
    finally:
        p.stop()
        d.stop()


def test_bootstrap_503_until_ranks_registered_then_200():
    bport = free_port()
    p = start_sim(["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bport),
                   "--tp-size", "2"], {"PDCTL_SIM_LOAD_SECONDS": "1.5"}, wait=False)
    try:
        url = f"http://127.0.0.1:{bport}"
        assert wait_http(url + "/health", timeout=5, proc=p)
        code, body = http_get(url + ROUTE_Q)
        assert code == 503
        assert body == b"Prefill server not fully registered yet (0 workers registered)."
        assert wait_http(url + ROUTE_Q, status=200, timeout=10, proc=p)
        assert json.loads(http_get(url + ROUTE_Q)[1])["attn_tp_size"] == 2
    finally:
        p.stop()


def test_server_info_roles(pair):
    p, d = pair
    pi = json.loads(http_get(p.url + "/server_info")[1])
    di = json.loads(http_get(d.url + "/server_info")[1])
    assert pi["disaggregation_mode"] == "prefill" and di["disaggregation_mode"] == "decode"
    assert pi["disaggregation_bootstrap_port"] == p.bootstrap_port
    assert di["disable_radix_cache"] is True


def test_health_generate_on_decode_does_not_touch_the_kv_link(pair):
    _, d = pair
    assert http_get(d.url + "/health_generate") == (200, b"")


def test_paired_request_succeeds_and_matches_collapsed_output(pair):
    p, d = pair
    body = {"text": "Explain KV transfer", "sampling_params": {"max_new_tokens": 8},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port, "bootstrap_room": 4242}
    (pc, pout), (dc, dout) = paired(p, d, body)
    assert pc == 200 and dc == 200, (pout, dout)
    assert len(dout["output_ids"]) == 8 and dout["meta_info"]["finish_reason"]["type"] == "length"
    assert pout["output_ids"] == dout["output_ids"][:1]  # prefill samples the first token
    assert pout["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    with start_sim([]) as solo:
        code, sout = http_post(solo.url + "/generate", {"text": "Explain KV transfer",
                                                          "sampling_params": {"max_new_tokens": 8}})
    assert code == 200 and sout["text"] == dout["text"]
    # the fake-transfer path (no KV moved) does not give the prompt's answer
    fake = http_post(d.url + "/generate", {**body, "bootstrap_host": "2.2.2.2", "bootstrap_room": 0})[1]
    assert fake["text"] != dout["text"]
    code, m = http_get(p.url + "/metrics")
    lat = [s for f in text_string_to_metric_families(m.decode()) if f.name == "sglang:kv_transfer_latency_ms"
           for s in f.samples if s.name.endswith("_count")]
    assert lat and lat[0].value >= 1 and lat[0].labels["engine_type"] == "prefill"


def test_paired_chat_through_both(pair):
    p, d = pair
    body = {"messages": [{"role": "user", "content": "hello"}], "bootstrap_host": "127.0.0.1",
            "bootstrap_port": p.bootstrap_port, "bootstrap_room": 99}
    (pc, _), (dc, dout) = paired(p, d, body, "/v1/chat/completions")
    assert pc == 200 and dc == 200 and dout["choices"][0]["message"]["content"]


def test_null_bootstrap_port_means_decode_own_flag(pair):
    p, d = pair  # decode was started with --disaggregation-bootstrap-port = prefill's
    body = {"text": "x", "sampling_params": {"max_new_tokens": 2}, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": None, "bootstrap_room": 77}
    (pc, _), (dc, _) = paired(p, d, body)
    assert pc == 200 and dc == 200


def test_request_without_bootstrap_room_is_rejected(pair):
    p, d = pair
    for srv in (p, d):
        code, out = http_post(srv.url + "/generate", {"text": "hi"})
        assert code == 400
        assert "Disaggregated request received without bootstrap room id" in out["error"]["message"]


def test_unreachable_bootstrap_fails_with_sglang_text_and_counter(pair):
    _, d = pair
    before = counter(d.url, "sglang:num_bootstrap_failed_reqs")
    port = free_port()
    body = {"text": "hi", "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 5}
    t0 = time.monotonic()
    code, out = http_post(d.url + "/generate", body)
    assert time.monotonic() - t0 < 10
    assert code == 500
    assert out["code"] == 500 and out["object"] == "error"
    assert "Decode handshake failed for request rank=0" in out["message"]
    assert "KVTransferError(bootstrap_room=5): Aborted by AbortReq." in out["message"]
    assert counter(d.url, "sglang:num_bootstrap_failed_reqs") == before + 1
    assert f"Could not fetch prefill parallel info from 127.0.0.1:{port} after 15 attempts" in d.log_text()


def test_room_never_arrives_times_out(pair):
    p, d = pair
    before = counter(d.url, "sglang:num_transfer_failed_reqs")
    body = {"text": "hi", "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port,
            "bootstrap_room": 123456}
    t0 = time.monotonic()
    code, out = http_post(d.url + "/generate", body)
    assert 0.9 < time.monotonic() - t0 < 8
    assert code == 500
    assert "Decode transfer failed for request rank=0" in out["message"]
    assert "KVTransferError(bootstrap_room=123456): Request 123456 timed out after" in out["message"]
    assert "in KVPoll.WaitingForInput" in out["message"]
    assert counter(d.url, "sglang:num_transfer_failed_reqs") == before + 1
    assert "Some requests fail to receive KV Cache transfer done signal" in d.log_text()


def test_prefill_alone_times_out_bootstrapping(pair):
    p, _ = pair
    before = counter(p.url, "sglang:num_bootstrap_failed_reqs")
    body = {"text": "hi", "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port,
            "bootstrap_room": 31337}
    code, out = http_post(p.url + "/generate", body)
    assert code == 500
    assert "Prefill bootstrap failed for request rank=0" in out["message"]
    assert "in KVPoll.Bootstrapping" in out["message"]
    assert counter(p.url, "sglang:num_bootstrap_failed_reqs") == before + 1


def test_chat_failure_is_openai_error_shape(pair):
    _, d = pair
    body = {"messages": [{"role": "user", "content": "x"}], "bootstrap_host": "127.0.0.1",
            "bootstrap_port": free_port(), "bootstrap_room": 6}
    code, out = http_post(d.url + "/v1/chat/completions", body)
    assert code == 500 and out["code"] == 500 and "KVTransferError(bootstrap_room=6)" in out["message"]


@pytest.mark.parametrize("flag,value,text", [
    ("--page-size", "1", "Page size mismatch: prefill server has page_size=1, but decode server has "
                         "page_size=64. Both servers must use the same --page-size value."),
    ("--kv-cache-dtype", "fp8_e4m3", "KV cache dtype mismatch: prefill server has kv_cache_dtype=fp8_e4m3, "
                                     "but decode server has kv_cache_dtype=bfloat16. Both servers must use "
                                     "the same --kv-cache-dtype value."),
])
def test_layout_mismatch_kills_the_decode_server(flag, value, text):
    """0.5.23 raises RuntimeError in the decode scheduler loop (not caught): the whole server dies."""
    p, d = pd_pair([], FAST_FAIL, prefill_extra=[flag, value])
    try:
        body = {"text": "hi", "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port,
                "bootstrap_room": 1}
        code, _ = http_post(d.url + "/generate", body, timeout=10)
        assert code == 0  # connection dropped: the server was SIGKILLed
        assert d.popen.wait(5) == -9
        log = d.log_text()
        assert "Scheduler hit an exception" in log and f"RuntimeError: {text}" in log
        assert "SIGQUIT received. signum=None, frame=None. It usually means one child failed." in log
        assert p.alive()
    finally:
        p.stop()
        d.stop()


def test_fake_backend_decode_serves_without_prefill():
    with start_sim(["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake"]) as d:
        code, out = http_post(d.url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3}})
        assert code == 200 and len(out["output_ids"]) == 3


def test_prefill_death_fails_in_flight_transfer_via_heartbeat():
    env = {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60", "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
           "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1"}
    p, d = pd_pair(["--enable-metrics"], env)
    try:
        body = {"text": "hi", "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port,
                "bootstrap_room": 555}
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(r=http_post(d.url + "/generate", body, timeout=30)))
        t0 = time.monotonic()
        t.start()
        wait_until(lambda: gauge(d.url, "sglang:num_decode_transfer_queue_reqs") == 1, 10,
                   "decode waiting for the room's KV (its transfer queue)")
        p.popen.kill()
        t.join(30)
        code, res = out["r"]
        assert code == 500 and time.monotonic() - t0 < 15
        assert "Lost connection with prefill instance (bootstrap_addr: 127.0.0.1:" in res["message"]
        assert "Decode transfer failed" in res["message"]
        assert counter(d.url, "sglang:num_transfer_failed_reqs") == 1
        assert "requests affected" in d.log_text()
    finally:
        p.stop()
        d.stop()


def test_prefill_drops_a_held_request_when_the_client_goes_away():
    import socket as _socket
    p = start_sim(["--disaggregation-mode", "prefill", "--enable-metrics"],
                  {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60"})
    try:
        body = json.dumps({"text": "hi", "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port,
                           "bootstrap_room": 808}).encode()
        s = _socket.create_connection(("127.0.0.1", p.port))
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                  + f"content-length: {len(body)}\r\n\r\n".encode() + body)
        wait_until(lambda: gauge(p.url, "sglang:num_prefill_bootstrap_queue_reqs") == 1, 10,
                   "prefill holding the request for its decode (bootstrap queue)")
        s.close()
        wait_until(lambda: "the client went away" in p.log_text(), 10, "prefill noticing the client left")
        assert "Abort request" in p.log_text()
        wait_until(lambda: gauge(p.url, "sglang:num_prefill_bootstrap_queue_reqs") == 0, 5, "the request dropped")
    finally:
        p.stop()
