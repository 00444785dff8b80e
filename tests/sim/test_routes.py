"""SGLang 0.5.23's HTTP surface as the stand-in serves it (collapsed / non-PD form)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.sim import free_port, http_get, http_post, sse_events, start_sim, wait_http

PARSERS = ["--reasoning-parser", "deepseek-v3", "--tool-call-parser", "deepseekv32"]


@pytest.fixture(scope="module")
def srv():
    with start_sim(PARSERS + ["--enable-metrics", "--served-model-name", "dsv32"]) as p:
        yield p


def get_json(url):
    code, body = http_get(url)
    return code, json.loads(body) if body else None


def test_health_ready(srv):
    assert http_get(srv.url + "/health") == (200, b"")
    assert http_get(srv.url + "/health_generate") == (200, b"")
    assert http_get(srv.url + "/ready")[0] == 200


def test_server_info_is_flat_resolved_args(srv):
    code, info = get_json(srv.url + "/server_info")
    assert code == 200
    for key in ("disaggregation_mode", "disaggregation_bootstrap_port", "disaggregation_transfer_backend",
                "tp_size", "attn_dp_size", "dp_size", "page_size", "kv_cache_dtype", "reasoning_parser",
                "tool_call_parser", "chat_template", "served_model_name", "model_path", "host", "port",
                "base_gpu_id", "context_length", "launch_command", "max_total_num_tokens", "internal_states"):
        assert key in info, key
    assert info["version"] == "0.5.23"
    assert info["disaggregation_mode"] == "null"
    assert info["reasoning_parser"] == "deepseek-v3" and info["tool_call_parser"] == "deepseekv32"
    assert info["served_model_name"] == "dsv32"
    assert info["port"] == srv.port and info["page_size"] == 64  # DeepSeek-V3.2 DSA resolves to 64
    assert isinstance(info["internal_states"], list) and len(info["internal_states"]) == 1
    assert info["internal_states"][0]["disaggregation_mode"] == "null"
    assert "--reasoning-parser deepseek-v3" in info["launch_command"]


def test_deprecated_get_server_info_same_body_and_warns(srv):
    _, a = get_json(srv.url + "/server_info")
    _, b = get_json(srv.url + "/get_server_info")
    a.pop("internal_states"), b.pop("internal_states")
    assert a == b
    deadline = time.monotonic() + 5
    while "'/get_server_info' is deprecated" not in srv.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "Endpoint '/get_server_info' is deprecated" in srv.log_text()


def test_model_info_and_models(srv):
    code, mi = get_json(srv.url + "/model_info")
    assert code == 200
    assert mi["served_model_name"] == "dsv32" and mi["is_generation"] is True
    assert mi["disaggregation_mode"] == "null" and mi["tool_call_parser"] == "deepseekv32"
    assert get_json(srv.url + "/get_model_info")[1] == mi
    code, models = get_json(srv.url + "/v1/models")
    assert code == 200 and models["object"] == "list"
    assert models["data"][0]["id"] == "dsv32" and models["data"][0]["max_model_len"] == 163840


def test_v1_loads(srv):
    code, loads = get_json(srv.url + "/v1/loads?include=core,disagg,queues,memory")
    assert code == 200 and loads["version"] == "0.5.23"
    assert loads["loads"][0]["dp_rank"] == 0 and loads["loads"][0]["disaggregation"]["mode"] == "null"
    assert get_json(srv.url + "/v1/loads?include=bogus")[0] == 400


def test_flush_cache_get_and_post(srv):
    code, body = http_get(srv.url + "/flush_cache")
    assert code == 200 and body.startswith(b"Cache flushed.")
    code, body = http_post(srv.url + "/flush_cache", {})
    assert code == 200 and body.startswith("Cache flushed.")


@pytest.mark.parametrize("path", ["/get_load", "/loads", "/workers", "/v1/responses/x/y", "/nothing"])
def test_unknown_paths_404_fastapi_shape(srv, path):
    code, body = http_get(srv.url + path)
    assert code == 404
    assert json.loads(body) == {"detail": "Not Found"}


def test_wrong_method_405(srv):
    code, body = http_get(srv.url + "/generate")
    assert code == 405 and json.loads(body) == {"detail": "Method Not Allowed"}


def test_generate_shape_and_determinism(srv):
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 5}}
    code, out = http_post(srv.url + "/generate", body)
    assert code == 200
    assert isinstance(out["text"], str) and len(out["output_ids"]) == 5
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["completion_tokens"] == 5 and meta["prompt_tokens"] > 0
    assert http_post(srv.url + "/generate", body)[1]["text"] == out["text"]
    other = http_post(srv.url + "/generate", {**body, "text": "Something else"})[1]["text"]
    assert other != out["text"]


def test_generate_stream(srv):
    raw = _post_raw(srv.url + "/generate", {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 3}})
    events = list(sse_events(raw))
    assert events[-1] == "[DONE]"
    assert [len(e["output_ids"]) for e in events[:-1]] == [1, 2, 3]
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"


def _post_raw(url, body):
    import urllib.request
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return r.read()


def test_chat_completion_plain(srv):
    code, out = http_post(srv.url + "/v1/chat/completions",
                          {"model": "dsv32", "messages": [{"role": "user", "content": "Say hi"}]})
    assert code == 200
    assert out["object"] == "chat.completion" and out["model"] == "dsv32"
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"] and msg["reasoning_content"] is None
    assert msg["tool_calls"] is None and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] > 0


def test_chat_max_tokens_length(srv):
    _, out = http_post(srv.url + "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2})
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 2


def test_chat_stream_done(srv):
    raw = _post_raw(srv.url + "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "Say hi"}], "stream": True,
                     "stream_options": {"include_usage": True}})
    events = list(sse_events(raw))
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    _, full = http_post(srv.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi"}]})
    assert text == full["choices"][0]["message"]["content"]
    assert events[-3]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["usage"]["completion_tokens"] > 0


def test_completions(srv):
    code, out = http_post(srv.url + "/v1/completions", {"prompt": "Once", "max_tokens": 4})
    assert code == 200 and out["object"] == "text_completion"
    assert out["choices"][0]["finish_reason"] == "length"


def test_metrics_parse_with_prometheus_client(srv):
    http_post(srv.url + "/generate", {"text": "count me", "sampling_params": {"max_new_tokens": 4}})
    code, body = http_get(srv.url + "/metrics")
    assert code == 200
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    for name in ("sglang:num_running_reqs", "sglang:gen_throughput", "sglang:token_usage",
                 "sglang:num_queue_reqs", "sglang:max_total_num_tokens", "sglang:num_transfer_failed_reqs",
                 "sglang:num_bootstrap_failed_reqs", "sglang:prompt_tokens", "sglang:generation_tokens",
                 "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
                 "sglang:e2e_request_latency_seconds", "sglang:kv_transfer_latency_ms",
                 "sglang:num_decode_transfer_queue_reqs", "sglang:num_prefill_bootstrap_queue_reqs"):
        assert name in fams, name
    assert fams["sglang:time_to_first_token_seconds"].type == "histogram"
    assert fams["sglang:kv_transfer_latency_ms"].type == "histogram"
    assert fams["sglang:num_transfer_failed_reqs"].type == "counter"
    sched = fams["sglang:num_running_reqs"].samples[0].labels
    assert sched == {"model_name": "dsv32", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0",
                     "moe_ep_rank": "0"}
    gen = [s for s in fams["sglang:generation_tokens"].samples if s.name.endswith("_total")]
    assert sum(s.value for s in gen) >= 4
    assert all(s.labels["engine_type"] == "unified" for s in gen)


def test_metrics_404_without_enable_metrics():
    with start_sim([]) as p:
        code, body = http_get(p.url + "/metrics")
        assert code == 404 and json.loads(body) == {"detail": "Not Found"}


def test_port_closed_while_loading_then_503_during_warmup_then_200():
    port = free_port()
    # (windows of seconds, each found by polling: a loaded machine that stalls this test for less still sees them)
    with start_sim(["--port", str(port)], {"PDCTL_SIM_LOAD_SECONDS": "2.0", "PDCTL_SIM_WARMUP_SECONDS": "4.0"},
                   wait=False) as p:
        deadline = time.monotonic() + 20
        while "Load weight begin" not in p.log_text() and p.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "Load weight begin" in p.log_text(), p.log_text()
        assert http_get(p.url + "/health")[0] == 0  # weights loading: nothing listens yet
        assert wait_http(p.url + "/health", status=503, timeout=10, proc=p)
        assert http_get(p.url + "/ready")[0] == 503
        assert wait_http(p.url + "/health", status=200, timeout=5, proc=p)
        assert "The server is fired up and ready to roll!" in p.log_text()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_clean_exit_within_a_second(sig):
    p = start_sim([])
    try:
        t0 = time.monotonic()
        os.kill(p.pid, sig)
        rc = p.popen.wait(5)
        assert rc == 0
        assert time.monotonic() - t0 < 1.0
    finally:
        p.stop()


def test_a_sigterm_taken_by_another_thread_than_the_main_one_still_ends_the_server():
    # (a SIGTERM sent while the server was stopped, kill -STOP, then SIGCONT: whichever of its threads woke first took
    # it, and its handler never ran while the main thread slept in a wait with no timeout: the server served on until
    # its supervisor's SIGKILL, 120 s later. SGLang's main thread runs uvicorn's loop, which the signal wakes.)
    # Sent here straight to a thread that is not the main one (tgkill(2)), so that the case is not left to chance
    import ctypes

    nr = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)
    if nr is None:
        pytest.skip("tgkill(2)'s number is known for x86_64 and aarch64 only")
    p = start_sim([])
    try:
        threads = sorted(int(t) for t in os.listdir(f"/proc/{p.pid}/task") if int(t) != p.pid)
        assert threads, "the stand-in runs its server in threads besides the main one"
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(nr, p.pid, threads[0], signal.SIGTERM) == 0, ctypes.get_errno()
        assert p.popen.wait(5) == 0
        assert "SIGTERM received" in p.log_text()
    finally:
        p.stop()


def test_sigterm_during_load_exits_0():
    p = start_sim([], {"PDCTL_SIM_LOAD_SECONDS": "30"}, wait=False)
    try:
        # SIGTERM once the server is loading weights (its handlers are in place by then, as SGLang's are
        # once it logs), not at a fixed delay that a loaded machine can spend still importing.
        deadline = time.monotonic() + 20
        while "Load weight begin" not in p.log_text() and p.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "Load weight begin" in p.log_text(), p.log_text()
        os.kill(p.pid, signal.SIGTERM)
        assert p.popen.wait(5) == 0
    finally:
        p.stop()


def test_port_in_use_fails_startup():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "pdctl.sim", "--model-path", "m", "--port", str(port)],
                              capture_output=True, text=True, timeout=20,
                              env={**os.environ, "PDCTL_SIM_LOAD_SECONDS": "0"})
        assert proc.returncode != 0
        assert "Address already in use" in proc.stderr


def _listening(pid: int | None = None) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket in LISTEN on this host (of process *pid* only, if given), from
    /proc/net/tcp and tcp6 (the kernel's own table; ``::`` for an IPv6 wildcard, which also takes IPv4)."""
    inodes = None
    if pid is not None:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or (inodes is not None and cols[9] not in inodes):
                    continue
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # (host-order 32-bit words)
                out.append((socket.inet_ntop(family, raw), int(hexport, 16)))
    return out


def test_the_nccl_port_is_held_on_every_address_and_a_second_server_on_it_dies_as_sglang_does():
    # (SGLang's rank 0 holds --nccl-port with torch's TCPStore for its life; the stand-in held nothing there, so a
    # spec giving prefill and decode one NCCL port ran, where real servers on one host fail at start-up)
    nccl = free_port()
    with start_sim(["--nccl-port", str(nccl)]) as p:
        assert [a for a, port in _listening() if port == nccl] in (["::"], ["0.0.0.0"]), _listening()
        assert "Init torch distributed begin." in p.log_text()
        proc = subprocess.run([sys.executable, "-m", "pdctl.sim", "--model-path", "m", "--port", str(free_port()),
                               "--nccl-port", str(nccl)], capture_output=True, text=True, timeout=20,
                              env={**os.environ, "PDCTL_SIM_LOAD_SECONDS": "0"})
        assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr)  # (the launcher kills its tree)
        assert ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
                f"address. port: {nccl}, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"
                in proc.stderr), proc.stderr
        assert "Received sigquit from a child process. It usually means the child failed." in proc.stderr
        assert "Uvicorn running" not in proc.stderr
    assert [a for a, port in _listening() if port == nccl] == []  # (released with the process)


def test_without_nccl_port_a_free_one_below_the_ephemeral_range_is_held():
    with start_sim([], nccl_port=False) as p:
        held = {port for _a, port in _listening(p.pid)}
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
        store = held - {int(p.url.rsplit(":", 1)[1])}
        assert len(store) == 1 and 10000 <= store.pop() < low, held


def test_api_key_guards_all_but_health_ready_metrics():
    import urllib.request
    with start_sim(["--api-key", "sekret", "--enable-metrics"]) as p:
        assert http_get(p.url + "/health")[0] == 200
        assert http_get(p.url + "/metrics")[0] == 200
        code, body = http_get(p.url + "/server_info")
        assert code == 401 and json.loads(body) == {"error": "Unauthorized"}
        assert http_post(p.url + "/generate", {"text": "x"})[0] == 401
        req = urllib.request.Request(p.url + "/server_info", headers={"Authorization": "Bearer sekret"})
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 200


def test_keep_alive_survives_unread_bodies(srv):
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
    conn.request("POST", "/nothing", body=b'{"x": 1}', headers={"content-type": "application/json"})
    r = conn.getresponse()
    assert r.status == 404 and r.read()
    conn.request("GET", "/health")
    r = conn.getresponse()
    assert r.status == 200
    r.read()
    conn.close()


@pytest.mark.parametrize("family,expected", [("deepseek-v32", 64), ("deepseek-v4", 256), ("deepseek-v31", 1)])
def test_page_size_resolution_by_family(family, expected):
    from pdctl.sim import flags, model
    _, resolved = flags.parse(["--model-path", "m"], model.DEFAULT_PAGE_SIZE[family])
    assert resolved["page_size"] == expected
    _, resolved = flags.parse(["--model-path", "m", "--page-size", "16"], model.DEFAULT_PAGE_SIZE[family])
    assert resolved["page_size"] == 16


def test_retrieve_model(srv):
    code, body = get_json(srv.url + "/v1/models/dsv32")
    assert code == 200 and body["id"] == "dsv32"
    code, body = get_json(srv.url + "/v1/models/other")
    assert code == 404 and body["error"]["code"] == "model_not_found"


def test_log_requests_writes_receive_and_finish_lines():
    with start_sim(["--log-requests"]) as p:
        http_post(p.url + "/generate", {"text": "log me", "sampling_params": {"max_new_tokens": 2}})
        deadline = time.monotonic() + 5
        while "Finish: obj=GenerateReqInput(" not in p.log_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        log = p.log_text()
        assert "Receive: obj=GenerateReqInput(rid=" in log and "text='log me'" in log
        assert "Finish: obj=GenerateReqInput(" in log and "'finish_reason': {'type': 'length'" in log
