"""`pdctl apply --restart ROLE`: a restart of a role nothing of which changed, planned, proven, and refused where it
cannot mean anything."""

from __future__ import annotations

import json

import pytest


def _pids(demo) -> dict[str, int]:  # noqa: ANN001
    st = demo.status()
    return {**{r["name"]: r["main_pid"] for r in st["roles"]}, "router": st["router"]["main_pid"]}


def test_apply_restart_restarts_only_that_role_and_proves_it_again(demo):
    demo.apply()
    before = _pids(demo)
    r = demo.cli("plan", str(demo.spec), "--restart", "decode")
    assert r.returncode == 2, r.stdout + r.stderr  # (changes: apply has work)
    assert "# role.decode will be restarted (disruptive)" in r.stdout and "--restart decode" in r.stdout, r.stdout
    assert _pids(demo) == before  # (plan restarts nothing)
    r = demo.cli("apply", str(demo.spec), "--restart", "decode")
    assert r.returncode == 0, r.stderr
    assert f"restarting pdctl-{demo.name}-decode.service" in r.stderr, r.stderr
    assert "; clients get 503 while decode restarts: one decode" in r.stderr, r.stderr  # (before it starts, as plan)
    planned = [json.loads(x) for x in (demo.state / "audit.log").read_text().splitlines()]
    assert [e.get("restart") for e in planned if e["event"] == "plan"][-2:] == [None, ["decode"]]  # (who asked what)
    assert "kv_link_verified: verified" in r.stderr, r.stderr  # (the link proven again with the new decode server)
    after = _pids(demo)
    assert after["decode"] != before["decode"] and {k: after[k] for k in ("prefill", "router")} == {
        k: before[k] for k in ("prefill", "router")}, (before, after)
    st = demo.status()
    assert st["healthy"] and st["steps"]["decode_up"]["restarted_since"] == [], st["steps"]["decode_up"]
    r = demo.cli("plan", str(demo.spec))
    assert r.returncode == 0, r.stdout + r.stderr  # (a restart is no lasting change: nothing left to do)


def test_a_restart_of_a_role_the_spec_lacks_or_with_a_saved_plan_is_a_usage_error(demo):
    r = demo.cli("apply", str(demo.spec), "--restart", "decoder")
    assert r.returncode == 64, r.stderr
    assert f"'decoder': the spec ({demo.spec}) has no such role" in r.stderr, r.stderr
    assert "its roles are prefill, decode, router" in r.stderr, r.stderr
    assert not (demo.state / "journal.json").exists() and not (demo.state / "audit.log").exists()  # (nothing written)
    saved = demo.tmp / "plan.json"
    assert demo.cli("plan", str(demo.spec), "-o", str(saved)).returncode == 2
    r = demo.cli("apply", str(saved), "--restart", "decode")
    assert r.returncode == 64, r.stderr
    assert "is a saved plan, which applies what it holds" in r.stderr, r.stderr
    assert not (demo.state / "journal.json").exists()


def test_a_plan_saved_with_a_restart_restarts_it_when_applied(demo):
    # (`plan --restart decode -o FILE`, or its --json, then `apply FILE`: refused as "edited after pdctl plan -o")
    demo.apply()
    before = _pids(demo)
    saved = demo.tmp / "plan.json"
    r = demo.cli("plan", str(demo.spec), "--restart", "decode", "-o", str(saved))
    assert r.returncode == 2, r.stderr
    assert [c.get("asked") for c in json.loads(saved.read_text())["changes"]] == [
        "asked on the command line (--restart decode)"]
    r = demo.cli("apply", str(saved))
    assert r.returncode == 0, r.stderr
    after = _pids(demo)
    assert after["decode"] != before["decode"] and after["prefill"] == before["prefill"], (before, after)
    assert demo.status()["healthy"]


def test_a_restart_interrupted_before_it_stopped_the_role_restarts_it_when_asked_again(demo):
    # (the interrupted apply had journalled decode as restarting with its old process, which still ran; asked again, the
    # apply took that very process for one it had started itself, proved it, and said it reached parsers_configured
    # without restarting it; helper-112)
    demo.apply()
    before = _pids(demo)
    events = []

    class StopAtTheRestart:
        def emit(self, event) -> None:  # noqa: ANN001
            events.append(event)
            if event.kind == "info" and event.message.startswith(f"restarting pdctl-{demo.name}-decode.service"):
                raise KeyboardInterrupt  # (as the CLI's signal handler raises it wherever the apply is)

    with pytest.raises(KeyboardInterrupt):
        demo.apply(sink=StopAtTheRestart(), restart=("decode",))
    assert _pids(demo)["decode"] == before["decode"]  # (stopped before the stop began: it runs on)
    done = [e for e in events if e.kind == "apply_interrupted"]
    assert done and done[0].data["stopped"] == [], done  # (and the interruption says nothing was stopped)
    demo.apply(restart=("decode",))
    after = _pids(demo)
    assert after["decode"] != before["decode"] and after["prefill"] == before["prefill"], (before, after)
    assert demo.status()["healthy"]


def test_an_interrupted_restart_counts_a_unit_whose_stop_had_begun_as_stopped():
    # (interrupted while the supervisor stopped decode: its status still read active for a moment, so apply_interrupted
    # said nothing was stopped, and a second later decode was inactive; helper-112)
    import time
    from types import SimpleNamespace

    from pdctl.statemachine.service import STOP_SETTLE_S, _stopped_of

    t0 = time.monotonic()

    class Stopping:
        def status(self, unit: str):  # noqa: ANN202
            going = unit == "decode" and time.monotonic() - t0 > 0.5  # (its supervisor gets to the SIGTERM)
            return SimpleNamespace(state="deactivating" if going else "active")

    assert _stopped_of(Stopping(), {"decode", "prefill"}) == ["decode"]
    assert time.monotonic() - t0 <= 2 * STOP_SETTLE_S + 1  # (bounded: prefill, never stopping, waited for once)
