"""The demo topology from nothing to parsers_configured under a real systemd (a private user
manager, tests/harness/systemd.py), with the real smg router: the same state machine and units
that production runs, only the engine executable differs."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from harness.systemd import user_systemd_session
from pdctl.statemachine import service
from pdctl.statemachine.probes import chat_probe

from .conftest import Demo

pytestmark = [pytest.mark.systemd, pytest.mark.smg, pytest.mark.slow]


def test_demo_reaches_parsers_configured_under_the_real_systemd_user_manager(tmp_path, monkeypatch):
    session = user_systemd_session(tmp_path / "systemd")
    sd = next(session)
    demo = None
    try:
        # systemctl --user from this process reaches the private manager; units go to its HOME.
        monkeypatch.setenv("XDG_RUNTIME_DIR", sd.env["XDG_RUNTIME_DIR"])
        monkeypatch.setenv("HOME", sd.env["HOME"])
        (tmp_path / "demo").mkdir()
        demo = Demo(tmp_path / "demo", mutate=lambda d: d.update(service_manager="systemd-user"))
        result = demo.apply()
        assert result.state == "parsers_configured"
        # Units, not supervised processes: systemd reports them active with their main PIDs.
        names = service.unit_names(service.topology_of(demo.load().deployment))
        for unit in names.values():
            show = sd.systemctl("show", unit, "-p", "ActiveState", "-p", "MainPID").stdout
            assert "ActiveState=active" in show, show
        # The router became active only after both servers did (Requires=/After= + readiness gates).
        def entered(unit: str) -> int:
            out = sd.systemctl("show", unit, "-p", "ActiveEnterTimestampMonotonic").stdout
            return int(out.strip().split("=", 1)[1])

        assert entered(names["router"]) > entered(names["prefill"])
        assert entered(names["router"]) > entered(names["decode"])
        # The target that groups them is active too (apply starts each unit, then the target: it said "inactive (dead)")
        target = f"pdctl-{demo.load().deployment.name}.target"
        assert "ActiveState=active" in sd.systemctl("show", target, "-p", "ActiveState").stdout
        assert demo.status()["target"] == {"unit": target, "enabled": True, "state": "active"}
        with httpx.Client(trust_env=False) as c:
            msg = chat_probe(c, f"http://127.0.0.1:{demo.ports['router']}", "deepseek-v4-flash")["choices"][0]["message"]
        assert msg["reasoning_content"] and msg["tool_calls"]
        assert demo.status()["healthy"]
        # A change that restarts both servers converges in one apply, proven on the new processes, each taken out of
        # the router and put back: the router keeps running (its unit Wants= the servers; Requires= restarted it)
        router_pid = demo.status()["router"]["main_pid"]
        before = {r["name"]: r["main_pid"] for r in demo.status()["roles"]}
        import copy

        d = copy.deepcopy(demo.dict)
        d["model"]["context_length"] = 65536
        result = demo.apply(demo.write(d, "ctx.toml"))
        assert result.state == "parsers_configured"
        st = service.status(demo.load(demo.tmp / "ctx.toml"))
        assert st["healthy"] and all(r["main_pid"] != before[r["name"]] for r in st["roles"]), (before, st["roles"])
        assert st["router"]["main_pid"] == router_pid
        with httpx.Client(trust_env=False) as c:
            for r in st["roles"]:
                assert c.get(f"{r['url']}/server_info").json()["context_length"] == 65536
        # A unit file edited outside pdctl, then started as edited by systemd after a crash: status and plan name it,
        # and apply writes it back and restarts the server, which no longer serves as specified
        unit_path = Path(sd.env["HOME"]) / ".config" / "systemd" / "user" / names["prefill"]
        text = unit_path.read_text()
        assert "--context-length 65536" in text
        unit_path.write_text(text.replace("--context-length 65536", "--context-length 4096"))
        sd.systemctl("daemon-reload")
        crashed = service.status(demo.load(demo.tmp / "ctx.toml"))["roles"][0]
        assert crashed["name"] == "prefill"
        os.kill(crashed["main_pid"], signal.SIGKILL)  # (Restart=on-failure: systemd starts the edited definition)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = service.status(demo.load(demo.tmp / "ctx.toml"))
            if st["roles"][0]["main_pid"] not in (None, crashed["main_pid"]) and st["roles"][0]["healthy"]:
                break
            time.sleep(0.5)
        with httpx.Client(trust_env=False) as c:
            assert c.get(f"{st['roles'][0]['url']}/server_info").json()["context_length"] == 4096
        assert st["edited_units"] == [names["prefill"]], st["edited_units"]
        assert demo.apply(demo.tmp / "ctx.toml").state == "parsers_configured"
        assert unit_path.read_text() == text
        st = service.status(demo.load(demo.tmp / "ctx.toml"))
        assert st["healthy"] and st["edited_units"] == []
        with httpx.Client(trust_env=False) as c:
            assert c.get(f"{st['roles'][0]['url']}/server_info").json()["context_length"] == 65536
        # The target stopped (stopping every unit, PartOf=) and the router started by hand (Wants= pulls the
        # servers back): the units run without their target, which plan names and apply starts
        sd.systemctl("stop", target)
        sd.systemctl("start", names["router"])
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not service.status(demo.load(demo.tmp / "ctx.toml"))["healthy"]:
            time.sleep(0.5)
        loaded = demo.load(demo.tmp / "ctx.toml")
        st = service.status(loaded)
        assert st["healthy"] and st["target"]["state"] == "inactive", st["target"]
        recorded = loaded.journal.read()
        why = service.plan_unsettled(loaded, recorded, service.plan_spec(loaded, recorded))
        assert why.kind == "drift" and f"{target} is inactive" in why.text, why
        assert demo.apply(demo.tmp / "ctx.toml").state == "parsers_configured"
        assert service.status(loaded)["target"]["state"] == "active"
        # The target is enabled (its WantedBy= starts the deployment at boot); one left disabled (by hand, or by a
        # pdctl that did not enable it) is drift that plan names and an apply that changes nothing else enables
        assert sd.systemctl("is-enabled", target).stdout.strip() == "enabled"
        sd.systemctl("disable", target)
        loaded = demo.load(demo.tmp / "ctx.toml")
        recorded = loaded.journal.read()
        why = service.plan_unsettled(loaded, recorded, service.plan_spec(loaded, recorded))
        assert why.kind == "drift" and f"{target} is not enabled" in why.text, why
        assert demo.apply(demo.tmp / "ctx.toml").state == "parsers_configured"
        assert sd.systemctl("is-enabled", target).stdout.strip() == "enabled"
        service.down(demo.load())
        assert demo.pids() == []
        for unit in [*names.values(), target]:
            assert "ActiveState=inactive" in sd.systemctl("show", unit, "-p", "ActiveState").stdout
    finally:
        if demo is not None:
            demo.down()
        session.close()


def test_a_deployment_never_takes_over_or_removes_a_unit_another_deployment_installed(tmp_path, monkeypatch):
    # Unit names are pdctl-NAME-ROLE: deployment X with a prefill role named "a-prefill" names deployment X-a's prefill
    # unit. Nothing checked it: X's apply restarted X-a's server with its own settings (X-a's router stopped with it,
    # then under Requires=), and X's down removed the unit file that by then said deployment=X-a
    from pdctl.statemachine.errors import ApplyFailed

    session = user_systemd_session(tmp_path / "systemd")
    sd = next(session)
    demos: list[Demo] = []
    try:
        monkeypatch.setenv("XDG_RUNTIME_DIR", sd.env["XDG_RUNTIME_DIR"])
        monkeypatch.setenv("HOME", sd.env["HOME"])
        (tmp_path / "x").mkdir()
        (tmp_path / "xa").mkdir()
        x = Demo(tmp_path / "x", mutate=lambda d: (d.update(service_manager="systemd-user"),
                                                    d["prefill"][0].update(name="a-prefill")))
        demos.append(x)
        xa = Demo(tmp_path / "xa", mutate=lambda d: d.update(service_manager="systemd-user", name=f"{x.name}-a"))
        xa.name = xa.dict["name"]
        demos.append(xa)
        shared = f"pdctl-{xa.name}-prefill.service"
        assert service.unit_names(service.topology_of(x.load().deployment))["a-prefill"] == shared
        assert xa.apply().state == "parsers_configured"
        before = {r["name"]: r["main_pid"] for r in xa.status()["roles"]}
        # plan says so beforehand, in apply's words; apply refuses before its first step, changing nothing
        warned = service.host_warnings(x.load(), x.load().journal.read())["binds_unusable"] or ""
        assert f"{shared} (role a-prefill) is deployment {xa.name!r}'s" in warned, warned
        with pytest.raises(ApplyFailed, match="unit names another pdctl deployment has installed, nothing was "
                                              "started or changed") as e:
            x.apply()
        assert e.value.step == "prefill_up" and "pdctl-NAME-ROLE" in e.value.hint
        st = xa.status()
        assert st["healthy"] and {r["name"]: r["main_pid"] for r in st["roles"]} == before, st
        assert f"deployment={xa.name} role=prefill" in (sd.unit_dir / shared).read_text()
        # its down leaves the other deployment's unit alone
        service.down(x.load())
        assert xa.status()["healthy"] and service.unit_names(service.topology_of(xa.load().deployment))
        assert "ActiveState=active" in sd.systemctl("show", shared, "-p", "ActiveState").stdout
    finally:
        for d in demos:
            d.down()
        session.close()
