"""Steps and probes without processes: facts in, verdicts out (httpx.MockTransport, fixtures)."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from pdctl.statemachine import probes
from pdctl.statemachine.errors import InvalidTransition, ProbeError
from pdctl.statemachine.machine import PD_STATES, StateMachine
from pdctl.statemachine.spec import parse_spec
from pdctl.statemachine.steps import check_chat_response, expected_server_info, router_mismatches, server_info_mismatches
from pdctl.statemachine.topology import topology_of

from harness.sim import free_ports

from .specs import seed_dict

SEED_TOPO = topology_of(parse_spec(seed_dict()))

WORKERS = {
    "workers": [
        {"url": "http://127.0.0.1:30010", "worker_type": "prefill", "is_healthy": True, "bootstrap_port": 8998,
         "metadata": {"disaggregation_mode": "prefill"}},
        {"url": "http://127.0.0.1:30020", "worker_type": "decode", "is_healthy": True, "bootstrap_port": None,
         "metadata": {"disaggregation_mode": "decode"}},
    ],
    "total": 2,
    "stats": {"prefill_count": 1, "decode_count": 1, "regular_count": 0},
}


def test_the_machine_only_moves_forward_one_state_at_a_time():
    m = StateMachine(PD_STATES)
    m.advance("kernels_built")
    with pytest.raises(InvalidTransition, match="next state is 'prefill_up'"):
        m.advance("decode_up")
    with pytest.raises(InvalidTransition):
        m.advance("kernels_built")
    for s in PD_STATES[1:]:
        m.advance(s)
    assert m.done and m.next_state is None


def test_router_workers_matching_the_topology_have_no_mismatch():
    workers, stats = probes.parse_workers(WORKERS)
    assert router_mismatches(workers, stats, SEED_TOPO) == []


def test_router_workers_with_swapped_roles_are_named():
    data = json.loads(json.dumps(WORKERS))
    data["workers"][0]["url"], data["workers"][1]["url"] = data["workers"][1]["url"], data["workers"][0]["url"]
    bad = router_mismatches(*probes.parse_workers(data), SEED_TOPO)
    text = "; ".join(bad)
    assert "http://127.0.0.1:30020 registered as prefill, expected decode" in text
    assert "disaggregation_mode=decode (swapped roles?)" in text


def test_an_unhealthy_or_missing_worker_is_named():
    data = json.loads(json.dumps(WORKERS))
    data["workers"][1]["is_healthy"] = False
    assert "http://127.0.0.1:30020 is not healthy" in router_mismatches(*probes.parse_workers(data), SEED_TOPO)
    data["workers"].pop()
    data["stats"]["decode_count"] = 0
    bad = router_mismatches(*probes.parse_workers(data), SEED_TOPO)
    assert "worker http://127.0.0.1:30020 (decode) missing" in bad and "decode_count = 0, expected 1" in bad


def test_router_workers_of_another_shape_raise_a_probe_error():
    with pytest.raises(ProbeError):
        probes.parse_workers({"error": "nope"})


def test_server_info_mismatch_names_each_field():
    role = SEED_TOPO.role("decode")
    exp = expected_server_info(role, SEED_TOPO)
    info = dict(exp, tool_call_parser=None, context_length=65536, page_size=256)
    bad = server_info_mismatches(info, exp)
    assert "tool_call_parser is None, expected 'deepseekv4'" in bad
    assert "context_length is 65536, expected 131072" in bad
    assert "page_size" not in exp and len(bad) == 2  # the seed leaves V4's pages to SGLang
    assert exp["disaggregation_mode"] == "decode" and exp["tp_size"] == 4


def test_server_info_expected_as_sglang_reports_its_aliases():
    # SGLang serves "mooncake" for the mooncake_tcp backend (the hook rewrites it, with MC_FORCE_TCP=1) and may
    # report bf16 as bfloat16 (DeepSeek DSA); expecting the spec's words failed prefill_up on every real host
    d = seed_dict()
    d["kv_transfer"]["backend"] = "mooncake_tcp"
    d["model"]["kv_cache_dtype"] = "bf16"
    topo = topology_of(parse_spec(d))
    for name in ("prefill", "decode"):
        exp = expected_server_info(topo.role(name), topo)
        assert exp["disaggregation_transfer_backend"] == "mooncake"
        served = dict(exp, kv_cache_dtype="bfloat16")
        assert server_info_mismatches(served, exp) == []
        assert server_info_mismatches(dict(exp), exp) == []  # a model that keeps "bf16"
        assert server_info_mismatches(dict(exp, kv_cache_dtype="fp8_e4m3"), exp) == [
            "kv_cache_dtype is 'fp8_e4m3', expected 'bf16'"]
        assert server_info_mismatches(dict(exp, disaggregation_transfer_backend="mooncake_tcp"), exp) == []
        assert server_info_mismatches(dict(exp, disaggregation_transfer_backend="nixl"), exp) == [
            "disaggregation_transfer_backend is 'nixl', expected 'mooncake'"]
    exp = dict(exp, tool_call_parser="qwen25")  # a deprecated name SGLang 0.5.23 serves as its new one
    assert server_info_mismatches(dict(exp, tool_call_parser="qwen"), exp) == []
    assert server_info_mismatches(dict(exp, tool_call_parser="glm"), exp) == ["tool_call_parser is 'glm', expected 'qwen25'"]


def test_kv_link_probe_asks_the_bootstrap_route_in_the_target_releases_query():
    # 0.5.6's bootstrap server wants engine_rank/target_dp_group: the 0.5.23 query got 400 "Missing inputs" until
    # kv_link_verified timed out
    from pdctl.statemachine.steps import _facts

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(dict(request.url.params))
        return httpx.Response(200, json={"page_size": 64})

    c = httpx.Client(transport=httpx.MockTransport(handler))
    for version, keys in (("0.5.6", {"engine_rank", "target_dp_group", "target_pp_rank"}),
                          ("0.5.23", {"prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"})):
        d = seed_dict()
        d["sglang_version"] = version
        query = dict(_facts(topology_of(parse_spec(d))).bootstrap_route_query)
        assert probes.bootstrap_route(c, "127.0.0.1", 8998, query=query) == (200, {"page_size": 64})
        assert seen.pop() == dict.fromkeys(keys, "-1")


PARSERS = {"reasoning_parser": "deepseek-v4", "tool_call_parser": "deepseekv4", "chat_template": None}


def _resp(msg):
    return {"choices": [{"message": msg, "finish_reason": "tool_calls"}]}


def test_chat_with_parsed_reasoning_and_tool_calls_passes():
    ok, bad = check_chat_response(
        _resp({"content": "", "reasoning_content": "think", "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}),
        PARSERS,
    )
    assert bad == [] and len(ok) == 2


def test_chat_with_raw_markup_left_in_content_fails():
    raw = '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">...'
    ok, bad = check_chat_response(_resp({"content": "<think>hmm</think>" + raw, "reasoning_content": None, "tool_calls": None}), PARSERS)
    assert any("no reasoning_content" in b for b in bad)
    assert any("no tool_calls" in b for b in bad)
    assert any("raw model markup" in b for b in bad)


def test_metric_totals_sum_every_label_set():
    text = (
        "# HELP sglang:num_transfer_failed_reqs_total x\n# TYPE sglang:num_transfer_failed_reqs_total counter\n"
        'sglang:num_transfer_failed_reqs_total{engine_type="decode",tp_rank="0"} 2.0\n'
        'sglang:num_transfer_failed_reqs_total{engine_type="decode",tp_rank="1"} 1.0\n'
    )
    assert probes.parse_metric_total(text, "sglang:num_transfer_failed_reqs_total") == 3.0
    assert probes.parse_metric_total(text, "sglang:num_bootstrap_failed_reqs_total") == 0.0


def test_probes_through_a_mock_transport():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/route":
            assert dict(request.url.params) == probes.BOOTSTRAP_ROUTE_QUERY
            return httpx.Response(503, text="Prefill server not fully registered yet (0 workers registered).")
        if request.url.path == "/readiness":
            return httpx.Response(200, json={"status": "ready", "healthy_workers": 2, "total_workers": 2})
        if request.url.path == "/workers":
            return httpx.Response(200, json=WORKERS)
        if request.url.path == "/health":
            return httpx.Response(503)
        return httpx.Response(404, json={"detail": "Not Found"})

    c = httpx.Client(transport=httpx.MockTransport(handler))
    status, body = probes.bootstrap_route(c, "127.0.0.1", 8998)
    assert status == 503 and "not fully registered" in body
    assert probes.router_readiness(c, "http://r")[0] == 200
    assert probes.router_workers(c, "http://r")[1]["prefill_count"] == 1
    assert probes.health(c, "http://s") == 503
    with pytest.raises(ProbeError, match="HTTP 404"):
        probes.server_info(c, "http://s")


def test_health_of_a_closed_port_is_zero():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    c = httpx.Client(transport=httpx.MockTransport(refuse))
    assert probes.health(c, "http://127.0.0.1:1") == 0


def test_headless_apply_says_a_failed_steps_message_once_then_where_it_stopped(monkeypatch, capsys):
    # No processes: the service's apply is replaced by one that reports a failed decode_up as the real one does
    # (step_failed with its hint, then apply_failed) and raises the step's error.
    from types import SimpleNamespace

    from pdctl.console import cli
    from pdctl.console.exit_codes import ExitCode
    from pdctl.statemachine import service
    from pdctl.statemachine.errors import ApplyFailed
    from pdctl.statemachine.events import Event

    def failing_apply(loaded, *, sink, **kw):  # noqa: ANN001, ANN003
        sink.emit(Event("step_started", "decode_up: started", step="decode_up"))
        sink.emit(Event("step_failed", "decode_up: FAILED — decode: unit x failed while starting", step="decode_up",
                        data={"hint": "read the decode logs"}))
        sink.emit(Event("apply_failed", "decode: unit x failed while starting", step="decode_up"))
        raise ApplyFailed("decode: unit x failed while starting", step="decode_up", hint="read the decode logs")

    monkeypatch.setattr(service, "load", lambda *a, **k: SimpleNamespace(warnings=[], deployment=SimpleNamespace(name="d")))
    monkeypatch.setattr(service, "apply", failing_apply)
    with pytest.raises(SystemExit) as e:
        cli.main(["apply", "spec.toml"])
    assert e.value.code == ExitCode.STEP_FAILED
    err = capsys.readouterr().err
    assert err.count("unit x failed while starting") == 1, err
    assert err.count("hint: read the decode logs") == 1, err
    assert err.rstrip().splitlines()[-1].startswith("apply stopped at decode_up"), err


def test_a_start_failure_names_the_log_line_that_says_why_first():
    from pdctl.statemachine.steps import startup_failure, startup_hint

    # What the process supervisor's output.log holds after three failed starts (its own lines prefixed).
    argparse_log = [
        "pdctl-supervise[5305]: started main process 5311: python -m sglang.launch_server --max-running-requests abc",
        "usage: launch_server.py [-h] --model-path MODEL_PATH [--tokenizer-path TOKENIZER_PATH]",
        "                        [--host HOST] [--port PORT] [--max-running-requests MAX_RUNNING_REQUESTS]",
        "python -m sglang.launch_server: error: argument --max-running-requests: invalid int value: 'abc'",
        "pdctl-supervise[5305]: main process 5311 exited, code=2",
        "pdctl-supervise[5305]: start limit hit: 3 starts in 2 s (limit 3 per 10830 s)",
        "pdctl-supervise[5305]: failed (start-limit-hit)",
    ]
    msg = startup_failure("decode: unit pdctl-demo-decode.service", argparse_log)
    assert msg.splitlines()[0] == ("decode: unit pdctl-demo-decode.service failed while starting: python -m "
                                   "sglang.launch_server: error: argument --max-running-requests: invalid int value: 'abc'")
    assert all(line in msg for line in argparse_log)  # the context is kept in full
    assert "launch flag was refused" in startup_hint(msg)
    # systemd's own verdict lines are never the cause either.
    journal = ["launch_server.py: error: argument --tool-call-parser: invalid choice: 'x'",
               "pdctl-demo-decode.service: Main process exited, code=exited, status=2/INVALIDARGUMENT",
               "pdctl-demo-decode.service: Failed with result 'exit-code'."]
    assert startup_failure("decode", journal).splitlines()[0].endswith(": launch_server.py: error: argument --tool-call-parser: invalid choice: 'x'")
    traceback_log = ["Traceback (most recent call last):", '  File "x.py", line 3, in <module>',
                     "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
                     "pdctl-supervise[40]: main process 41 exited, code=1"]
    assert startup_hint(startup_failure("prefill", traceback_log)) is None
    assert startup_failure("prefill", traceback_log).splitlines()[0].endswith(": torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    # Nothing from the role: the supervisor's reason, without its prefix; with no reason at all, no cause.
    exec_log = ["pdctl-supervise[7]: cannot start /opt/smg: [Errno 2] No such file or directory: '/opt/smg'",
                "pdctl-supervise[7]: failed (exec)"]
    assert startup_failure("router unit", exec_log).splitlines()[0] == (
        "router unit failed while starting: cannot start /opt/smg: [Errno 2] No such file or directory: '/opt/smg'")
    assert startup_failure("router unit", ["listening", "pdctl-supervise[7]: failed (start-limit-hit)"]).splitlines()[0] == (
        "router unit failed while starting")


def test_an_interrupted_headless_apply_says_so_and_how_to_go_on(monkeypatch, capsys):
    # Ctrl-C during an apply: typer turns the KeyboardInterrupt into exit code 130, which came back silently before.
    from types import SimpleNamespace

    from pdctl.console import cli
    from pdctl.console.exit_codes import ExitCode
    from pdctl.statemachine import service
    from pdctl.statemachine.events import Event

    def interrupted_apply(loaded, *, sink, **kw):  # noqa: ANN001, ANN003
        sink.emit(Event("step_started", "prefill_up: started", step="prefill_up"))
        raise KeyboardInterrupt

    monkeypatch.setattr(service, "load", lambda *a, **k: SimpleNamespace(warnings=[], deployment=SimpleNamespace(name="d")))
    monkeypatch.setattr(service, "apply", interrupted_apply)
    with pytest.raises(SystemExit) as e:
        cli.main(["apply", "spec.toml"])
    assert e.value.code == ExitCode.INTERRUPTED
    last = capsys.readouterr().err.rstrip().splitlines()[-1]
    assert last.startswith("interrupted:") and "pdctl status" in last and "pdctl down" in last, last


def _json_lines(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def test_a_json_apply_refused_before_planning_still_ends_with_an_event(tmp_path, capsys, monkeypatch):
    # An invalid spec, or a lock held by another apply: the --json stream used to be empty (stderr and the exit code
    # said it); it now ends with apply_failed naming the error, and nothing starts.
    from pdctl.console import cli
    from pdctl.console.exit_codes import ExitCode
    from pdctl.statemachine import service

    from .specs import DEMO

    bad = tmp_path / "bad.toml"
    bad.write_text(DEMO.read_text().replace("port = 30010", 'port = "30010"', 1))
    with pytest.raises(SystemExit) as e:
        cli.main(["apply", str(bad), "--json", "--state-dir", str(tmp_path / "s1")])
    assert e.value.code == ExitCode.ERROR
    last = _json_lines(capsys.readouterr().out)[-1]
    assert last["kind"] == "apply_failed" and last["data"]["error_type"] == "SpecError", last
    assert last["data"]["error"] == last["message"]  # (the text, as every --json error object's "error" is)
    assert "prefill[0].port: must be a whole number" in last["message"]

    state = tmp_path / "s2"
    monkeypatch.setattr(service, "deployment_host", lambda dep: pytest.fail("the apply got past the held lock"))
    with service.load(DEMO, state_dir=state).journal.lock("apply"):
        with pytest.raises(SystemExit) as e:
            cli.main(["apply", str(DEMO), "--json", "--state-dir", str(state)])
    assert e.value.code == ExitCode.LOCKED
    events = _json_lines(capsys.readouterr().out)
    assert [ev["kind"] for ev in events] == ["apply_failed"], events
    assert events[0]["data"]["error_type"] == "LockHeld" and "is locked by PID" in events[0]["message"]


def test_status_text_names_the_lock_holder_before_an_earlier_failure():
    # A new apply keeps the last run's failed steps in the journal until it starts its own: the holder comes first.
    from pdctl.console.cli import _applying_text

    holder = {"pid": 42, "user": "op", "host": "gpu1", "purpose": "apply", "since": "2026-11-30T15:00:00+0000"}
    st = {"applying": True, "steps": {"decode_up": {"status": "failed"}}, "locked_by": holder}
    assert _applying_text(st) == " [apply in progress: PID 42 (op@gpu1) since 2026-11-30T15:00:00+0000]"
    assert "failed at decode_up" in _applying_text({**st, "locked_by": None})
    assert "down in progress" in _applying_text({"applying": False, "steps": {}, "locked_by": {**holder, "purpose": "down"}})
    assert _applying_text({"applying": False, "steps": {}, "locked_by": None}) == ""


def test_sigterm_handling_is_undone_after_the_command(tmp_path, monkeypatch):
    # The headless apply turns SIGTERM into an interrupt only while it runs; the previous handler comes back (here
    # the apply gets past loading the spec and is refused by a held lock).
    import signal

    from pdctl.console import cli
    from pdctl.console.exit_codes import ExitCode
    from pdctl.statemachine import service

    from .specs import DEMO

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(service, "deployment_host", lambda dep: pytest.fail("the apply got past the held lock"))
    with service.load(DEMO, state_dir=tmp_path).journal.lock("down"):
        with pytest.raises(SystemExit) as e:
            cli.main(["apply", str(DEMO), "--state-dir", str(tmp_path)])
    assert e.value.code == ExitCode.LOCKED
    assert {s: signal.getsignal(s) for s in before} == before


def test_the_next_lock_holder_removes_the_temp_files_of_writes_killed_before_their_rename(tmp_path):
    # (a killed apply's ".journal.json.PID.tmp" stayed in the state directory for good)
    import subprocess

    from pdctl.statemachine.journal import Journal, JournalState

    j = Journal(tmp_path, "demo")
    j.write(JournalState(name="demo"))
    gone = subprocess.Popen(["true"])
    gone.wait(5)
    live = subprocess.Popen(["sleep", "30"])
    try:
        dead_tmp = j.dir / f".journal.json.{gone.pid}.tmp"
        live_tmp = j.dir / f".journal.json.{live.pid}.tmp"
        for p in (dead_tmp, live_tmp):
            p.write_text("{half")
        with j.lock("apply"):
            assert not dead_tmp.exists() and live_tmp.exists()  # (a live writer's may be in flight)
        assert j.read().name == "demo"
    finally:
        live.kill()
        live.wait(5)


def test_a_held_lock_names_what_holds_it(tmp_path, capsys, monkeypatch):
    from pdctl.console import cli
    from pdctl.statemachine import service

    from .specs import DEMO

    monkeypatch.setattr(service, "deployment_host", lambda dep: pytest.fail("the apply got past the held lock"))
    with service.load(DEMO, state_dir=tmp_path).journal.lock("down"):
        with pytest.raises(SystemExit):
            cli.main(["apply", str(DEMO), "--state-dir", str(tmp_path)])
    assert "hint: wait for the other down to finish" in capsys.readouterr().err


def test_an_interrupted_down_is_audited(tmp_path, monkeypatch):
    from pdctl.statemachine import service

    from .specs import DEMO

    def stopped(*a, **k):  # noqa: ANN002, ANN003
        raise KeyboardInterrupt

    monkeypatch.setattr(service, "_down_locked", stopped)
    loaded = service.load(DEMO, state_dir=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        service.down(loaded)
    assert [r["event"] for r in loaded.journal.audit_records()][-2:] == ["down-started", "down-interrupted"]


def test_an_interrupted_down_says_to_run_down_again_not_apply(tmp_path, monkeypatch, capsys):
    # ("run the same command again … or `pdctl down SPEC --yes`": the same command, said twice)
    from pdctl.console import cli
    from pdctl.console.exit_codes import ExitCode
    from pdctl.statemachine import service

    from .specs import DEMO

    def stopped(*a, **k):  # noqa: ANN002, ANN003
        raise KeyboardInterrupt

    monkeypatch.setattr(service, "_down_locked", stopped)
    with pytest.raises(SystemExit) as e:
        cli.main(["down", str(DEMO), "--yes", "--state-dir", str(tmp_path)])
    assert e.value.code == ExitCode.INTERRUPTED
    err = capsys.readouterr().err.strip().splitlines()[-1]
    # (with the state directory it was given: without it the command named looks elsewhere)
    assert err.startswith(f"interrupted: what is already stopped stays stopped; run `pdctl down {DEMO} --state-dir "
                          f"{tmp_path} --yes` again"), err
    assert "run the same command" not in err
    assert err.endswith(f"(`pdctl status {DEMO} --state-dir {tmp_path}` shows what still runs)"), err


@pytest.mark.parametrize("interrupted", [True, False], ids=["interrupted", "finished"])
def test_a_ctrl_c_while_down_says_its_last_line_is_ignored(tmp_path, monkeypatch, capsys, interrupted):
    # (helper-108: a second Ctrl-C ~20 ms after the first killed down by the signal as it said where it stopped; one
    # just after down had finished made it exit 130, "interrupted", with everything stopped)
    import signal

    from pdctl.console import cli
    from pdctl.console.exit_codes import ExitCode
    from pdctl.statemachine import service

    from .specs import DEMO

    def down(*a, **k):  # noqa: ANN002, ANN003
        if interrupted:  # the first Ctrl-C, while down works
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
            raise AssertionError("the Ctrl-C did not stop down")
        return []

    said = cli._err

    def ctrl_c_then_say(text: str) -> None:  # the Ctrl-C comes as the command writes its last words
        os.kill(os.getpid(), signal.SIGINT)
        said(text)

    monkeypatch.setattr(service, "down", down)
    monkeypatch.setattr(cli, "_err", ctrl_c_then_say)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as e:
        cli.main(["down", str(DEMO), "--yes", "--state-dir", str(tmp_path)])
    assert e.value.code == (ExitCode.INTERRUPTED if interrupted else ExitCode.OK)
    err = capsys.readouterr().err
    assert ("interrupted: what is already stopped stays stopped" in err) == interrupted, err
    assert signal.getsignal(signal.SIGINT) is before  # (in-process: the caller's handler is back)


def test_an_interrupted_apply_names_its_own_spec_and_state_dir_quoted(tmp_path, monkeypatch, capsys):
    # (helper-108: it said `pdctl status SPEC` literally, where an interrupted down names its spec; a path with a
    # space is quoted so that the line can be pasted)
    import shutil

    from pdctl.console import cli
    from pdctl.console.exit_codes import ExitCode
    from pdctl.statemachine import service
    from pdctl.statemachine.events import Event

    from .specs import DEMO

    spec = tmp_path / "my specs" / "demo.toml"
    spec.parent.mkdir()
    shutil.copy(DEMO, spec)
    state = tmp_path / "state"

    def interrupted(loaded, *, sink, **k):  # noqa: ANN001, ANN003
        sink.emit(Event("apply_started", "applying plan 0", data={"plan_id": "0"}))
        raise KeyboardInterrupt

    monkeypatch.setattr(service, "apply", interrupted)
    with pytest.raises(SystemExit) as e:
        cli.main(["apply", str(spec), "--state-dir", str(state)])
    assert e.value.code == ExitCode.INTERRUPTED
    err = capsys.readouterr().err.strip().splitlines()[-1]
    named = f"'{spec}' --state-dir {state}"
    assert err == (f"interrupted: what already runs stays as it is (`pdctl status {named}` shows it); run the same "
                   f"command again to converge, or `pdctl down {named} --yes` to stop it"), err


def test_a_saved_plan_without_its_spec_is_an_error_not_a_usage_mistake(tmp_path, capsys):
    from pdctl.console import cli
    from pdctl.console.exit_codes import ExitCode

    from .specs import DEMO

    out = tmp_path / "p.json"
    with pytest.raises(SystemExit):
        cli.main(["plan", str(DEMO), "--state-dir", str(tmp_path), "-o", str(out)])
    plan = json.loads(out.read_text())
    plan["spec_path"] = ""
    out.write_text(json.dumps(plan))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main(["apply", str(out), "--json", "--state-dir", str(tmp_path)])
    assert e.value.code == ExitCode.ERROR
    captured = capsys.readouterr()
    last = _json_lines(captured.out)[-1]
    assert last["kind"] == "apply_failed" and "names no spec file" in last["message"], last
    assert "pdctl plan SPEC -o FILE" in captured.err


def test_an_interrupt_before_the_run_journals_its_target_names_no_earlier_runs_step(tmp_path):
    # Ctrl-C during the port checks: the journal still holds a killed earlier apply's "running" decode_up, which is
    # not where this run stopped
    from pdctl.statemachine.events import ListSink
    from pdctl.statemachine.journal import Journal, JournalState, StepRecord
    from pdctl.statemachine.plan import make_plan
    from pdctl.statemachine.service import _interrupted

    topo = topology_of(parse_spec(seed_dict()))
    j = Journal(tmp_path, topo.name)
    state = j.write(JournalState(name=topo.name, target=topo, steps={"decode_up": StepRecord(status="running")}))
    plan = make_plan(None, topo)
    sink = ListSink()
    _interrupted(j, state, plan, sink, stale=dict(state.steps))
    assert sink.events[-1].step is None and "during" not in sink.events[-1].message
    assert j.read().steps["decode_up"].status == "running" and j.audit_records()[-1]["step"] is None
    state.steps = {"prefill_up": StepRecord(status="running")}  # this run's own step: named
    _interrupted(j, state, plan, sink, stale={"decode_up": StepRecord(status="running")})
    assert sink.events[-1].step == "prefill_up" and j.read().steps["prefill_up"].status == "interrupted"


def test_a_sigterm_whose_record_the_full_disk_refuses_still_exits_as_terminated(tmp_path, monkeypatch, capsys):
    # (exited 1, as for any error: `timeout` and CI runners read 143 as "stopped by the signal I sent")
    import errno
    import os
    import signal

    from pdctl.console import cli
    from pdctl.console.exit_codes import ExitCode
    from pdctl.statemachine import service

    from .specs import DEMO

    def apply(*a, **k):  # noqa: ANN002, ANN003
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # through the CLI's handler: KeyboardInterrupt
            signal.pause()  # (not reached: the handler raises before the signal is delivered twice)
        except KeyboardInterrupt:  # the engine journals where it stopped, and the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "journal.json")) from None

    monkeypatch.setattr(service, "apply", apply)
    with pytest.raises(SystemExit) as e:
        cli.main(["apply", str(DEMO), "--state-dir", str(tmp_path)])
    assert e.value.code == ExitCode.TERMINATED
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'journal.json'}: {os.strerror(errno.ENOSPC)}" in err
    assert "terminated (SIGTERM); " in err


def test_the_kernels_are_built_for_the_decode_ranks_local_heads():
    # SGLang's local MLA heads are num_attention_heads // attn_tp_size: with attention-DP a TP8 decode rank holds
    # all 128 heads, not 16 (the build verified a shape no rank ran)
    from pdctl.statemachine.service import kernels_build_command
    from pdctl.statemachine.spec import parse_spec

    from .specs import dsv32_dict

    d = dsv32_dict()
    cmd, _ = kernels_build_command(parse_spec(d))
    assert cmd[cmd.index("--heads") + 1:cmd.index("--kv-formats")] == ["32"]  # TP4, no attention-DP
    d["decode"][0]["attn_dp"] = 4
    cmd, _ = kernels_build_command(parse_spec(d))
    assert cmd[cmd.index("--heads") + 1:cmd.index("--kv-formats")] == ["128"]
    d["decode"][0]["attn_dp"] = 2
    cmd, _ = kernels_build_command(parse_spec(d))
    assert cmd[cmd.index("--heads") + 1:cmd.index("--kv-formats")] == ["64"]


def test_the_kernels_are_built_as_the_service_user_whose_servers_extend_their_cache():
    from pdctl.statemachine.service import kernels_build_command
    from pdctl.statemachine.spec import parse_spec

    from .specs import dsv32_dict

    d = dsv32_dict()
    plain, manifest = kernels_build_command(parse_spec(d))
    d.update(service_manager="systemd-system", service_user="sglang")
    cmd, same = kernels_build_command(parse_spec(d))
    assert cmd == ["runuser", "-u", "sglang", "--", *plain] and same == manifest


def test_a_worker_registered_under_another_model_name_is_a_router_mismatch():
    data = json.loads(json.dumps(WORKERS))
    assert router_mismatches(*probes.parse_workers(data), SEED_TOPO) == []  # no model_id reported: not judged
    for w in data["workers"]:
        w["model_id"] = "deepseek-v4-flash"  # the seed's served_name
    assert router_mismatches(*probes.parse_workers(data), SEED_TOPO) == []
    data["workers"][0]["model_id"] = "old-name"
    assert router_mismatches(*probes.parse_workers(data), SEED_TOPO) == [
        "http://127.0.0.1:30010 is registered for model 'old-name', but its server serves 'deepseek-v4-flash'"]


def test_a_json_file_that_is_not_a_plan_is_named_briefly(tmp_path, capsys):
    # (a plan file of {} printed pydantic's whole report, seven errors with links)
    from pdctl.console import cli
    from pdctl.console.exit_codes import ExitCode

    bad = tmp_path / "x.plan"
    bad.write_text("{}")
    with pytest.raises(SystemExit) as e:
        cli.main(["apply", str(bad), "--state-dir", str(tmp_path)])
    assert e.value.code == ExitCode.ERROR
    err = capsys.readouterr().err
    assert f"{bad}: not a pdctl plan (7 field(s) missing or wrong: plan_id, deployment," in err
    assert "errors.pydantic.dev" not in err


def test_status_marks_a_proof_that_a_later_apply_took_again_stale_too(tmp_path, monkeypatch):
    # a step a re-apply found proven is journalled "skipped", with that proof: after its server crashed and its
    # supervisor restarted it, status marked kv_link_verified and parsers_configured but not prefill_up itself
    import subprocess

    from pdctl.statemachine import launch, service
    from pdctl.statemachine.journal import JournalState, StepRecord
    from pdctl.statemachine.topology import topology_of
    from pdctl.units import ServiceStatus

    from .specs import DEMO

    loaded = service.load(DEMO, state_dir=tmp_path)
    topo = topology_of(loaded.deployment)
    then = time.time() - 30
    loaded.journal.write(JournalState(name=topo.name, deployed=topo, steps={
        "kernels_built": StepRecord(status="skipped", started_at=then, finished_at=then),
        "prefill_up": StepRecord(status="skipped", proof={"summary": "prefill serves"}, started_at=then, finished_at=then),
        "decode_up": StepRecord(status="done", proof={"summary": "decode serves"}, started_at=then, finished_at=then)}))
    younger = subprocess.Popen(["sleep", "30"])  # (a process that started after the proofs)
    try:
        class Manager:
            def status(self, unit: str) -> ServiceStatus:
                return ServiceStatus(unit, "active", main_pid=younger.pid if "-prefill." in unit else 1)  # (1: since boot)

            def unit_file_not_pdctls(self, unit: str) -> str | None:
                return None

            def installed_units_of(self, deployment: str) -> list[str]:
                return []

        monkeypatch.setattr(launch, "manager_for", lambda *a, **k: Manager())
        steps = service.status(loaded)["steps"]
    finally:
        younger.kill()
        younger.wait(5)
    prefill = f"pdctl-{topo.name}-prefill.service"
    assert steps["prefill_up"]["restarted_since"] == [prefill], steps
    assert steps["decode_up"]["restarted_since"] == [] and steps["kernels_built"]["restarted_since"] == [], steps


def test_status_calls_the_step_of_a_killed_apply_interrupted_not_running(tmp_path):
    # (an apply killed with SIGKILL leaves its step journalled as running, and status said "running" with no apply)
    from pdctl.statemachine import service
    from pdctl.statemachine.journal import JournalState, StepRecord
    from pdctl.statemachine.topology import topology_of

    from .specs import DEMO

    loaded = service.load(DEMO, state_dir=tmp_path)
    topo = topology_of(loaded.deployment)
    loaded.journal.write(JournalState(name=topo.name, target=topo, steps={
        "kernels_built": StepRecord(status="skipped"), "prefill_up": StepRecord(status="running")}))
    st = service.status(loaded)
    assert st["steps"]["prefill_up"] == {"status": "interrupted", "age_s": None, "restarted_since": [],
                                         "summary": "its apply was killed while it ran (the next apply resumes it)"}
    with loaded.journal.lock("apply"):  # an apply that holds the lock is running it
        assert service.status(loaded)["steps"]["prefill_up"]["status"] == "running"


def test_the_kernels_proof_names_the_gpu_and_its_architecture_from_the_manifest():
    # (the summary read "verified on NVIDIA H200 (?)": it looked for a key the manifest does not have; seen on the H200)
    from types import SimpleNamespace

    from pdctl.statemachine.errors import VerifyFailed
    from pdctl.statemachine.steps import KernelsBuilt

    manifest = {"ok": True, "gpu": {"name": "NVIDIA H200", "capability": "sm_90", "sm_count": 132}}
    ctx = SimpleNamespace(kernels_manifest="/c/pdctl-kernels-manifest.json", kernels_command=["py", "-m", "x"],
                          host=SimpleNamespace(read_file=lambda p: json.dumps(manifest).encode()))
    assert KernelsBuilt().verify(ctx).summary == "kernels built and verified on NVIDIA H200 (sm_90, 132 SMs)"
    manifest["ok"] = False
    with pytest.raises(VerifyFailed):
        KernelsBuilt().verify(ctx)


def test_a_plan_file_that_is_not_json_says_so(tmp_path):
    from pdctl.statemachine.errors import PdctlError
    from pdctl.statemachine.service import load_saved_plan

    bad = tmp_path / "cut.plan"
    bad.write_text('{"plan_id": 1')
    with pytest.raises(PdctlError) as e:
        load_saved_plan(bad)
    assert "not a readable pdctl plan: not valid JSON (" in e.value.message


def test_down_and_status_work_with_a_spec_that_breaks_a_rule(tmp_path, capsys):
    # (a spec half-edited during an incident, e.g. decode's GPUs overlapping prefill's, blocked the emergency stop)
    from pdctl.console import cli
    from pdctl.console.exit_codes import ExitCode

    from .specs import demo_dict, dump_toml

    d = demo_dict()
    d["decode"][0]["gpus"] = [0, 5, 6, 7]
    # (off the demo's fixed ports: down with nothing installed looks at what holds them, e.g. the README's demo)
    ports = free_ports(7)
    d["prefill"][0].update(port=ports[0], bootstrap_port=ports[1], nccl_port=ports[2])
    d["decode"][0].update(port=ports[3], nccl_port=ports[4])
    d["router"].update(port=ports[5], prometheus_port=ports[6])
    spec = tmp_path / "broken.toml"
    spec.write_text(dump_toml(d))
    with pytest.raises(SystemExit) as e:
        cli.main(["validate", str(spec)])
    assert e.value.code == ExitCode.ERROR
    capsys.readouterr()
    for argv, rc in ((["status", str(spec)], ExitCode.ERROR), (["down", str(spec), "--yes"], ExitCode.OK)):
        with pytest.raises(SystemExit) as e:
            cli.main([*argv, "--state-dir", str(tmp_path / "state")])
        err = capsys.readouterr().err
        assert e.value.code == rc, err
        assert "note: the spec breaks 1 rule(s)" in err and "decode[0].gpus" in err, err


def test_status_names_the_router_workers_it_holds_unhealthy():
    # (it read "workers: prefill 1, decode 1" from smg's counts while decode was down: registered is not serving)
    from pdctl.console.cli import _router_workers_text

    def worker(kind: str, healthy: bool) -> dict:
        return {"url": f"http://127.0.0.1:1/{kind}", "worker_type": kind, "is_healthy": healthy,
                "bootstrap_port": None, "disaggregation_mode": kind, "model_id": "m"}

    rt = {"workers": [worker("prefill", True), worker("decode", False)], "stats": {"prefill_count": 1, "decode_count": 1}}
    assert _router_workers_text(rt) == "prefill 1, decode 1 (1 unhealthy)"
    rt["workers"][1]["is_healthy"] = True
    assert _router_workers_text(rt) == "prefill 1, decode 1"
    assert _router_workers_text({"workers": [worker("prefill", True)]}) == "prefill 1, decode 0"  # decode gone
    assert _router_workers_text({"workers": [worker("regular", True)]}, "single") == "regular 1"
    assert _router_workers_text({"workers": []}) == "prefill 0, decode 0"
    assert _router_workers_text({"stats": {"prefill_count": 2}}) == "prefill 2, decode ?"  # no /workers: smg's counts


def test_router_faults_say_which_ones_waiting_cannot_mend():
    # (the router step told them apart by matching its own messages' words: a reworded message would have made a
    # swapped-roles router wait out its whole bound instead of restarting at once)
    from pdctl.statemachine.steps import router_faults

    data = json.loads(json.dumps(WORKERS))
    data["workers"][1]["is_healthy"] = False
    assert [k for _t, k in router_faults(*probes.parse_workers(data), SEED_TOPO)] == [None]
    data = json.loads(json.dumps(WORKERS))
    data["workers"][0]["url"], data["workers"][1]["url"] = data["workers"][1]["url"], data["workers"][0]["url"]
    assert "swapped" in {k for _t, k in router_faults(*probes.parse_workers(data), SEED_TOPO)}
    data = json.loads(json.dumps(WORKERS))
    data["workers"][0]["model_id"] = "old-name"
    assert [k for _t, k in router_faults(*probes.parse_workers(data), SEED_TOPO)] == ["model"]


def test_a_resume_keeps_only_what_an_apply_toward_the_same_target_proved():
    from pdctl.statemachine.journal import JournalState, StepRecord
    from pdctl.statemachine.service import proven_by_unfinished

    d = seed_dict()
    d["model"]["context_length"] = 8192
    target = topology_of(parse_spec(d))
    state = JournalState(name=target.name, deployed=SEED_TOPO, target=target,
                         steps={"kernels_built": StepRecord("skipped"), "prefill_up": StepRecord("done"),
                                "decode_up": StepRecord("running")})
    assert proven_by_unfinished(state, target) == {"prefill"}
    state.steps["decode_up"] = StepRecord("interrupted")
    assert proven_by_unfinished(state, target) == {"prefill"}  # an interrupted step proved nothing
    state.steps.update(decode_up=StepRecord("skipped"), kv_link_verified=StepRecord("done"),
                       router_exposed=StepRecord("done"))
    assert proven_by_unfinished(state, target) == {"prefill", "decode", "router"}
    assert proven_by_unfinished(state, SEED_TOPO) == set()  # another target: what it proved is not this spec
    state.target = None  # no unfinished apply: the steps are the recorded deployment's
    assert proven_by_unfinished(state, target) == set()


def test_a_port_holders_long_command_is_cut_after_a_whole_argument():
    # (it was cut at 160 characters wherever that fell: "… --kv-cache-dtype " read as the holder's last argument)
    from pdctl.statemachine.ports import _shortened

    argv = "python3 -m sglang.launch_server " + " ".join(f"--flag-{i} value{i}" for i in range(20))
    short = _shortened(argv)
    assert short.endswith(" …") and len(short) <= 162
    kept = short[:-2].split(" ")
    assert kept == argv.split(" ")[:len(kept)] and len(kept) < len(argv.split(" "))  # whole arguments, in order
    assert _shortened("nc -l 30001") == "nc -l 30001"
    assert _shortened("x" * 200) == "x" * 160 + " …"  # one long word: cut where it must be
    # an argument holding a newline (python3 -c 'import x\nserve()') broke the one-line warning in two
    assert _shortened("python3 -c import os\nos.system('x')\t") == "python3 -c import os\\nos.system('x')\\t"


def test_running_definition_reads_what_the_running_process_runs_from_its_journal_record():
    # restarting:<fp>@<pid>: an interrupted apply rewrote the unit file (for another spec) while that process ran <fp>;
    # only that same main PID still runs it: one its supervisor restarted after a crash ran the rewritten file
    from pdctl.statemachine.steps import RESTARTING, STARTED, running_definition

    assert running_definition("ab12", 7) == "ab12"  # proven running
    assert running_definition(STARTED + "ab12", 7) == "ab12"
    assert running_definition(f"{RESTARTING}:ab12@7", 7) == "ab12"
    assert running_definition(f"{RESTARTING}:ab12@7", 8) is None  # restarted since, from the rewritten file
    assert running_definition(f"{RESTARTING}:ab12@7", None) is None  # not running
    assert running_definition(f"{RESTARTING}:ab12@77", 7) is None
    assert running_definition(RESTARTING, 7) is None and running_definition(None, 7) is None
    assert running_definition(f"{RESTARTING}:@7", 7) is None


def test_runtime_drift_counts_a_router_started_for_other_workers_as_lasting_and_an_unhealthy_one_as_an_answer(
        monkeypatch):
    # (plan said "No changes" of a deployment whose router registered another topology's workers)
    from types import SimpleNamespace

    from pdctl.statemachine import service

    role = {"name": "prefill", "state": "active", "health": 200, "healthy": True, "supervised": True, "port_owned": True}
    router = {"state": "active", "readiness": 200, "supervised": True, "mismatches": [], "mismatches_lasting": []}
    seen = {"roles": [role], "router": router, "target": None}
    monkeypatch.setattr(service, "status", lambda loaded, host=None: seen)
    recorded = SimpleNamespace(deployed=object())
    assert service.runtime_drift(None, recorded) == ([], [])
    router["mismatches"] = ["http://127.0.0.1:30020 is not healthy"]
    assert service.runtime_drift(None, recorded) == ([], ["router: http://127.0.0.1:30020 is not healthy"])
    router["mismatches"] = ["unexpected worker http://127.0.0.1:30010 (regular)", "http://127.0.0.1:30010 is not healthy"]
    router["mismatches_lasting"] = ["unexpected worker http://127.0.0.1:30010 (regular)"]
    assert service.runtime_drift(None, recorded) == (
        ["router active, readiness 200, its workers differ from the deployment: unexpected worker "
         "http://127.0.0.1:30010 (regular)"], [])
    # a PD router missing a worker answers /readiness 503 too: still drift, not a probe that a busy router may fail
    router["readiness"] = 503
    router["mismatches"] = router["mismatches_lasting"] = ["worker http://127.0.0.1:30020 (decode) missing"]
    assert service.runtime_drift(None, recorded) == (
        ["router active, readiness 503, its workers differ from the deployment: worker http://127.0.0.1:30020 "
         "(decode) missing"], [])


class _SysfsHost:
    """A host whose /sys says it has NUMA nodes 0 and 1 and the CPUs *online*."""

    name = "local"

    def __init__(self, online: str) -> None:
        self.files = {"/sys/devices/system/cpu/online": online.encode(), "/sys/devices/system/node/online": b"0-1\n"}

    def exists(self, path: str) -> bool:
        return path in ("/sys/devices/system/node", "/sys/devices/system/node/node0", "/sys/devices/system/node/node1")

    def read_file(self, path: str) -> bytes:
        return self.files[path]


def test_cpus_a_role_is_pinned_to_that_the_host_lacks_are_refused_before_anything():
    # (declared numa_cpus naming CPUs the host lacks: the process supervisor's sched_setaffinity failed, which it
    # ignored, and apply proved roles running on CPUs of no particular node; systemd fails such a unit, exit 214)
    from types import SimpleNamespace

    from pdctl.statemachine.errors import ApplyFailed
    from pdctl.statemachine.steps import numa_nodes_missing

    dep = parse_spec(seed_dict())  # numa_cpus = { 0 = "0-31,64-95", 1 = "32-63,96-127" }
    with pytest.raises(ApplyFailed) as e:
        numa_nodes_missing(SimpleNamespace(dep=dep, host=_SysfsHost("0-63\n")))
    assert e.value.message == (
        'CPUs the host local does not have (its CPUs: 0-63), nothing was started or changed: '
        'hosts.local.numa_cpus.0 = "0-31,64-95" (lacks 64-95); hosts.local.numa_cpus.1 = "32-63,96-127" (lacks 96-127)')
    assert e.value.step == "prefill_up" and "/sys/devices/system/node/node<N>/cpulist" in e.value.hint
    numa_nodes_missing(SimpleNamespace(dep=dep, host=_SysfsHost("0-127\n")))  # every CPU there: nothing to say


@pytest.fixture
def programs_dir():
    """A folder every account may enter, with ``open/`` (scripts anyone may run) and ``closed/`` (0700: root's only,
    as /root is), removed afterwards. Under /tmp, not pytest's tmp_path, whose folders are 0700."""
    import shutil
    import tempfile
    from pathlib import Path

    top = Path(tempfile.mkdtemp(prefix="pdctl-user-", dir="/tmp"))
    top.chmod(0o755)
    for sub, mode in (("open", 0o755), ("closed", 0o700)):
        (top / sub).mkdir(mode=mode)
        (top / sub).chmod(mode)
        for name, text in (("python", "#!/bin/sh\nexit 0\n"), ("smg", "#!/bin/sh\nexit 0\n"),
                           ("smg-via-closed", f"#!{top}/closed/python\n")):
            (top / sub / name).write_text(text)
            (top / sub / name).chmod(0o755)
    yield top
    shutil.rmtree(top)


def _user_ctx(tmp_path, host=None, **top):  # noqa: ANN001, ANN003
    from types import SimpleNamespace

    from harness.deploy import demo_dict
    from pdctl.statemachine.hosts import LocalHost
    from pdctl.statemachine.launch import unit_set_for

    d = demo_dict()
    router = top.pop("router", {})
    d["router"].update(router)
    d["engine"].update(top.pop("engine", {}))
    d.update(top)
    dep = parse_spec(d)
    return SimpleNamespace(dep=dep, topology=topology_of(dep), host=host or LocalHost(),
                           units=unit_set_for(dep, state_dir=str(tmp_path)))


def test_a_service_user_the_host_lacks_or_cannot_run_as_is_refused_before_anything(tmp_path, programs_dir):
    # (each unit would fail at its start, systemd's exit 217, after its predecessor was stopped; the engine's Python
    # linked into root's home made the process supervisor's exec fail, and the router's smg script likewise)
    import os

    from harness import skip_or_fail
    from pdctl.statemachine.errors import ApplyFailed
    from pdctl.statemachine.hosts import LocalHost
    from pdctl.statemachine.steps import service_user_unusable

    if os.geteuid() != 0:
        skip_or_fail("running as another account needs root (CI runs as root)")
    ok = {"engine": {"python": f"{programs_dir}/open/python"}, "router": {"executable": f"{programs_dir}/open/smg"}}
    service_user_unusable(_user_ctx(tmp_path, service_user="nobody", **ok))  # all of it runnable: nothing to say
    service_user_unusable(_user_ctx(tmp_path, service_user="root"))  # (root: no check of programs or ports)

    with pytest.raises(ApplyFailed) as e:
        service_user_unusable(_user_ctx(tmp_path, service_user="pdctl-no-such-account", **ok))
    name = LocalHost().name
    assert e.value.message.startswith(f"service_user = 'pdctl-no-such-account' is not an account on host {name}"), e.value
    assert e.value.step == "prefill_up" and "useradd --system --create-home pdctl-no-such-account" in e.value.hint

    closed = {"engine": {"python": f"{programs_dir}/closed/python"}, "router": ok["router"]}
    with pytest.raises(ApplyFailed) as e:
        service_user_unusable(_user_ctx(tmp_path, service_user="nobody", **closed))
    assert f"cannot execute {programs_dir}/closed/python (engine.python) on host {name}" in e.value.message, e.value
    assert "nothing was started or changed" in e.value.message and "engine.python" in e.value.hint

    # (a venv's python links to the interpreter it was made from: the message names where the link leads)
    (programs_dir / "open" / "venv-python").symlink_to(programs_dir / "closed" / "python")
    linked = {"engine": {"python": f"{programs_dir}/open/venv-python"}, "router": ok["router"]}
    with pytest.raises(ApplyFailed) as e:
        service_user_unusable(_user_ctx(tmp_path, service_user="nobody", **linked))
    assert f"{programs_dir}/open/venv-python (→ {programs_dir}/closed/python) (engine.python)" in e.value.message

    via = {"engine": ok["engine"], "router": {"executable": f"{programs_dir}/open/smg-via-closed"}}
    with pytest.raises(ApplyFailed) as e:
        service_user_unusable(_user_ctx(tmp_path, service_user="nobody", **via))
    assert (f"{programs_dir}/open/smg-via-closed (router.executable: its interpreter {programs_dir}/closed/python)"
            in e.value.message), e.value


def test_a_service_user_that_may_not_bind_a_port_below_the_hosts_floor_is_refused(tmp_path, programs_dir):
    import os
    import pwd
    from pathlib import Path

    from harness import skip_or_fail
    from pdctl.statemachine.errors import ApplyFailed
    from pdctl.statemachine.hosts import LocalHost
    from pdctl.statemachine.steps import service_user_unusable

    if os.geteuid() != 0:
        skip_or_fail("running as another account needs root (CI runs as root)")
    floor = int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text())
    if floor <= 80:
        skip_or_fail(f"this host lets every account bind from port {floor}: nothing to refuse")
    ok = {"engine": {"python": f"{programs_dir}/open/python"}}
    low = {"router": {"executable": f"{programs_dir}/open/smg", "port": 80}}
    with pytest.raises(ApplyFailed) as e:
        service_user_unusable(_user_ctx(tmp_path, service_user="nobody", **ok, **low))
    uid = pwd.getpwnam("nobody").pw_uid
    assert e.value.message.startswith(f"service_user = 'nobody' (UID {uid}) cannot bind port(s) 80 (router) on host "
                                      f"{LocalHost().name}: below net.ipv4.ip_unprivileged_port_start = {floor} only root may"), e.value
    assert e.value.step == "router_exposed"
    service_user_unusable(_user_ctx(tmp_path, service_user="root", **ok, **low))  # root may


def test_a_service_user_needs_pdctl_to_run_as_root_on_the_host(tmp_path):
    from pdctl.statemachine.errors import ApplyFailed
    from pdctl.statemachine.hosts import CommandResult, LocalHost
    from pdctl.statemachine.steps import service_user_unusable

    class NotRoot(LocalHost):  # (pdctl logged in as an ordinary account: `id -u` answers its UID)
        def run(self, argv, **kw):  # noqa: ANN001, ANN003
            if list(argv) == ["id", "-u"]:
                return CommandResult(argv=("id", "-u"), returncode=0, stdout="1000\n")
            return super().run(argv, **kw)

    with pytest.raises(ApplyFailed) as e:
        service_user_unusable(_user_ctx(tmp_path, host=NotRoot(), service_user="root"))
    assert e.value.message == (f"service_user = 'root': pdctl runs as UID 1000 on host {LocalHost().name}, and only "
                               "root can start the roles as another account, nothing was started or changed"), e.value
    assert "leave service_user unset" in e.value.hint


def test_a_role_proven_up_must_run_as_the_service_user(tmp_path):
    # (the proof of prefill_up / decode_up / router_exposed says which account the main process runs as, and fails
    # when another: a unit file edited by hand, a manager that ignored User=)
    import os
    import pwd
    import subprocess

    from harness import skip_or_fail
    from pdctl.statemachine.errors import VerifyFailed
    from pdctl.statemachine.steps import runs_as_service_user

    if os.geteuid() != 0:
        skip_or_fail("running as another account needs root (CI runs as root)")
    nobody = pwd.getpwnam("nobody").pw_uid
    as_nobody = subprocess.Popen(["sleep", "60"], user="nobody")
    as_root = subprocess.Popen(["sleep", "60"])
    try:
        ctx = _user_ctx(tmp_path, service_user="nobody")
        assert runs_as_service_user(ctx, "decode", as_nobody.pid, "decode_up") == [
            f"main PID {as_nobody.pid} runs as nobody (UID {nobody})"]
        with pytest.raises(VerifyFailed) as e:
            runs_as_service_user(ctx, "decode", as_root.pid, "decode_up")
        assert e.value.message == (f"decode: main PID {as_root.pid} runs as UID 0, not as service_user = 'nobody' "
                                   f"(UID {nobody})") and e.value.step == "decode_up"
        assert runs_as_service_user(_user_ctx(tmp_path), "decode", as_root.pid, "decode_up") == []  # (unset)
    finally:
        for p in (as_nobody, as_root):
            p.kill()
            p.wait(10)


@pytest.mark.parametrize("how", ["--state-dir", "PDCTL_STATE_DIR"])
def test_the_base_of_the_state_directories_given_as_the_state_directory_is_refused(tmp_path, monkeypatch, how):
    # (helper-109: `--state-dir /tmp/h109state`, which XDG_STATE_HOME had named, planned a first deployment and a
    # refused apply left its lock and audit log there)
    from pdctl.statemachine import service
    from pdctl.statemachine.errors import PdctlError
    from pdctl.statemachine.journal import Journal, JournalState
    from pdctl.statemachine.spec import load_spec

    from .specs import DEMO

    name = load_spec(DEMO).name
    Journal(tmp_path / "pdctl" / name, name).write(JournalState(name=name))
    if how == "PDCTL_STATE_DIR":
        monkeypatch.setenv("PDCTL_STATE_DIR", str(tmp_path))
    loaded = service.load(DEMO, state_dir=tmp_path if how == "--state-dir" else None)
    for attempt in (loaded.journal.read, lambda: service.apply(loaded), lambda: service.down(loaded)):
        with pytest.raises(PdctlError) as e:
            attempt()
        assert e.value.message.startswith(f"state directory {tmp_path} has no journal of its own but holds the state "
                                          f"directories of {name!r}: it is their base"), e.value.message
        assert f"--state-dir {tmp_path / 'pdctl' / name} (it is there)" in e.value.hint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pdctl"]  # nothing created beside it
    monkeypatch.delenv("PDCTL_STATE_DIR", raising=False)
    assert service.load(DEMO, state_dir=tmp_path / "pdctl" / name).journal.read().name == name  # (its own: read)


def test_ports_in_the_hosts_ephemeral_range_are_named_unless_reserved():
    # (helper-109: the README says an outbound connection can take such a port, and nothing said the spec's were)
    from types import SimpleNamespace

    from pdctl.statemachine.plan import make_plan, render_text
    from pdctl.statemachine.steps import ports_in_ephemeral_range

    from .specs import demo_dict

    class Sysctl:
        def __init__(self, low_high: str, reserved: str | None) -> None:
            self.files = {"/proc/sys/net/ipv4/ip_local_port_range": low_high.encode(),
                          "/proc/sys/net/ipv4/ip_local_reserved_ports": (reserved or "").encode()}
            if reserved is None:
                del self.files["/proc/sys/net/ipv4/ip_local_reserved_ports"]

        def read_file(self, path: str) -> bytes:
            if path not in self.files:
                raise FileNotFoundError(path)
            return self.files[path]

    topology = topology_of(parse_spec(demo_dict()))  # ports 8998, 29000, 30001, 30010, 30020, 30110, 30120
    said = ports_in_ephemeral_range(SimpleNamespace(topology=topology, host=Sysctl("30000\t60999\n", "30010-30020,8998")))
    assert said == ("port(s) 30001 (router), 30110 (prefill), 30120 (decode) lie in the host's ephemeral range "
                    "30000–60999 (net.ipv4.ip_local_port_range) and are not reserved"), said  # (29000: below it)
    assert ports_in_ephemeral_range(SimpleNamespace(topology=topology, host=Sysctl("32768 60999", ""))) is None
    assert ports_in_ephemeral_range(SimpleNamespace(topology=topology, host=Sysctl("garbage", None))) is None
    shown = render_text(make_plan(None, topology).model_copy(update={"ports_ephemeral": said}))
    assert f"Warning: {said}: any outbound connection on the host may take one" in shown
    assert "`sysctl net.ipv4.ip_local_reserved_ports`" in shown
