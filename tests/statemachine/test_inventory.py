"""``inventory = "discover"``: a host's GPUs (nvidia-smi) and NUMA layout (sysfs) read through its Host.

nvidia-smi is a script on PATH that prints what the real one prints for ``--query-gpu=index,pci.bus_id
--format=csv,noheader`` (and fails for anything else); sysfs is a temporary tree with the real layout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from harness import skip_or_fail
from harness.deploy import discover_spec, interrupted_while_nvidia_smi_runs
from pdctl.statemachine.errors import HostError, SpecError
from pdctl.statemachine.hosts import LocalHost
from pdctl.statemachine.inventory import discover, parse_gpu_query, sysfs_bus_id
from pdctl.statemachine.service import load

BUSES = ["00000000:17:00.0", "00000000:3D:00.0", "00000000:99:00.0", "00000000:B1:00.0"]


def _fake_smi(tmp_path, buses, *, fail: bool = False):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    lines = "\n".join(f"{i}, {b}" for i, b in enumerate(buses))
    body = 'echo "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver." >&2; exit 9' if fail \
        else f'[ "$*" = "--query-gpu=index,pci.bus_id --format=csv,noheader" ] || exit 2\ncat <<"X"\n{lines}\nX'
    (bindir / "nvidia-smi").write_text(f"#!/bin/sh\n{body}\n")
    (bindir / "nvidia-smi").chmod(0o755)
    return str(bindir)


def _sysfs(tmp_path, numa_of_bus: dict[str, int], nodes: dict[int, str]):
    pci = tmp_path / "pci"
    for bus, node in numa_of_bus.items():
        (pci / bus).mkdir(parents=True)
        (pci / bus / "numa_node").write_text(f"{node}\n")
    nroot = tmp_path / "node"
    for n, cpus in nodes.items():
        (nroot / f"node{n}").mkdir(parents=True)
        (nroot / f"node{n}" / "cpulist").write_text(cpus + "\n")
    (nroot / "possible").write_text("0-1\n")  # not a node directory
    return str(pci), str(nroot)


def test_bus_ids_and_query_output_parse():
    assert sysfs_bus_id("00000000:3D:00.0") == "0000:3d:00.0"
    assert parse_gpu_query("1, 00000000:3D:00.0\n0, 00000000:17:00.0\n") == ["00000000:17:00.0", "00000000:3D:00.0"]
    with pytest.raises(ValueError, match="indices"):
        parse_gpu_query("0, a\n2, b\n")
    with pytest.raises(ValueError, match="unexpected"):
        parse_gpu_query("No devices were found\n")


def test_discover_reads_gpus_in_index_order_with_their_numa_nodes(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, BUSES) + os.pathsep + os.environ["PATH"])
    pci, nodes = _sysfs(tmp_path, {"0000:17:00.0": 0, "0000:3d:00.0": 0, "0000:99:00.0": 1, "0000:b1:00.0": -1},
                        {0: "0-31,64-95", 1: "32-63,96-127"})
    inv = discover(LocalHost(), pci_root=pci, node_root=nodes)
    assert inv.gpu_numa == (0, 0, 1, -1)
    assert inv.numa_cpus == {0: "0-31,64-95", 1: "32-63,96-127"}


def test_a_host_without_a_working_nvidia_smi_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, [], fail=True) + os.pathsep + os.environ["PATH"])
    with pytest.raises(HostError, match="nvidia-smi exited 9: NVIDIA-SMI has failed") as e:
        discover(LocalHost())
    assert 'inventory = "declared"' in e.value.hint
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(HostError, match="cannot discover the GPUs") as e:
        discover(LocalHost())
    assert "install the NVIDIA driver" in e.value.hint


def test_plan_checks_placement_against_what_the_host_reports(tmp_path, monkeypatch):
    spec = discover_spec(tmp_path)
    # Validation contacts no host: no nvidia-smi needed.
    monkeypatch.setenv("PATH", str(tmp_path / "empty") + os.pathsep + "/usr/bin:/bin")
    load(spec, state_dir=tmp_path / "state")
    # The seed runs prefill on GPUs 0-3 and decode on 4-7; a host with 6 GPUs cannot hold it.
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, [f"00000000:{i:02X}:00.0" for i in range(6)]) + os.pathsep
                       + os.environ["PATH"])
    with pytest.raises(SpecError, match=r"GPU \[6, 7\] not on host"):
        load(spec, state_dir=tmp_path / "state", discover=True)
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, [f"00000000:{i:02X}:00.0" for i in range(8)]) + os.pathsep
                       + os.environ["PATH"])
    # With 8 GPUs the GPU count holds; the NUMA nodes are this machine's real sysfs (decode asks for node 1).
    if os.path.isdir("/sys/devices/system/node/node1"):
        load(spec, state_dir=tmp_path / "state", discover=True)
    else:
        with pytest.raises(SpecError, match="NUMA node 1 does not exist on host") as e:
            load(spec, state_dir=tmp_path / "state", discover=True)
        assert "GPU [" not in str(e.value)


def test_the_cli_plan_names_the_host_and_the_fix_when_it_cannot_discover(tmp_path):
    spec = discover_spec(tmp_path)
    env = {**os.environ, "PATH": _fake_smi(tmp_path, [], fail=True) + os.pathsep + os.environ["PATH"],
           "PDCTL_STATE_DIR": str(tmp_path / "state")}
    r = subprocess.run([sys.executable, "-m", "pdctl", "plan", str(spec)], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 1, r.stderr
    assert "cannot discover the GPUs of host" in r.stderr and 'inventory = "declared"' in r.stderr
    r = subprocess.run([sys.executable, "-m", "pdctl", "validate", str(spec)], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("sig,rc,said", [(signal.SIGINT, 130, ""), (signal.SIGTERM, 143, "terminated (SIGTERM); ")])
def test_an_interrupted_plan_ends_the_nvidia_smi_it_started(tmp_path, sig, rc, said):
    # pdctl runs a host's commands in their own session (a timeout kills the group): Ctrl-C at the terminal never
    # reached nvidia-smi and SIGTERM ended pdctl at once, so a wedged nvidia-smi ran on after pdctl had gone, with
    # nothing left to time it out. Here it answers only after 30 s, and says when it was started.
    r, took, ended = interrupted_while_nvidia_smi_runs(tmp_path, ["plan"], sig)
    out, err = r.stdout, r.stderr
    assert r.returncode == rc, err
    assert ended, "nvidia-smi still runs after pdctl exited"
    assert took < 10, took  # not nvidia-smi's 30 s
    assert out == "" and err.rstrip().splitlines()[-1] == said + "interrupted: a plan changes nothing; run it again", err
    assert not (tmp_path / "state").exists()


def test_what_plan_discovers_is_what_the_units_bind_to(tmp_path, monkeypatch):
    # inventory = "discover": the GPUs' NUMA nodes and each node's CPUs read at plan time reach the roles' units
    # (NUMAMask= / CPUAffinity=), as declared facts do; before, only the rules saw them and the units ran unpinned.
    from pdctl.statemachine import inventory
    from pdctl.statemachine.launch import numa_for
    from pdctl.statemachine.rules import Inventory

    spec = discover_spec(tmp_path)
    assert numa_for(load(spec, state_dir=tmp_path / "state").deployment, "decode")[1] is None  # nothing declared
    found = Inventory((0, 0, 0, 0, 1, 1, 1, 1), {0: "0-31,64-95", 1: "32-63,96-127"})
    monkeypatch.setattr(inventory, "discover", lambda host: found)
    dep = load(spec, state_dir=tmp_path / "state", discover=True).deployment
    assert numa_for(dep, "prefill") == (0, "0-31,64-95")
    assert numa_for(dep, "decode") == (1, "32-63,96-127")


def test_status_and_chat_of_a_discovering_deployment_compare_with_what_apply_discovered(make_demo, tmp_path,
                                                                                      monkeypatch):
    # apply binds the roles to what it discovers (here node 0's CPUs, from this machine's sysfs); status and chat read
    # the spec without discovering and called the deployment different from its spec, which plan did not
    import json

    if not os.path.isdir("/sys/devices/system/node/node0"):
        skip_or_fail("no NUMA node 0 in this machine's sysfs")
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, [f"00000000:{i:02X}:00.0" for i in range(8)]) + os.pathsep
                       + os.environ["PATH"])

    def discovering(d) -> None:  # noqa: ANN001
        d["hosts"]["local"]["inventory"] = "discover"
        d["prefill"][0]["numa_node"] = d["decode"][0]["numa_node"] = 0

    demo = make_demo(discovering)
    r = demo.cli("apply", str(demo.spec))
    assert r.returncode == 0, r.stderr
    cpus = open("/sys/devices/system/node/node0/cpulist").read().strip()
    assert demo.load().journal.read().deployed.roles[0].settings["numa_binding"]["cpus"] == cpus
    st = json.loads(demo.cli("status", str(demo.spec), "--json").stdout)
    assert st["healthy"] and st["matches_spec"], st
    r = demo.cli("chat", str(demo.spec), "hello", "--timeout", "60")
    assert r.returncode == 0 and "runs other settings" not in r.stderr, r.stderr
    assert demo.cli("plan", str(demo.spec)).returncode == 0
