"""GPU/NUMA telemetry: NA as a value, CPU lists, affinity comparison, sysfs and /proc readers on
fixture trees, NVML through one function (a fake pynvml for the GPU path; the real library on a
machine without a GPU)."""

from __future__ import annotations

import math
import types
from pathlib import Path

import pytest

from pdctl.console import telemetry as tm
from pdctl.console.telemetry import (
    NA,
    RoleNuma,
    compare_affinity,
    format_cpulist,
    parse_cpulist,
    read_affinity,
    read_gpu_numa,
    read_numa_nodes,
    sysfs_bus_id,
)


def test_na_prints_na_is_falsy_and_nan():
    assert str(NA) == "N/A" and not NA and math.isnan(float(NA))
    assert tm.NaType() is NA


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0-3,8,10-11", {0, 1, 2, 3, 8, 10, 11}), ("5", {5}), ("", set()), ("0-31,64-95", set(range(32)) | set(range(64, 96)))],
)
def test_cpulist_round_trip(text, cpus):
    assert parse_cpulist(text) == frozenset(cpus)
    if text:
        assert format_cpulist(cpus) == text


def test_unparseable_cpulist_is_none():
    assert parse_cpulist("zero-three") is None
    assert parse_cpulist(None) is None


def test_affinity_matches_mismatches_and_unpinned():
    assert compare_affinity("0-31,64-95", "0-31,64-95") == ("ok", "matches")
    st, why = compare_affinity("0-31,64-95", "32-63,96-127")
    assert st == "mismatch" and "also on 32-63,96-127" in why and "not on 0-31,64-95" in why
    st, why = compare_affinity("0-31,64-95", "0-127")  # unpinned: may run on the far socket
    assert st == "mismatch" and "also on 32-63,96-127" in why
    assert compare_affinity(None, "0-127")[0] == "not-asked"
    assert compare_affinity("0-3", None)[0] == "unknown"


def test_sysfs_bus_id_spelling():
    assert sysfs_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert sysfs_bus_id("0000:17:00.0") == "0000:17:00.0"


def _node_tree(root: Path) -> Path:
    nodes = root / "node"
    for n, cpus, free in ((0, "0-31,64-95", 1000), (1, "32-63,96-127", 2000)):
        d = nodes / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
        (d / "meminfo").write_text(f"Node {n} MemTotal:       4000 kB\nNode {n} MemFree:        {free} kB\nNode {n} MemUsed: 1 kB\n")
    (nodes / "possible").write_text("0-1\n")
    return nodes


def _proc(root: Path, pid: int, cpus: str) -> Path:
    d = root / "proc" / str(pid)
    d.mkdir(parents=True)
    (d / "status").write_text(f"Name:\tpython\nPid:\t{pid}\nCpus_allowed:\tff\nCpus_allowed_list:\t{cpus}\n")
    return root / "proc"


def test_numa_nodes_from_sysfs(tmp_path):
    nodes = read_numa_nodes(str(_node_tree(tmp_path)))
    assert [(n.node, n.cpus, n.cpu_count, n.mem_free_bytes) for n in nodes] == [
        (0, "0-31,64-95", 64, 1000 * 1024),
        (1, "32-63,96-127", 64, 2000 * 1024),
    ]


def test_affinity_from_proc(tmp_path):
    proc = _proc(tmp_path, 4242, "0-31,64-95")
    assert read_affinity(4242, proc_root=str(proc)) == "0-31,64-95"
    assert read_affinity(4243, proc_root=str(proc)) is None


def test_gpu_numa_sample_flags_a_role_on_the_wrong_node(tmp_path):
    nodes = _node_tree(tmp_path)
    proc = _proc(tmp_path, 100, "0-31,64-95")
    _proc(tmp_path, 200, "0-31,64-95")  # decode asked node 1 but runs on node 0's CPUs
    roles = [
        RoleNuma("prefill", 100, 0, "0-31,64-95"),
        RoleNuma("decode", 200, 1, None),  # no declared list: the node's own CPUs from sysfs
        RoleNuma("spare", None, 0, None),
        RoleNuma("free", 100, None, None),
    ]
    s = read_gpu_numa(roles, {0: "prefill"}, nvml=False, node_root=str(nodes), proc_root=str(proc), clock=lambda: 5.0)
    assert not s.nvml_ok and s.nvml_error == "NVML disabled" and s.at == 5.0
    by = {a.role: a for a in s.affinity}
    assert by["prefill"].status == "ok"
    assert by["decode"].status == "mismatch" and by["decode"].flagged
    assert by["decode"].expected_cpus == "32-63,96-127"
    assert by["spare"].status == "no-process"
    assert by["free"].status == "not-asked"


class _FakeNVMLError(Exception):
    pass


def _fake_pynvml(numa_from_nvml: bool) -> types.SimpleNamespace:
    """Two GPUs; the second does not support power reads."""

    def power(h):
        if h == 1:
            raise _FakeNVMLError("Not Supported")
        return 250_000

    def numa(h):
        if not numa_from_nvml:
            raise _FakeNVMLError("Function Not Found")
        return h

    return types.SimpleNamespace(
        NVMLError=_FakeNVMLError,
        nvmlInit=lambda: None,
        nvmlSystemGetDriverVersion=lambda: b"580.1",
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: "NVIDIA H200",
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}",
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=40 + h, memory=1),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=2 * 1024**3, total=141 * 1024**3, free=0),
        nvmlDeviceGetTemperature=lambda h, sensor: 50 + h,
        nvmlDeviceGetPowerUsage=power,
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000,
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=f"00000000:{0x17 + h * 0x20:02X}:00.0".encode()),
        nvmlDeviceGetNumaNodeId=numa,
    )


@pytest.fixture
def fake_nvml(monkeypatch):
    def install(numa_from_nvml: bool = True):
        monkeypatch.setattr(tm, "_nvml", _fake_pynvml(numa_from_nvml))
        monkeypatch.setattr(tm, "_nvml_error", None)

    return install


def test_gpus_through_one_query_function_with_na_for_unsupported(fake_nvml, tmp_path):
    fake_nvml(numa_from_nvml=True)
    ok, why, driver, gpus = tm.read_gpus(pci_root=str(tmp_path))
    assert ok and why is None and driver == "580.1"
    g0, g1 = gpus
    assert (g0.name, g0.util_pct, g0.temperature_c, g0.power_w, g0.power_limit_w) == ("NVIDIA H200", 40, 50, 250.0, 700.0)
    assert g0.mem_total_bytes == 141 * 1024**3 and g0.pcie_bus_id == "00000000:17:00.0"
    assert (g0.numa_node, g0.numa_source) == (0, "nvml")
    assert g1.power_w is NA  # NVMLError → NA, nothing raised
    assert tm.query("nvmlDeviceGetNoSuchThing", 0) is NA


def test_gpu_numa_node_falls_back_to_sysfs(fake_nvml, tmp_path):
    fake_nvml(numa_from_nvml=False)
    for bus, node in (("0000:17:00.0", "0"), ("0000:37:00.0", "-1")):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "numa_node").write_text(node + "\n")
    _ok, _why, _d, (g0, g1) = tm.read_gpus(pci_root=str(tmp_path))
    assert (g0.numa_node, g0.numa_source) == (0, "sysfs")
    assert g1.numa_node is NA and g1.numa_source is NA  # -1: the platform reports no node


def test_nvml_availability_matches_the_machine():
    """Without /dev/nvidia* (CI) NVML is unavailable: a value, not an error. With a GPU, the real library
    answers: at least one device, each with a name."""
    if Path("/dev/nvidiactl").exists():
        ok, why = tm.nvml_status()
        assert ok, why
        assert tm.query("nvmlDeviceGetCount", default=0) >= 1
        return
    ok, why = tm.nvml_status()
    assert not ok and why
    assert tm.query("nvmlDeviceGetCount", default=0) == 0
    s = read_gpu_numa([], {}, nvml=True)
    assert not s.nvml_ok and s.gpus == ()


# --- a deployment on another machine: nvidia-smi, sysfs and /proc read through its Host ------------

# What nvidia-smi 570 prints for --query-gpu=<SMI_FIELDS> --format=csv,noheader,nounits (cells it cannot
# give read "[N/A]"; GPU 1 is idle with power readings unsupported).
SMI_OUT = (
    "0, NVIDIA H200, GPU-5c1f7a0e-2b1d-4f7e-9a51-3c2d8e1f0a11, 37, 81920, 143771, 41, 118.52, 700.00, 00000000:18:00.0, 570.124.06\n"
    "1, NVIDIA H200, GPU-9d0e4b3a-7c2f-4a1e-8b62-1f0e9d8c7b22, 0, 0, 143771, 35, [N/A], [N/A], 00000000:2A:00.0, 570.124.06\n"
)


def _fake_smi(root: Path, out: str = SMI_OUT, rc: int = 0) -> Path:
    """An nvidia-smi that prints *out* only when asked exactly pdctl's query (else fails like the real one)."""
    want = f"--query-gpu={','.join(tm.SMI_FIELDS)} --format=csv,noheader,nounits"
    (root / "smi.out").write_text(out)
    smi = root / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\n[ "$*" = "{want}" ] || {{ echo "bad args: $*" >&2; exit 2; }}\n'
                   f'cat {root / "smi.out"}\nexit {rc}\n')
    smi.chmod(0o755)
    return smi


def _pci_tree(root: Path) -> Path:
    for bus, node in (("0000:18:00.0", "0"), ("0000:2a:00.0", "1")):
        (root / "pci" / bus).mkdir(parents=True)
        (root / "pci" / bus / "numa_node").write_text(node + "\n")
    return root / "pci"


def test_nvidia_smi_rows_parse_with_units_and_na_cells():
    driver, rows = tm.parse_smi_gpus(SMI_OUT)
    assert driver == "570.124.06" and [r["index"] for r in rows] == [0, 1]
    g0, g1 = rows
    assert (g0["name"], g0["util_pct"], g0["temperature_c"], g0["power_w"], g0["power_limit_w"]) == ("NVIDIA H200", 37, 41, 118.52, 700.0)
    assert (g0["mem_used_bytes"], g0["mem_total_bytes"]) == (81920 * 2**20, 143771 * 2**20)  # MiB with nounits
    assert g1["power_w"] is NA and g1["power_limit_w"] is NA and g1["pcie_bus_id"] == "00000000:2A:00.0"
    with pytest.raises(ValueError, match="11 were asked"):
        tm.parse_smi_gpus("0, NVIDIA H200, 37\n")


def test_a_remote_hosts_gpus_numa_and_affinity_are_read_over_ssh(tmp_path):
    """The real loopback sshd: nvidia-smi runs there, sysfs and /proc are read over SFTP."""
    from harness import skip_or_fail
    from harness.sshd import Sshd
    from pdctl.statemachine.hosts import host_for
    from pdctl.statemachine.spec import Host as HostSpec

    if reason := Sshd.skip_reason():
        skip_or_fail(reason)
    server = Sshd.start(tmp_path / "sshd")
    host = host_for(HostSpec(**server.host_spec()), name="gpu-b")
    try:
        nodes, pci = _node_tree(tmp_path), _pci_tree(tmp_path)
        proc = _proc(tmp_path, 300, "32-63,96-127")
        roles = [RoleNuma("decode", 300, 1, None)]
        s = read_gpu_numa(roles, {1: "decode"}, host=host, smi=str(_fake_smi(tmp_path)), node_root=str(nodes),
                          pci_root=str(pci), proc_root=str(proc), clock=lambda: 7.0)
        assert s.nvml_ok and s.source == "nvidia-smi on gpu-b" and s.driver_version == "570.124.06"
        assert [(g.index, g.numa_node, g.numa_source) for g in s.gpus] == [(0, 0, "sysfs"), (1, 1, "sysfs")]
        assert [(n.node, n.cpus) for n in s.nodes] == [(0, "0-31,64-95"), (1, "32-63,96-127")]
        assert [(a.role, a.actual_cpus, a.status) for a in s.affinity] == [("decode", "32-63,96-127", "ok")]
        # nvidia-smi failing there is said, naming the host; NUMA and affinity are still read.
        s = read_gpu_numa(roles, {}, host=host, smi=str(_fake_smi(tmp_path, "NVIDIA-SMI has failed\n", rc=9)),
                          node_root=str(nodes), pci_root=str(pci), proc_root=str(proc))
        assert not s.nvml_ok and s.nvml_error.startswith("nvidia-smi on gpu-b exited 9") and len(s.nodes) == 2
        s = read_gpu_numa(roles, {}, host=host, smi=str(tmp_path / "absent" / "nvidia-smi"), node_root=str(nodes),
                          pci_root=str(pci), proc_root=str(proc))
        assert not s.nvml_ok and "gpu-b" in s.nvml_error and s.affinity[0].status == "ok"
    finally:
        host.close()
        server.stop()


def test_the_console_reads_an_ssh_deployments_gpus_there_not_here(tmp_path, monkeypatch):
    """Collector.gpu passes the deployment's Host when it is another machine (and none for this one)."""
    from pdctl.console import collect
    from pdctl.statemachine.hosts import LocalHost

    seen = []
    monkeypatch.setattr(collect, "read_gpu_numa", lambda roles, owners, **kw: seen.append(kw.get("host")))
    c = collect.Collector(types.SimpleNamespace(deployment=None))
    monkeypatch.setattr(collect, "gpu_owners", lambda dep, topo: {})
    topo = types.SimpleNamespace(roles=[])
    c._host = LocalHost()
    c.gpu(topo, {})
    remote = types.SimpleNamespace(name="gpu-b")
    c._host = remote
    c.gpu(topo, {})
    assert seen == [None, remote]
