"""Truth under traffic: healthy means a client of the router would succeed (the real smg router's circuit breaker,
the SGLang stand-in under the process supervisor), and restarts that keep serving."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from pdctl.statemachine import serving
from pdctl.statemachine.events import ListSink
from pdctl.statemachine.spec import parse_spec
from pdctl.statemachine.topology import topology_of

from .specs import demo_dict

pytestmark = [pytest.mark.smg, pytest.mark.slow]


def _wait(pred, timeout: float, what: str):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)


def _hair_trigger(d: dict) -> None:
    # One failed request opens a circuit for 10 min, and no health check runs meanwhile (every 60 s): what a client
    # meets after a crash comes from the breaker alone, deterministically
    d["router"].update(health_check_interval_s=60,
                       extra_args=["--cb-failure-threshold", "1", "--cb-timeout-duration-secs", "600"])


def test_status_is_not_healthy_while_the_routers_breaker_holds_a_worker_out_and_apply_readmits_it(make_demo):
    demo = make_demo(_hair_trigger)
    demo.apply()
    st = demo.status()
    assert st["healthy"] and st["router"]["serving"]["canary"]["ok"], st["router"]["serving"]
    assert st["router"]["serving"]["circuits"] == {"prefill": "closed", "decode": "closed"}
    dec = next(r for r in st["roles"] if r["name"] == "decode")
    router = f"http://127.0.0.1:{demo.ports['router']}"
    os.kill(dec["main_pid"], signal.SIGKILL)
    _wait(lambda: _refused(dec["url"]) is not None, 10, "decode's port closed")
    r = httpx.post(f"{router}/generate", json=serving.CANARY_BODY, timeout=30)  # a client's request meets the crash
    assert r.status_code >= 500, r.text
    # its supervisor brings decode back; the router's /readiness and /workers say all is well again...
    _wait(lambda: next(x for x in demo.status(canary=False)["roles"] if x["name"] == "decode")["health"] == 200, 60,
          "decode back")
    # (polled: a loaded machine's router can miss status's 2 s probe bound once; the circuit stays open 10 min)
    st = _wait(lambda: (s := demo.status())["router"]["readiness"] == 200
               and all(w["is_healthy"] for w in s["router"]["workers"]) and s, 30, "the router ready, workers healthy")
    # ...yet every client gets 503 from the open circuits, and status says so
    sv = st["router"]["serving"]
    assert not st["healthy"] and not sv["served"], sv
    assert sv["canary"]["status"] == 503 and "circuit" in sv["canary"]["error"], sv["canary"]
    assert sv["circuits"]["decode"] == "open", sv
    text = demo.cli("status", str(demo.spec))
    assert text.returncode == 1 and "NOT serving clients: clients get HTTP 503" in text.stdout, text.stdout
    assert demo.cli("status", str(demo.spec), "--no-canary").returncode == 1  # (the circuits alone tell it)
    # the console sees it too: its collector's circuits and canary, and the header says clients fail
    from pdctl.console.app import ConsoleApp
    from pdctl.console.collect import Collector

    collector = Collector(demo.load(), nvml=False)
    try:
        snap = _wait(lambda: (c := collector.collect(gpu=False)).serving is not None
                     and c.serving.canary is not None and c, 15, "the console's first canary")
    finally:
        collector.close()
    assert snap.serving.seen_failing and snap.serving.circuits["decode"] == "open", snap.serving
    app = ConsoleApp(demo.load(), live=False, nvml=False)
    app.snapshot, app._clients_fail_since = snap, snap.at - 12
    assert "CLIENTS FAIL for 12 s: clients get HTTP 503" in app._status_line(), app._status_line()
    # a step that meets the router's 503 hints at the router's view of its workers, not at the step's own cause
    # (parsers_configured said to set the parsers on both servers)
    from pdctl.statemachine import service
    from pdctl.statemachine.errors import VerifyFailed
    from pdctl.statemachine.machine import run_steps
    from pdctl.statemachine.steps import ParsersConfigured

    ctx = service.build_context(demo.load(), timeouts=demo.timeouts())
    with pytest.raises(VerifyFailed) as e:
        run_steps(ctx, [ParsersConfigured()], ListSink())
    assert "HTTP 503" in e.value.message and "/workers" in e.value.hint and "parser" not in e.value.hint, e.value
    # apply re-admits what the breaker holds out although it serves: then a client is served
    sink = ListSink()
    demo.apply(sink=sink)
    assert any("re-admitting" in e.message for e in sink.events), [e.message for e in sink.events]
    st = demo.status()
    assert st["healthy"] and st["router"]["serving"]["circuits"] == {"prefill": "closed", "decode": "closed"}, st
    assert httpx.post(f"{router}/generate", json=serving.CANARY_BODY, timeout=30).status_code == 200


def test_a_probes_hint_comes_from_what_it_met(tmp_path):
    import socket

    from pdctl.statemachine import probes
    from pdctl.statemachine.errors import ProbeError

    with socket.socket() as bound:  # bound, never listening: connections are refused, and the port stays ours
        bound.bind(("127.0.0.1", 0))
        with pytest.raises(ProbeError) as e, httpx.Client(trust_env=False) as c:
            probes.chat_probe(c, f"http://127.0.0.1:{bound.getsockname()[1]}", "m", timeout=2)
    assert "nothing accepts connections" in e.value.evidence_hint()
    with socket.create_server(("127.0.0.1", 0)) as mute:  # accepts, never answers
        url = f"http://127.0.0.1:{mute.getsockname()[1]}"
        with pytest.raises(ProbeError) as e, httpx.Client(trust_env=False) as c:
            probes.chat_probe(c, url, "m", timeout=0.5)
    assert "did not answer in time" in e.value.evidence_hint()
    # an HTTP answer the step itself judges (a 400: the request, the parsers) keeps the step's hint
    assert ProbeError("x", status=400, body="bad tool_call_parser").evidence_hint() is None


def test_the_canary_never_raises_and_an_old_result_is_not_given_as_now():
    closed = httpx.Client(trust_env=False)
    closed.close()  # (the console's client, replaced by a reload of [hosts] while a canary was due)
    c = serving.run_canary(closed, "http://127.0.0.1:9", timeout=1)
    assert not c.ok and c.status == 0 and "closed" in c.error, c
    now = [1000.0]
    runner = serving.CanaryRunner(lambda: httpx.Client(trust_env=False), "http://127.0.0.1:9", interval_s=1,
                                  timeout_s=1, clock=lambda: now[0])
    runner.latest = serving.Canary(False, 0, "refused", 0.0, at=1000.0)
    runner._last_start = time.monotonic()  # (none due now)
    assert runner.tick() is runner.latest
    now[0] += 4.5  # two periods and more: the router may have come back since
    assert runner.tick() is None


def _refused(url: str) -> str | None:
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.ConnectError as exc:
        return str(exc)
    return None


def test_a_restart_of_one_of_two_prefill_replicas_loses_no_request(make_demo):
    import threading

    def two_prefills(d: dict) -> None:
        from harness.sim import free_ports

        extra = dict(d["prefill"][0])  # (named prefill-1 by its position)
        extra["port"], extra["bootstrap_port"], extra["nccl_port"] = free_ports(3)
        extra["gpus"] = [8, 9, 10, 11]
        d["prefill"].append(extra)

    demo = make_demo(two_prefills)
    demo.apply()
    router = f"http://127.0.0.1:{demo.ports['router']}"
    failed: list[tuple[int, str]] = []
    sent = [0]
    stop = threading.Event()

    def traffic() -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                r = c.post(f"{router}/generate", json=serving.CANARY_BODY)
                sent[0] += 1
                if r.status_code != 200:
                    failed.append((r.status_code, r.text[:200]))
                stop.wait(0.1)

    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    try:
        sink = ListSink()
        result = demo.apply(restart={"prefill"}, sink=sink)
    finally:
        stop.set()
        t.join(30)
    assert result.state == "parsers_configured"
    said = [e.message for e in sink.events]
    assert any("taking prefill out of the router" in m for m in said) and any(
        "prefill is back in the router" in m for m in said), said
    assert sent[0] > 5 and failed == [], (sent[0], failed)
    assert demo.status()["healthy"]


def test_judge_names_open_circuits_and_puts_what_the_client_got_first():
    topo = topology_of(parse_spec(demo_dict()))
    text = ('# TYPE smg_worker_cb_state gauge\n'
            'smg_worker_cb_state{worker="http://127.0.0.1:30010"} 1\n'
            'smg_worker_cb_state{worker="http://127.0.0.1:30020"} 2\n')
    states = serving.parse_circuits(text)
    assert states == {"http://127.0.0.1:30010": "open", "http://127.0.0.1:30020": "half_open"}
    canary = serving.Canary(False, 503, "No available servers: No available prefill workers", 0.01, 0.0)
    sv = serving.judge(topo, states, None, canary)
    assert not sv.served and sv.circuits == {"prefill": "open", "decode": "half_open"}
    assert sv.problems[0].startswith("clients get HTTP 503: No available") and len(sv.problems) == 3
    closed = serving.parse_circuits(text.replace("} 1", "} 0").replace("} 2", "} 0"))
    assert serving.judge(topo, closed, None, serving.Canary(True, 200, None, 0.01, 0.0)).served
    # metrics unreadable and no canary: not called served
    assert not serving.judge(topo, None, "connection refused", None).served
