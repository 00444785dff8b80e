#!/usr/bin/env python3
"""Text capture of the console's GPU/NUMA panel on a GPU machine (issue 5's acceptance run).

Reads NVML (nvidia-ml-py), ``/sys/devices/system/node`` and ``/proc`` exactly as the console's
telemetry worker does, owns each GPU to a role from the spec's topology (default: the seed,
``examples/seed.toml``: prefill on GPUs 0-3 / NUMA 0, decode on 4-7 / NUMA 1), and prints the
panel as text — either a plain render of the panel (default) or the whole console run headless
through Textual's ``run_test`` on the GPU/NUMA tab (``--app``). Starts nothing, changes nothing.

Needs only pdctl's core dependencies and nvidia-ml-py. Works from an installed pdctl or from a
bare checkout (the repository's folders are mapped into the ``pdctl`` namespace on the fly).

Affinity: no role runs here, so each role shows "not running" unless you hand it a PID:
``--pid prefill=1234`` or ``--self-as prefill`` (this process; run it under
``numactl --cpunodebind=0 --membind=0`` to see ``ok``, or unpinned to see the mismatch flagged).

    python benchmarks/gpu_panel_capture.py                       # plain render, 140 columns
    python benchmarks/gpu_panel_capture.py --self-as decode --app --size 120x40
    python benchmarks/gpu_panel_capture.py --smi     # also read the GPUs as for an SSH host and compare

``--smi`` reads the GPUs a second time the way the console reads an SSH host's (``nvidia-smi --query-gpu``
through a Host, NUMA nodes from sysfs), prints that panel too, and exits 1 if the two readings disagree on a
GPU's identity (index, name, UUID, PCIe bus, total memory, NUMA node).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import io
import os
import socket
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bootstrap() -> None:
    """Map the checkout's folders into ``pdctl.*`` when pdctl is not installed."""
    try:
        import pdctl.console.telemetry  # noqa: F401
        import pdctl.statemachine  # noqa: F401

        return
    except ImportError:
        pass
    sys.path.insert(0, str(ROOT))
    import pdctl

    for sub in ("units", "statemachine", "console"):
        name = f"pdctl.{sub}"
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(name, ROOT / sub / "__init__.py", submodule_search_locations=[str(ROOT / sub)])
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[name] = mod
        setattr(pdctl, sub, mod)
        spec.loader.exec_module(mod)  # type: ignore[union-attr]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", nargs="?", default=str(ROOT / "examples" / "seed.toml"))
    ap.add_argument("--pid", action="append", default=[], metavar="ROLE=PID", help="read ROLE's affinity from PID")
    ap.add_argument("--self-as", metavar="ROLE", help="use this process's PID for ROLE")
    ap.add_argument("--app", action="store_true", help="run the whole console headless (Textual run_test) on the GPU tab")
    ap.add_argument("--size", default="140x40", help="columns x rows (default 140x40)")
    ap.add_argument("--smi", action="store_true", help="also read the GPUs through nvidia-smi as for an SSH host; compare")
    args = ap.parse_args()
    _bootstrap()

    from rich.console import Console

    from pdctl.console._gpu import render_gpu_panel
    from pdctl.console.collect import Snapshot, current_topology, gpu_owners, role_numa
    from pdctl.console.telemetry import RoleNuma, nvml_status, read_gpu_numa
    from pdctl.statemachine.service import load

    cols, rows = (int(x) for x in args.size.split("x"))
    loaded = load(args.spec, state_dir=tempfile.mkdtemp(prefix="pdctl-gpu-capture-"))  # never reads a live journal
    topo = current_topology(loaded, None)
    pids = {k: int(v) for k, v in (p.split("=", 1) for p in args.pid)}
    if args.self_as:
        pids[args.self_as] = os.getpid()
    roles = [RoleNuma(r.name, pids.get(r.name), *role_numa(loaded.deployment, r.name)) for r in topo.roles]
    sample = read_gpu_numa(roles, gpu_owners(loaded.deployment, topo))
    ok, why = nvml_status()

    print(f"# pdctl GPU/NUMA panel capture — host {socket.gethostname()}, spec {args.spec} ({loaded.deployment.name})")
    print(f"# NVML: {'ok, driver ' + str(sample.driver_version) if ok else why}; {len(sample.gpus)} GPU(s); {len(sample.nodes)} NUMA node(s)")
    if not args.app:
        con = Console(file=io.StringIO(), width=cols, record=True, color_system=None, force_terminal=False)
        con.print(render_gpu_panel(sample, topo))
        print(con.export_text().rstrip())
        return _compare_with_smi(sample, roles, topo, loaded, cols) if args.smi else 0

    from pdctl.console.app import ConsoleApp
    from pdctl.console.views import expected_states, step_views

    snap = Snapshot(at=sample.at, topology=topo, steps=step_views(expected_states(topo), None, sample.at), gpu=sample)

    async def run() -> str:
        app = ConsoleApp(loaded, live=False, nvml=False)
        async with app.run_test(size=(cols, rows)) as pilot:
            app.show_snapshot(snap)
            await pilot.press("2")
            await pilot.pause(0.3)
            con = Console(file=io.StringIO(), width=cols, height=rows, record=True, color_system=None)
            con.print(app.screen._compositor.render_update(full=True))
            return con.export_text()

    print(asyncio.run(run()).rstrip())
    return 0


def _compare_with_smi(sample, roles, topo, loaded, cols: int) -> int:  # noqa: ANN001
    """Read the GPUs again through nvidia-smi on a Host (the SSH path), print that panel, compare identities."""
    from rich.console import Console

    from pdctl.console._gpu import render_gpu_panel
    from pdctl.console.collect import gpu_owners
    from pdctl.console.telemetry import read_gpu_numa
    from pdctl.statemachine.hosts import LocalHost

    host = LocalHost()
    remote = read_gpu_numa(roles, gpu_owners(loaded.deployment, topo), host=host)
    con = Console(file=io.StringIO(), width=cols, record=True, color_system=None, force_terminal=False)
    con.print(render_gpu_panel(remote, topo))
    print(f"# the same GPUs read as for an SSH host ({remote.source}):")
    print(con.export_text().rstrip())
    if not remote.nvml_ok:
        print(f"# nvidia-smi path failed: {remote.nvml_error}")
        return 1
    keys = ("index", "name", "uuid", "pcie_bus_id", "mem_total_bytes", "numa_node")
    bad = 0
    for a, b in zip(sample.gpus, remote.gpus, strict=False):
        for k in keys:
            va, vb = getattr(a, k), getattr(b, k)
            if k == "numa_node" and a.numa_source == "nvml":
                continue  # sysfs may say -1 (N/A) where NVML knows; only sysfs-vs-sysfs is comparable
            if str(va) != str(vb):
                print(f"# MISMATCH GPU {a.index} {k}: NVML {va!r} vs nvidia-smi {vb!r}")
                bad += 1
        print(f"# GPU {a.index}: util {a.util_pct}/{b.util_pct} %, mem used {a.mem_used_bytes}/{b.mem_used_bytes} B, "
              f"{a.temperature_c}/{b.temperature_c} °C, {a.power_w}/{b.power_w} W (NVML/nvidia-smi)")
    if len(sample.gpus) != len(remote.gpus):
        print(f"# MISMATCH: NVML {len(sample.gpus)} GPU(s), nvidia-smi {len(remote.gpus)}")
        bad += 1
    print(f"# identity fields {'agree' if not bad else f'DISAGREE ({bad})'} between NVML and nvidia-smi")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
