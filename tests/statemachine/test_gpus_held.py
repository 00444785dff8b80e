"""A GPU a role will run on that a compute process outside the deployment uses: `pdctl plan` warns of it and
`pdctl apply` refuses before its first step, starting nothing (SGLang sizes its KV cache from the memory left and
fails "Not enough memory" after loading its weights, minutes in).

nvidia-smi is a script first on PATH that answers the two queries pdctl makes as the real one does
(``--query-gpu=index,pci.bus_id --format=csv,noheader`` and ``--query-compute-apps=gpu_bus_id,pid,used_memory
--format=csv,noheader,nounits``), the processes read from a file the test writes. The processes it lists are real
ones this test starts (or the demo's own servers), so that pdctl reads their command lines and lineage from /proc.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdctl.statemachine import service
from pdctl.statemachine.errors import HostError
from pdctl.statemachine.hosts import LocalHost
from pdctl.statemachine.inventory import gpu_processes, parse_compute_apps

BUSES = [f"00000000:{0x17 + 0x10 * i:02X}:00.0" for i in range(9)]


def _fake_smi(tmp_path: Path) -> Path:
    """Put an nvidia-smi on PATH (by the caller's monkeypatch) listing the lines of the returned file as its compute
    processes (``gpu index, pid, MiB``, written by the test; the script answers with bus ids)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    apps = tmp_path / "apps.txt"
    apps.write_text("")
    gpus = "\n".join(f"{i}, {b}" for i, b in enumerate(BUSES))
    buses = " ".join(BUSES)
    (bindir / "nvidia-smi").write_text(f"""#!/bin/sh
case "$*" in
"--query-gpu=index,pci.bus_id --format=csv,noheader") printf '%s\\n' "{gpus}" | tr -d '\\r' ;;
"--query-compute-apps=gpu_bus_id,pid,used_memory --format=csv,noheader,nounits")
  set -- {buses}
  while IFS=, read -r gpu pid mib; do
    [ -n "$gpu" ] || continue
    eval "bus=\\${{$((gpu + 1))}}"
    echo "$bus, $pid,$mib"
  done < {apps} ;;
*) echo "unexpected: $*" >&2; exit 2 ;;
esac
""")
    (bindir / "nvidia-smi").chmod(0o755)
    return apps


@pytest.fixture
def smi(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    apps = _fake_smi(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return apps


def _sleeper(*marker: str) -> subprocess.Popen:
    """A process whose command line ends with *marker* (as a pdctl supervisor's names its unit folder)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *marker])


def _unused_pid() -> int:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    return next(p for p in range(pid_max - 1, 1, -1) if not Path(f"/proc/{p}").exists())


def test_compute_apps_output_parses_with_memory_not_told_and_no_processes():
    assert parse_compute_apps("00000000:17:00.0, 4242, 70123\n00000000:27:00.0, 7, [N/A]\n") == [
        ("00000000:17:00.0", 4242, 70123), ("00000000:27:00.0", 7, None)]
    assert parse_compute_apps("") == [] and parse_compute_apps("No running processes found\n") == []
    with pytest.raises(ValueError, match="unexpected nvidia-smi line"):
        parse_compute_apps("00000000:17:00.0, pid, 1\n")


def test_gpu_processes_maps_bus_ids_to_indices_and_says_none_without_nvidia_smi(smi, monkeypatch, tmp_path):
    smi.write_text("3, 100, 512\n0, 200, [N/A]\n")
    host = LocalHost()
    assert [tuple(p) for p in gpu_processes(host)] == [(0, 200, None), (3, 100, 512)]
    (smi.parent / "bin" / "nvidia-smi").write_text(
        '#!/bin/sh\ncase "$*" in --query-gpu*) echo "0, 00000000:17:00.0" ;; *) echo "what, is, this line" ;; esac\n')
    with pytest.raises(HostError, match="nvidia-smi on host .* answered what pdctl cannot read"):
        gpu_processes(host)  # (an nvidia-smi there that answers garbage is no "none")
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))  # (a host without the NVIDIA driver)
    assert gpu_processes(host) is None


def _failing_smi(tmp_path: Path) -> None:
    (tmp_path / "bin" / "nvidia-smi").write_text(
        "#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\" >&2\nexit 9\n")


def test_a_failing_nvidia_smi_is_a_warning_in_plan_and_apply_not_silence(demo, smi, tmp_path):
    # (a driver that would not answer read as a host without nvidia-smi: no word in plan or apply)
    _failing_smi(tmp_path)
    data = json.loads(demo.cli("plan", str(demo.spec), "--json").stdout)
    assert data["gpus_held"] is None and data["ports_held"] == [], data
    assert "nvidia-smi on host" in data["gpus_unchecked"] and "exited 9" in data["gpus_unchecked"], data
    text = demo.cli("plan", str(demo.spec)).stdout
    assert "Warning: the GPUs could not be checked for processes outside the deployment: nvidia-smi on host" in text
    r = demo.cli("apply", str(demo.spec))
    assert r.returncode == 0, r.stderr
    assert "warning: the GPUs could not be checked for processes outside the deployment" in r.stderr, r.stderr


def test_a_process_on_the_gpu_of_a_role_the_apply_keeps_refuses_nothing(demo, smi):
    # (a monitoring process on decode's GPU refused every later apply, a no-change one too, naming decode_up, a step
    # that would start nothing)
    demo.apply()
    foreign = _sleeper("--monitor")
    try:
        smi.write_text(f"4, {foreign.pid}, 300\n")
        assert json.loads(demo.cli("plan", str(demo.spec), "--json").stdout)["gpus_held"] == []
        r = demo.cli("apply", str(demo.spec))
        assert r.returncode == 0, r.stderr
        changed = copy.deepcopy(demo.dict)
        changed["model"]["context_length"] = 65536  # (now decode restarts: its GPU 4 is in the way)
        spec = demo.write(changed, "ctx.toml")
        r = demo.cli("apply", str(spec))
        assert r.returncode == 3 and f"decode needs GPU 4 at decode_up, used by PID {foreign.pid}" in r.stderr, r.stderr
        # decode running unsupervised (its supervisor killed): apply restarts it, so plan asks about its GPUs too
        # (it said "gpus_held": [], nothing asked, and apply then refused)
        unit = service.unit_names(service.topology_of(demo.load().deployment))["decode"]
        os.kill(int((demo.state / "supervisor" / "services" / unit / "watchdog.pid").read_text()), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and demo.status()["roles"][1]["supervised"]:
            time.sleep(0.2)
        held = json.loads(demo.cli("plan", str(demo.spec), "--json").stdout)["gpus_held"]
        assert [(g["gpu"], g["role"], g["pid"]) for g in held] == [(4, "decode", foreign.pid)], held
    finally:
        foreign.kill()
        foreign.wait(10)


def test_plan_warns_and_apply_refuses_gpus_used_outside_the_deployment_starting_nothing(demo, smi):
    foreign = _sleeper("--train")
    hidden = _unused_pid()  # (a PID this host's /proc does not show: a container's)
    try:
        smi.write_text(f"1, {foreign.pid}, 70000\n5, {hidden}, [N/A]\n8, {foreign.pid}, 10\n")  # (GPU 8: no role's)
        plan = demo.cli("plan", str(demo.spec), "--json")
        assert plan.returncode == 2, plan.stderr
        held = json.loads(plan.stdout)["gpus_held"]
        assert [(x["gpu"], x["role"], x["step"], x["pid"], x["used_mib"]) for x in held] == [
            (1, "prefill", "prefill_up", foreign.pid, 70000), (5, "decode", "decode_up", hidden, None)], held
        assert "--train" in held[0]["command"] and held[1]["command"] == "", held
        text = demo.cli("plan", str(demo.spec)).stdout
        assert "Warning: GPUs this deployment's roles will run on are in use outside it" in text, text
        assert f"  ! prefill needs GPU 1 at prefill_up, used by PID {foreign.pid} (" in text, text
        assert (f"  ! decode needs GPU 5 at decode_up, used by PID {hidden} (not in the host's /proc); apply only warns: "
                "nvidia-smi may name PIDs of another PID namespace (a container's), this deployment's own servers "
                "included") in text, text
        assert "hint: stop those processes (nvidia-smi lists them) or give the roles other GPUs" in text, text

        r = demo.cli("apply", str(demo.spec))
        assert r.returncode == 3, (r.returncode, r.stderr)
        assert "GPUs in use outside this deployment, nothing was started or changed" in r.stderr, r.stderr
        assert f"prefill needs GPU 1 at prefill_up, used by PID {foreign.pid}" in r.stderr, r.stderr
        assert demo.pids() == [] and demo.load().journal.read().deployed is None
        refusal = next(line for line in r.stderr.splitlines() if "GPUs in use outside" in line)
        assert f"PID {hidden}" not in refusal, refusal  # (a warning before it, not part of the refusal)
        assert f"warning: decode needs GPU 5 at decode_up, used by PID {hidden}" in r.stderr, r.stderr

        # that PID alone does not refuse the apply: nvidia-smi may name this deployment's own servers so
        smi.write_text(f"5, {hidden}, 512\n")
        r = demo.cli("apply", str(demo.spec))
        assert r.returncode == 0, r.stderr
        assert f"warning: decode needs GPU 5 at decode_up, used by PID {hidden}" in r.stderr, r.stderr
    finally:
        foreign.kill()
        foreign.wait(10)


def test_the_deployments_own_servers_on_its_gpus_are_no_warning_and_another_deployments_are_named(demo, smi):
    demo.apply()
    st = demo.status()
    own = {r["name"]: r["main_pid"] for r in st["roles"]}
    smi.write_text(f"0, {own['prefill']}, 120000\n4, {own['decode']}, 120000\n")
    plan = demo.cli("plan", str(demo.spec), "--json")
    assert plan.returncode == 0 and json.loads(plan.stdout)["gpus_held"] == [], plan.stdout
    r = demo.cli("apply", str(demo.spec))
    assert r.returncode == 0, r.stderr  # (the servers it keeps use their GPUs)

    # a spec renamed while deployed leaves its old name's servers on the GPUs (of decode, which a change restarts)
    unit = "pdctl-olddemo-decode.service"
    old = _sleeper(f"{demo.tmp}/old-state/supervisor/services/{unit}")
    changed = copy.deepcopy(demo.dict)
    changed["model"]["context_length"] = 65536
    spec = demo.write(changed, "ctx.toml")
    try:
        smi.write_text(f"0, {own['prefill']}, 120000\n6, {old.pid}, 90000\n")
        held = json.loads(demo.cli("plan", str(spec), "--json").stdout)["gpus_held"]
        assert [(x["gpu"], x["pid"], x["other_deployment"]) for x in held] == [
            (6, old.pid, f"pdctl unit {unit} (state directory {demo.tmp}/old-state (process supervisor))")], held
        r = demo.cli("apply", str(spec))
        assert r.returncode == 3 and f"started for pdctl unit {unit}" in r.stderr, r.stderr
        assert "another pdctl deployment runs on these GPUs" in r.stderr, r.stderr
        assert {r["name"]: r["main_pid"] for r in demo.status()["roles"]} == own  # nothing restarted
    finally:
        old.kill()
        old.wait(10)
