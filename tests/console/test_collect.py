"""The collector never raises for a deployment that is down: it reports it. HTTP through
``httpx.MockTransport``, the service manager faked."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from pdctl.console.collect import Collector, gpu_owners, role_numa, scrape_sources
from pdctl.statemachine.service import load
from pdctl.statemachine.topology import topology_of
from pdctl.units import ServiceStatus

ROOT = Path(__file__).resolve().parents[2]
FIX = Path(__file__).parent / "fixtures"


class FakeManager:
    def __init__(self) -> None:
        self.down: set[str] = set()

    def status(self, unit: str) -> ServiceStatus:
        if any(d in unit for d in self.down):
            return ServiceStatus(unit, "failed")
        return ServiceStatus(unit, "active", main_pid=1, restarts=0)

    def logs(self, unit: str, *, lines: int = 50) -> list[str]:
        return [f"{unit} line {i}" for i in range(3)]


def _transport(down: set[str]) -> httpx.MockTransport:
    texts = {30010: "prefill_metrics.txt", 30020: "decode_metrics.txt", 29000: "smg_metrics.txt"}

    def handler(req: httpx.Request) -> httpx.Response:
        port = req.url.port
        if str(port) in down:
            raise httpx.ConnectError("connection refused", request=req)
        if port == 30020 and "garbage" in down:
            return httpx.Response(200, text="this is { not prometheus\n")
        return httpx.Response(200, text=(FIX / texts[port]).read_text())

    return httpx.MockTransport(handler)


def test_scrape_sources_are_every_server_and_the_router_prometheus_port():
    topo = topology_of(load(ROOT / "examples" / "demo.toml", state_dir="/nonexistent").deployment)
    assert scrape_sources(topo) == [
        ("prefill", "prefill", "http://127.0.0.1:30010/metrics"),
        ("decode", "decode", "http://127.0.0.1:30020/metrics"),
        ("router", "router", "http://127.0.0.1:29000/metrics"),
    ]


def test_seed_roles_numa_and_gpu_owners():
    loaded = load(ROOT / "examples" / "seed.toml", state_dir="/nonexistent")
    assert role_numa(loaded.deployment, "prefill") == (0, "0-31,64-95")
    assert role_numa(loaded.deployment, "decode") == (1, "32-63,96-127")
    owners = gpu_owners(loaded.deployment, topology_of(loaded.deployment))
    assert owners == {0: "prefill", 1: "prefill", 2: "prefill", 3: "prefill", 4: "decode", 5: "decode", 6: "decode", 7: "decode"}
    # a GPU host reached over SSH: the panel reads that host, so its roles own its GPUs the same (they were left out)
    remote = loaded.deployment.model_copy(update={"hosts": {"local": loaded.deployment.hosts["local"].model_copy(
        update={"address": "10.0.0.2"})}})
    assert not remote.hosts["local"].is_local
    assert gpu_owners(remote, topology_of(remote)) == owners


def test_a_source_going_down_is_reported_and_the_rest_still_collected(tmp_path):
    down: set[str] = set()
    mgr = FakeManager()
    c = Collector(load(ROOT / "examples" / "demo.toml", state_dir=tmp_path), client=httpx.Client(transport=_transport(down)), manager=mgr, nvml=False, canary=False)
    s = c.collect(log_role="decode")
    assert [t.state for t in s.throughput] == ["ok", "ok", "ok"]
    assert s.log_lines[-1] == "pdctl-demo-decode.service line 2"
    assert [st.name for st in s.steps][0] == "kernels_built" and len(s.steps) == 6
    down |= {"30010", "garbage"}
    mgr.down.add("prefill")
    s = c.collect()
    by = {t.source: t for t in s.throughput}
    assert by["prefill"].state == "down" and "refused" in by["prefill"].error
    assert by["decode"].state == "down" and "ValueError" in by["decode"].error  # unparseable text
    assert by["router"].state == "ok"
    assert s.services["prefill"].state == "failed"
    assert s.gpu is not None and not s.gpu.nvml_ok


def test_a_port_answering_for_a_unit_that_does_not_run_is_not_shown_as_this_deployments(tmp_path):
    # A fresh user renamed a deployed spec: the new name's console showed the old deployment's throughput, scraped
    # from the same router and server ports while none of the new name's units ran.
    mgr = FakeManager()
    mgr.down |= {"router", "decode"}
    c = Collector(load(ROOT / "examples" / "demo.toml", state_dir=tmp_path), client=httpx.Client(transport=_transport(set())),
                  manager=mgr, nvml=False, canary=False)
    by = {t.source: t for t in c.collect().throughput}
    assert by["prefill"].state == "ok" and by["prefill"].error is None
    for source in ("router", "decode"):
        assert by[source].state == "down", by[source]
        assert by[source].error == (f"pdctl-demo-{source}.service is failed, yet its port answers: another process's "
                                    "figures, not shown"), by[source].error


def test_process_start_times_are_read_once_per_pid_and_afresh_for_another_host(tmp_path):
    # (the header's RESTARTED compares them with the proofs: a spec reloaded onto another host kept the old host's
    # boot time and PIDs)
    import os

    demo = load(ROOT / "examples" / "demo.toml", state_dir=tmp_path)
    c = Collector(demo, client=httpx.Client(transport=_transport(set())), manager=FakeManager(), nvml=False, canary=False)
    started = c._started_at(os.getpid())
    assert started is not None and 0 < time.time() - started < 86400 * 365
    assert c._pid_started == {os.getpid(): started} and c._boot is not None
    text = (ROOT / "examples" / "demo.toml").read_text().replace('address = "localhost"', 'address = "127.0.0.1"')
    assert 'address = "127.0.0.1"' in text
    other = tmp_path / "other.toml"
    other.write_text(text)
    c.set_loaded(load(other, state_dir=tmp_path))
    assert c._pid_started == {} and c._boot is None
