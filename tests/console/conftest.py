"""Fixtures for console tests: the demo spec on free ports (harness.deploy.Demo), a fake service manager,
mocked scrapes, a ``wait_for`` for pilots, and fixed samples for deterministic snapshots."""

from __future__ import annotations

import copy
import math
import os
import time
from pathlib import Path

import httpx
import pytest

from harness.deploy import Demo, demo_dict, dump_toml, listening_pids

__all__ = ["ConsoleDemo", "demo_dict", "dump_toml", "listening_pids"]

FIX = Path(__file__).parent / "fixtures"


class ConsoleDemo(Demo):
    """The demo topology on free ports in a temporary directory (not started until applied)."""

    prefix = "c"

    def pretend_deployed(self, mutate) -> None:  # noqa: ANN001
        """Journal as deployed the topology of this spec changed by *mutate* (no process runs):
        the plan from there to this spec is what the console must confirm."""
        from pdctl.statemachine.journal import Journal, JournalState
        from pdctl.statemachine.topology import topology_of

        other = copy.deepcopy(self.dict)
        mutate(other)
        dep = self.load(self.write(other, "deployed.toml")).deployment
        Journal(self.state, self.name).write(JournalState(name=self.name, deployed=topology_of(dep)))


@pytest.fixture
def console_demo(tmp_path):
    d = ConsoleDemo(tmp_path)
    yield d
    d.down()


class FakeManager:
    """A service manager whose units are active unless their role is in ``down``."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.unsupervised: set[str] = set()
        """Roles whose unit is active with its supervisor gone."""
        self.unreachable = False
        """The host does not answer (an SSH connection lost): every status raises HostError."""
        self.pids: dict[str, int] = {}
        """Main PIDs by role (else this test process's)."""

    def status(self, unit: str):  # noqa: ANN201
        from pdctl.statemachine.errors import HostError
        from pdctl.units import ServiceStatus

        if self.unreachable:
            raise HostError("ssh root@127.0.0.1:22: cannot connect: [Errno 111] Connection refused", host="local")
        if any(f"-{d}." in unit for d in self.down):
            return ServiceStatus(unit, "failed")
        pid = next((p for r, p in self.pids.items() if f"-{r}." in unit), os.getpid())
        return ServiceStatus(unit, "active", main_pid=pid, restarts=0,
                             supervised=not any(f"-{d}." in unit for d in self.unsupervised))

    def logs(self, unit: str, *, lines: int = 50) -> list[str]:
        return [f"{unit}: line {i}" for i in range(3)]


def metrics_transport(ports: dict[str, int], down: set[str]) -> httpx.MockTransport:
    """Serves the fixture expositions on the demo's ports; a role in *down*, and any other port, refuses
    connections."""
    texts = {ports["prefill"]: ("prefill", "prefill_metrics.txt"), ports["decode"]: ("decode", "decode_metrics.txt"), ports["prom"]: ("router", "smg_metrics.txt")}

    def handler(req: httpx.Request) -> httpx.Response:
        role, name = texts.get(req.url.port, (None, None))  # (another port: nothing listens there)
        if role is None or role in down:
            raise httpx.ConnectError("connection refused", request=req)
        return httpx.Response(200, text=(FIX / name).read_text())

    return httpx.MockTransport(handler)


async def wait_for(pilot, pred, timeout: float = 10.0, step: float = 0.05) -> None:  # noqa: ANN001
    """Let the app run until *pred()* holds (AssertionError after *timeout* seconds)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached in {timeout}s")
        await pilot.pause(step)


# --- fixed data for snapshots ------------------------------------------------------------------

FIXED_NOW = 1_800_000_000.0


def fixed_journal(name: str, *, through: int = 6):  # noqa: ANN201
    """A journal whose first *through* steps are proven (fixed times and proofs)."""
    from pdctl.statemachine.journal import JournalState, StepRecord
    from pdctl.statemachine.machine import PD_STATES

    summaries = {
        "kernels_built": "skipped: disabled in spec",
        "prefill_up": "prefill up: active, healthy, /server_info as specified",
        "decode_up": "decode up: active, healthy, /server_info as specified",
        "kv_link_verified": "KV link proven: bootstrap reached from decode, paired request completed",
        "router_exposed": "router on 127.0.0.1:30001: ready, 1 prefill + 1 decode workers healthy",
        "parsers_configured": "chat with tools and thinking through the router: reasoning_content and tool_calls parsed",
    }
    j = JournalState(name=name, serial=7)
    t = FIXED_NOW - 600
    for i, s in enumerate(PD_STATES[:through]):
        status = "skipped" if s == "kernels_built" else "done"
        proof = {
            "summary": summaries[s],
            "checks": [f"{s}: check {k}" for k in (1, 2)],
            "evidence": {"status": 200, "step": s},
            "commands": [f"pdctl-probe {s}"],
            "at": t + 2,
        }
        j.steps[s] = StepRecord(status, proof, None, t, t + 0.5 + i)
        t += 3
    return j


def fixed_throughput():  # noqa: ANN201
    from pdctl.console.metrics import ThroughputSample

    wave = tuple(100 + 80 * math.sin(i / 6) for i in range(120))
    return (
        ThroughputSample("prefill", "prefill", "http://127.0.0.1:30010/metrics", "ok", age_s=0.0, input_tok_s=5321.0, gen_tok_s=0.0, running=4, queued=1,
                         kv_usage=0.12, ttft_s=(0.21, 0.48, 0.93), kv_xfer_ms=(3.5, 12.0), kv_xfer_failed=0, kv_xfer_failed_s=0.0, history=wave),
        ThroughputSample("decode", "decode", "http://127.0.0.1:30020/metrics", "ok", age_s=0.0, gen_tok_s=812.0, running=16, queued=0, kv_usage=0.41,
                         ttft_s=(0.25, 0.51, 0.97), itl_s=(0.012, 0.021, 0.044), kv_xfer_failed=2, kv_xfer_failed_s=0.0, history=tuple(v * 0.2 for v in wave)),
        ThroughputSample("router", "router", "http://127.0.0.1:29000/metrics", "down", error="connection refused", age_s=12.0, req_s=3.2, err_s=0.0,
                         errors=1, workers_healthy=2, workers_total=2, history=(*tuple(3.0 for _ in range(60)), *(None,) * 12)),
    )


def fixed_gpu(owners: dict[int, str]):  # noqa: ANN201
    from pdctl.console.telemetry import AffinitySample, GpuNumaSample, GpuSample, NumaNodeSample

    gpus = tuple(
        GpuSample(index=i, name="NVIDIA H200", uuid=f"GPU-{i}", util_pct=[97, 95, 96, 94, 61, 60, 63, 58][i], mem_used_bytes=(120 + i) * 1024**3,
                  mem_total_bytes=141 * 1024**3, temperature_c=60 + i, power_w=500.0 + 10 * i, power_limit_w=700.0,
                  pcie_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0", numa_node=0 if i < 4 else 1, numa_source="nvml")
        for i in range(8)
    )
    nodes = (
        NumaNodeSample(0, "0-47,96-143", 96, 1024 * 1024**3, 700 * 1024**3),
        NumaNodeSample(1, "48-95,144-191", 96, 1024 * 1024**3, 650 * 1024**3),
    )
    aff = (
        AffinitySample("prefill", 4100, 0, "0-47,96-143", "0-47,96-143", "ok", "matches"),
        AffinitySample("decode", 4200, 1, "48-95,144-191", "0-191", "mismatch", "also on 0-47,96-143"),
    )
    return GpuNumaSample(at=FIXED_NOW, nvml_ok=True, driver_version="580.65.06", gpus=gpus, nodes=nodes, affinity=aff, owners=owners)


def fixed_snapshot(loaded, *, gpu=None):  # noqa: ANN001, ANN201
    from pdctl.console.collect import ServiceView, Snapshot, current_topology, gpu_owners
    from pdctl.console.telemetry import GpuNumaSample
    from pdctl.console.views import expected_states, step_views

    j = fixed_journal(loaded.deployment.name)
    topo = current_topology(loaded, None)
    services = {
        "prefill": ServiceView("prefill", "u", "active", 4100, 0),
        "decode": ServiceView("decode", "u", "active", 4200, 1),
        "router": ServiceView("router", "u", "active", 4300, 0),
    }
    if gpu is None:
        gpu = GpuNumaSample(at=FIXED_NOW, nvml_ok=False, nvml_error="NVML unavailable: NVML Shared Library Not Found", owners=gpu_owners(loaded.deployment, topo))
    return Snapshot(at=FIXED_NOW, topology=topo, journal=j, steps=step_views(expected_states(topo), j, FIXED_NOW), services=services,
                    throughput=fixed_throughput(), gpu=gpu)
