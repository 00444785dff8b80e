"""Pilot tests of the console (``App.run_test``): the topology confirmation, the y/N for a
disruptive change, read-only mode, greyed-out keys, cancel, panels surviving a source going down,
and — with real processes — applying the demo to parsers_configured from the console."""

from __future__ import annotations

import io
import threading
import time

import httpx
import pytest
from textual.widgets import Button

from pdctl.console._confirm import TopologyConfirmScreen, YesNoScreen
from pdctl.console._gpu import GpuPanel
from pdctl.console._plan import PlanPanel
from pdctl.console._steps import StepsPanel
from pdctl.console._throughput import ThroughputPanel
from pdctl.console.app import MUTATING_ACTIONS, ApplyCancelled, ConsoleApp
from pdctl.console.collect import Collector
from pdctl.console.views import fmt_duration
from pdctl.statemachine.events import Event
from pdctl.statemachine.journal import Journal
from pdctl.statemachine.machine import PD_STATES

from .conftest import FakeManager, dump_toml, metrics_transport, wait_for

SIZE = (80, 24)


class Recorder:
    """Stands in for ``service.apply``: records each call's confirmation and the plan it expects."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, loaded, *, confirm=None, expect_plan=None, sink=None, timeouts=None):  # noqa: ANN001, ANN204
        self.calls.append({"confirm": confirm, "expect_plan": expect_plan})
        sink.emit(Event("apply_done", "done"))
        return type("R", (), {"state": "parsers_configured"})()


def make_app(demo, *, down: set[str] | None = None, manager: FakeManager | None = None, **kw) -> ConsoleApp:  # noqa: ANN001
    loaded = demo.load()
    client = httpx.Client(transport=metrics_transport(demo.ports, down if down is not None else set()))
    collector = Collector(loaded, interval_s=0.1, client=client, manager=manager or FakeManager(), nvml=False,
                          canary=False)  # (nothing listens on the router's port: test_serving proves the canary)
    kw.setdefault("apply_fn", Recorder())
    return ConsoleApp(loaded, refresh_s=0.1, collector=collector, nvml=False, **kw)


def _gpus_changed(d: dict) -> None:
    d["prefill"][0]["gpus"] = [0, 1]
    d["prefill"][0]["tp"] = 2


def _parsers_changed(d: dict) -> None:
    d["parsers"] = {"reasoning_parser": "deepseek-r1", "tool_call_parser": "deepseekv3"}


async def _open_topology_modal(pilot, app) -> TopologyConfirmScreen:  # noqa: ANN001
    await wait_for(pilot, lambda: app.plan is not None)
    assert app.plan.requires_confirmation
    await pilot.press("a")
    await wait_for(pilot, lambda: isinstance(app.screen, TopologyConfirmScreen))
    return app.screen


async def test_topology_modal_refuses_a_wrong_name(console_demo):
    console_demo.pretend_deployed(_gpus_changed)
    serial = Journal(console_demo.state, console_demo.name).read().serial
    app = make_app(console_demo)
    async with app.run_test(size=SIZE) as pilot:
        modal = await _open_topology_modal(pilot, app)
        confirm = modal.query_one("#confirm", Button)
        assert confirm.disabled
        await pilot.press(*"not-the-name")
        assert confirm.disabled
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen is modal  # still asking
        assert "not applied" in str(modal.query_one("#why").render())
        assert app.apply_fn.calls == []
    assert Journal(console_demo.state, console_demo.name).read().serial == serial


async def test_topology_modal_proceeds_with_the_right_name_and_confirms_that_plan_id(console_demo):
    console_demo.pretend_deployed(_gpus_changed)
    app = make_app(console_demo)
    async with app.run_test(size=SIZE) as pilot:
        modal = await _open_topology_modal(pilot, app)
        plan_id = app.plan.plan_id
        await pilot.press(*console_demo.name[:-1])
        assert modal.query_one("#confirm", Button).disabled
        await pilot.press(console_demo.name[-1])
        assert not modal.query_one("#confirm", Button).disabled
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.apply_fn.calls)
        assert app.apply_fn.calls == [{"confirm": plan_id, "expect_plan": plan_id}]
        assert not isinstance(app.screen, TopologyConfirmScreen)


def _collapsed_to_public_server(d: dict) -> None:
    # the deployed side of the plan is this; the spec (PD behind a router on 127.0.0.1) is what the console plans
    for kind in ("prefill", "decode", "kv_transfer", "router"):
        d.pop(kind, None)
    d["server"] = [{"gpus": [0], "http_host": "0.0.0.0", "port": 30001}]


async def test_the_topology_modal_keeps_the_changes_in_words_in_sight_at_80x24(console_demo):
    console_demo.pretend_deployed(_collapsed_to_public_server)
    app = make_app(console_demo)
    async with app.run_test(size=SIZE) as pilot:
        modal = await _open_topology_modal(pilot, app)
        await pilot.pause()
        words = str(modal.query_one("#changes").render())
        assert "exposure server 'server' on 0.0.0.0:30001 (every interface) → router on" in words
        screen = modal.region
        for wid in ("#changes", "#name", "#confirm"):  # whole, not clipped, without scrolling
            region = modal.query_one(wid).region
            assert region.height > 0 and screen.contains_region(region), (wid, region, screen)
        assert modal.query_one("#changes").region.height >= len(app.plan.topology_changes)
        await pilot.press(*"not-it", "enter")  # the refusal line shows too, and still nothing is cut off
        await pilot.pause()
        assert "not applied" in str(modal.query_one("#why").render())
        for wid in ("#changes", "#name", "#why", "#confirm"):
            assert screen.contains_region(modal.query_one(wid).region), wid


async def test_escape_cancels_the_topology_modal_and_nothing_changes(console_demo):
    console_demo.pretend_deployed(_gpus_changed)
    before = Journal(console_demo.state, console_demo.name).path.read_bytes()
    app = make_app(console_demo)
    async with app.run_test(size=SIZE) as pilot:
        await _open_topology_modal(pilot, app)
        await pilot.press(*console_demo.name)  # even with the right name typed
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, TopologyConfirmScreen))
        await pilot.pause(0.3)
        assert app.apply_fn.calls == []
        assert not app.applying
    assert Journal(console_demo.state, console_demo.name).path.read_bytes() == before


async def _no_then_yes(pilot, app) -> str:  # noqa: ANN001
    """Press a and answer the y/N no (nothing applied), then a and yes (applied once, unconfirmed); the question."""
    await pilot.press("a")
    await wait_for(pilot, lambda: isinstance(app.screen, YesNoScreen))
    question = str(app.screen.question)
    await pilot.press("n")
    await wait_for(pilot, lambda: not isinstance(app.screen, YesNoScreen))
    assert app.apply_fn.calls == []
    await pilot.press("a")
    await wait_for(pilot, lambda: isinstance(app.screen, YesNoScreen))
    await pilot.press("y")
    await wait_for(pilot, lambda: app.apply_fn.calls)
    assert app.apply_fn.calls == [{"confirm": None, "expect_plan": app.plan.plan_id}]
    return question


async def _bottom_row(pilot, app: ConsoleApp) -> str:  # noqa: ANN001
    """The terminal's last row as drawn (what the operator reads there), from the app's own screenshot, once it shows
    something: a footer recomposes as the bindings refresh, and a screenshot taken mid-way has that row blank."""
    import html
    import re

    row = [""]

    def drawn() -> bool:
        svg = app.export_screenshot()
        text = "".join(re.findall(rf'<text[^>]*-line-{app.size.height - 1}\)"[^>]*>([^<]*)', svg))
        row[0] = html.unescape(text).replace("\xa0", " ")
        return bool(row[0].strip())

    await wait_for(pilot, drawn, timeout=3)
    return row[0]


async def test_a_dialogs_footer_shows_its_own_keys_not_the_consoles(console_demo):
    # (the y/N showed the console's footer, "a Apply/resume  x Cancel apply  r Reload spec  ? Keys  q Quit": keys that
    # do nothing while the dialog is open; the topology dialog had none at 80x24 and the console's when taller)
    from textual.widgets import Footer

    console_words = ("Apply/resume", "Cancel apply", "Reload spec", "Keys", "Quit")
    console_demo.pretend_deployed(_parsers_changed)
    app = make_app(console_demo)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.plan is not None)
        assert "q Quit" in await _bottom_row(pilot, app)  # the console's own footer, before any dialog
        await pilot.press("a")
        await wait_for(pilot, lambda: isinstance(app.screen, YesNoScreen))
        await pilot.pause()
        row = await _bottom_row(pilot, app)
        assert "y Yes" in row and "n No" in row and not any(w in row for w in console_words), row
        assert [k.description for k in app.screen.query_one(Footer).query("FooterKey")] == ["Yes", "No"]
    console_demo.pretend_deployed(_gpus_changed)
    for size in (SIZE, (120, 50)):
        app = make_app(console_demo)
        async with app.run_test(size=size) as pilot:
            await _open_topology_modal(pilot, app)
            await pilot.pause()
            row = await _bottom_row(pilot, app)
            assert "esc Cancel" in row and not any(w in row for w in console_words), (size, row)


async def test_a_disruptive_change_asks_y_n(console_demo):
    console_demo.pretend_deployed(_parsers_changed)
    app = make_app(console_demo)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.plan is not None)
        assert app.plan.cls == "disruptive" and not app.plan.requires_confirmation
        await _no_then_yes(pilot, app)


async def test_the_y_n_after_an_interrupted_change_names_what_apply_keeps(console_demo, monkeypatch):
    # (after Ctrl-C once prefill_up had proven a changed prefill, the question said "It restarts prefill, decode, ..."
    # although the resumed apply keeps that prefill)
    from pdctl.statemachine import service
    from pdctl.statemachine.journal import JournalState, StepRecord
    from pdctl.statemachine.topology import topology_of

    # every unit runs, as after such an apply (nothing is started here; the plan would start them again), prefill as
    # that apply proved it (how the journal and the service manager tell so: test_plan's runs_now tests)
    from pdctl.statemachine.plan import Runs

    monkeypatch.setattr(service, "not_running", lambda *a, **k: {})
    monkeypatch.setattr(service, "runs_now", lambda *a, **k: {"prefill": Runs(kept="proved by that apply")})
    console_demo.pretend_deployed(_parsers_changed)
    j = Journal(console_demo.state, console_demo.name)
    state = j.read()
    j.write(JournalState(name=state.name, deployed=state.deployed, target=topology_of(console_demo.load().deployment),
                         steps={"kernels_built": StepRecord("skipped"), "prefill_up": StepRecord("done")}))
    app = make_app(console_demo)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.plan is not None)
        assert "prefill" not in app.plan.restarts() and app.plan.kept() == ["role.prefill"]
        # the plan tab says what `pdctl plan` notes on stderr (it did not: only "an earlier apply … did not finish")
        from pdctl.console._plan import PlanPanel

        text = app.query_one(PlanPanel).render().plain
        assert "note: an earlier apply did not finish; `pdctl apply` re-proves every step and restarts what it left " \
               "half-changed" in " ".join(text.split()), text
        await pilot.press("a")
        await wait_for(pilot, lambda: isinstance(app.screen, YesNoScreen))
        question = str(app.screen.question)
        assert "keeps prefill, which the interrupted apply already started with these settings" in question, question
        assert "restarts prefill" not in question and "decode" in question.split(" and keeps")[0], question


async def test_a_spec_with_no_changes_whose_roles_do_not_serve_shows_it_and_asks_before_restarting(console_demo):
    # (the plan tab said "No changes" where `pdctl plan` said a role did not serve as proven, and `a` restarted a
    # serving role at once, without the y/N a disruptive plan gets)
    from pdctl.console._plan import PlanPanel

    # recorded as deployed; no unit of it runs here, which service.status (behind plan_unsettled) reads
    console_demo.pretend_deployed(lambda d: None)
    app = make_app(console_demo)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.plan is not None and app.snapshot is not None)
        assert not app.plan.has_changes and app.plan_unsettled == "drift"
        text = app.query_one(PlanPanel).render().plain
        assert "No changes to what was recorded as deployed" in text and "no longer serves as proven" in text, text
        question = await _no_then_yes(pilot, app)
        assert "apply restarts what does not serve as specified" in question


async def test_the_plan_is_made_again_when_a_role_that_does_not_serve_changes_state(console_demo):
    # the console re-planned only when the set of roles not serving changed: prefill going from UNSUPERVISED to
    # failed left the y/N saying "prefill UNSUPERVISED (its supervisor is gone)" of a server no longer running
    console_demo.pretend_deployed(lambda d: None)
    manager = FakeManager()
    manager.unsupervised = {"prefill"}
    app = make_app(console_demo, manager=manager)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.plan is not None and app._planned_serial is not None
                       and ("prefill", "active", False) in app._down_at_plan)
        planned = []
        app.reload_spec = lambda *a, **k: planned.append(k)  # (what show_snapshot calls to plan again)
        manager.unsupervised = set()
        manager.down = {"prefill"}
        await wait_for(pilot, lambda: planned)
        assert planned == [{"reread": False}] and ("prefill", "failed", True) in app._down_at_plan


async def test_readonly_has_no_mutating_binding(console_demo):
    console_demo.pretend_deployed(_parsers_changed)
    app = make_app(console_demo, readonly=True)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.plan is not None)
        actions = {b.action.split("(")[0] for _k, b in app._bindings}
        assert "reload" in actions and not (actions & MUTATING_ACTIONS)
        active = {ab.binding.action.split("(")[0] for ab in app.screen.active_bindings.values()}
        assert not (active & MUTATING_ACTIONS)
        await pilot.press("a", "x")
        await pilot.pause(0.2)
        assert app.apply_fn.calls == [] and app.screen is app.screen_stack[0]
        assert app.check_action("apply", ()) is False
        assert "READ-ONLY" in app.sub_title
        from rich.console import Console

        console = Console(width=200, record=True, file=io.StringIO())
        console.print(app.query_one("#topology-panel").render())
        banner = console.export_text()  # offers no key it took away
        assert "Pending disruptive plan" in banner and "a: review" not in banner and "read-only" in banner


class BlockingApply:
    """An apply that emits step events until cancelled (or released)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.error: BaseException | None = None

    def __call__(self, loaded, *, confirm=None, expect_plan=None, sink=None, timeouts=None):  # noqa: ANN001, ANN204
        self.started.set()
        try:
            while not self.release.wait(0.05):
                sink.emit(Event("step_started", "prefill_up: started", step="prefill_up"))
        except BaseException as exc:
            self.error = exc
            raise
        return type("R", (), {"state": "parsers_configured"})()


async def test_apply_hides_itself_while_running_and_cancel_halts_it(console_demo):
    fake = BlockingApply()
    app = make_app(console_demo, apply_fn=fake)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.plan is not None)
        assert app.check_action("cancel_apply", ()) is None  # greyed: nothing to cancel
        await pilot.press("a")  # a first deployment: y/N, not a typed name
        await wait_for(pilot, lambda: isinstance(app.screen, YesNoScreen))
        await pilot.press("y")
        await wait_for(pilot, lambda: fake.started.is_set() and app.applying)
        try:  # hidden, not greyed: the footer offered "a Apply/resume" although a did nothing; x cancels instead
            assert app.check_action("apply", ()) is False
            by_action = {ab.binding.action: ab for ab in app.screen.active_bindings.values()}
            assert "apply" not in by_action and by_action["cancel_apply"].enabled is True
        except AssertionError:
            fake.release.set()  # (a failure must not leave the app waiting on the apply's thread at exit)
            raise
        await pilot.press("a")  # ignored while running
        await pilot.press("x")
        await wait_for(pilot, lambda: not app.applying, timeout=5)
        assert isinstance(fake.error, ApplyCancelled)
        assert isinstance(app.last_apply_error, ApplyCancelled)
        assert app.check_action("apply", ()) is True


async def test_panels_survive_a_source_going_down(console_demo):
    down: set[str] = set()
    mgr = FakeManager()
    app = make_app(console_demo, down=down, manager=mgr)
    async with app.run_test(size=SIZE) as pilot:
        tp = app.query_one(ThroughputPanel)
        await wait_for(pilot, lambda: len(tp.samples) == 3 and all(s.state == "ok" for s in tp.samples))
        await pilot.press("3")
        down |= {"prefill", "router"}
        mgr.down.add("prefill")
        await wait_for(pilot, lambda: {s.source: s.state for s in tp.samples} == {"prefill": "down", "decode": "ok", "router": "down"})
        await pilot.pause(0.3)  # several more ticks with sources down
        assert app.is_running
        text = str(tp.render())
        for key in ("2", "1", "4", "5", "6", "3"):
            await pilot.press(key)
            await pilot.pause(0.05)
        assert app.query_one(GpuPanel).sample is not None
        assert app.snapshot.services["prefill"].state == "failed"
        down.clear()
        mgr.down.clear()
        await wait_for(pilot, lambda: all(s.state == "ok" for s in tp.samples))
    assert text is not None


async def test_selecting_a_step_shows_its_proof(console_demo):
    app = make_app(console_demo)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.snapshot is not None)
        steps = app.query_one(StepsPanel)
        assert [s.name for s in steps.steps] == list(PD_STATES)
        await pilot.press("down", "enter")
        assert app.query_one("#tabs").active == "proof"
        assert app.query_one("ProofPanel").step.name == "prefill_up"


async def test_the_proof_tab_counts_the_age_of_the_proof_on(console_demo):
    # it showed the age at the moment the step was selected, for good (a StepView that only aged compares equal, so
    # the panel never redrew), and one taken from the steps panel's first rows, not from when the proof was made
    from pdctl.console._proof import ProofPanel
    from pdctl.console.app import ConsoleApp as _App

    from .conftest import FIXED_NOW, fixed_snapshot

    now = [FIXED_NOW]
    loaded = console_demo.load()
    app = _App(loaded, live=False, clock=lambda: now[0], nvml=False)
    snap = fixed_snapshot(loaded)
    async with app.run_test(size=SIZE) as pilot:
        app.show_snapshot(snap)
        await pilot.pause()
        await pilot.press("s", "down", "enter")
        panel = app.query_one(ProofPanel)
        step = panel.step
        assert step is not None and step.finished_at is not None, step
        first = FIXED_NOW - step.finished_at
        assert f"{fmt_duration(first)} ago" in str(panel.render().renderables[0])
        now[0] += 125.0

        def shown() -> str:  # (what the screen shows: redrawn, or not)
            return app.export_screenshot().replace("&#160;", " ")

        # (the panel's one-second tick redraws it; nothing else here would)
        await wait_for(pilot, lambda: f"{fmt_duration(first + 125.0)} ago" in shown(), timeout=10, step=0.2)
        assert f"{fmt_duration(first)} ago" not in shown()


@pytest.mark.smg
@pytest.mark.slow
async def test_console_applies_the_demo_to_parsers_configured(console_demo):
    """Real processes: the SGLang stand-in under the process supervisor and the real smg router."""
    loaded = console_demo.load()
    app = ConsoleApp(loaded, refresh_s=0.5, timeouts=console_demo.timeouts(), nvml=False)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.plan is not None, timeout=20)
        assert app.plan.from_topology is None  # a first deployment: y/N, no typed confirmation
        await pilot.press("a")
        await wait_for(pilot, lambda: isinstance(app.screen, YesNoScreen))
        await pilot.press("y")
        await wait_for(pilot, lambda: app.applying, timeout=5)
        await wait_for(pilot, lambda: not app.applying, timeout=150)
        assert app.last_apply_error is None, app.last_apply_error
        steps = app.query_one(StepsPanel).steps
        assert [s.name for s in steps] == list(PD_STATES)
        assert all(s.status in ("done", "skipped") for s in steps), [(s.name, s.status) for s in steps]
        tp = app.query_one(ThroughputPanel)
        await wait_for(pilot, lambda: len(tp.samples) == 3 and all(s.state == "ok" for s in tp.samples), timeout=10)

        def router():  # noqa: ANN202 - the latest router sample
            return next(s for s in tp.samples if s.source == "router")

        # (smg_worker_health can lack one worker or both in the router's first scrapes after it starts: both seen in CI)
        await wait_for(pilot, lambda: (router().workers_total, router().workers_healthy) == (2, 2), timeout=15)
        await wait_for(pilot, lambda: app.plan is not None and not app.plan.has_changes, timeout=10)
    state = Journal(console_demo.state, console_demo.name).read()
    assert state.deployed is not None and state.target is None
    assert state.steps["parsers_configured"].status == "done"


async def _first_apply_running(pilot, app) -> None:  # noqa: ANN001
    """Start the first deployment from the console (a, then y) and wait until its apply runs."""
    await wait_for(pilot, lambda: app.plan is not None)
    await pilot.press("a")
    await wait_for(pilot, lambda: isinstance(app.screen, YesNoScreen))
    await pilot.press("y")
    await wait_for(pilot, lambda: app.applying)


async def test_sigterm_or_sighup_during_an_apply_cancels_it_and_exits_with_their_code(console_demo):
    # (SIGTERM or an SSH drop's SIGHUP killed the console at once: no interruption audited, the terminal left on the
    # alternate screen)
    fake = BlockingApply()
    app = make_app(console_demo, apply_fn=fake)
    async with app.run_test(size=SIZE) as pilot:
        await _first_apply_running(pilot, app)
        app.terminate(129)  # what the SIGHUP handler calls
        await wait_for(pilot, lambda: fake.error is not None, timeout=5)
    assert isinstance(fake.error, ApplyCancelled) and app.return_value == 129  # run_console returns it


async def _asked_to_quit_during_an_apply(pilot, app) -> None:  # noqa: ANN001
    """Start the first deployment's apply from the console, then press q and wait for its question."""
    await _first_apply_running(pilot, app)
    await pilot.press("q")
    await wait_for(pilot, lambda: isinstance(app.screen, YesNoScreen))


async def test_quitting_during_an_apply_asks_first_then_cancels_it(console_demo):
    fake = BlockingApply()
    app = make_app(console_demo, apply_fn=fake)
    async with app.run_test(size=SIZE) as pilot:
        await _asked_to_quit_during_an_apply(pilot, app)
        await pilot.press("n")
        await pilot.pause(0.2)
        assert app.is_running and app.applying and fake.error is None
        await pilot.press("q")
        await wait_for(pilot, lambda: isinstance(app.screen, YesNoScreen))
        await pilot.press("y")
        await wait_for(pilot, lambda: fake.error is not None, timeout=5)
    assert isinstance(fake.error, ApplyCancelled)
    # (it exited 0, as if the apply had finished: a script or an operator's shell read success)
    assert app.return_value == 130 and app.apply_ended.is_set()


async def test_quitting_when_the_apply_finishes_before_the_answer_exits_with_how_it_ended(console_demo, capsys):
    # (a fresh user: q, the apply finished while "An apply is running. Quit…?" was open, then y: exit 130 and main's
    # line "interrupted (SIGINT): the console was closed; no apply was running", though no signal came and the
    # apply had succeeded)
    from pdctl.console.app import after_the_app

    fake = BlockingApply()
    app = make_app(console_demo, apply_fn=fake)
    async with app.run_test(size=SIZE) as pilot:
        await _asked_to_quit_during_an_apply(pilot, app)
        fake.release.set()
        await wait_for(pilot, lambda: not app.applying, timeout=5)
        await pilot.press("y")
    assert fake.error is None and app.return_value == 130 and app.signalled is None
    assert after_the_app(app, app.return_value, console_demo.load()) == (0, True)
    said = capsys.readouterr().err
    assert "the apply finished before it could be stopped" in said and "waiting for it" not in said, said


async def _apply_that_fails(pilot, app) -> None:  # noqa: ANN001
    """Press a, confirm with y, and wait until the apply (its apply_fn raising) has ended with its error."""
    await wait_for(pilot, lambda: app.plan is not None)
    await pilot.press("a")
    await wait_for(pilot, lambda: isinstance(app.screen, YesNoScreen))
    await pilot.press("y")
    await wait_for(pilot, lambda: app.last_apply_error is not None and not app.applying)


async def test_an_apply_refused_before_its_first_step_stays_said_in_the_header(console_demo):
    # (its toast expired and nothing said it: the header kept an earlier apply's words)
    from pdctl.statemachine.errors import ApplyFailed

    def refused(loaded, *, confirm=None, expect_plan=None, sink=None, timeouts=None):  # noqa: ANN001, ANN202
        raise ApplyFailed("ports taken by processes outside this deployment, nothing was started or changed: router "
                          "needs port 35901 at router_exposed, held by PID 1 (init)", step="router_exposed")

    app = make_app(console_demo, apply_fn=refused)
    async with app.run_test(size=(160, 24)) as pilot:
        await _apply_that_fails(pilot, app)
        app.clear_notifications()
        await pilot.pause(0.3)
        # refused, nothing changed: not "FAILED at router_exposed" as though a step had run and failed there
        assert app.sub_title.startswith("LAST APPLY REFUSED (6: why)"), app.sub_title
        # its words in full stay in the plan tab (a toast goes after 15 s and the header is cut at 80 columns)
        await pilot.press("6")
        await pilot.pause()
        shown = str(app.query_one(PlanPanel).render())
        assert "router needs port 35901 at router_exposed, held by PID 1 (init)" in shown
        assert shown.index("Last apply") < shown.index("plan id")
        # ...as a refusal, not as a step that failed (it read "Step failed: step router_exposed: ports taken …")
        assert "Apply refused: ports taken" in shown and "(it would have failed at router_exposed)" in shown, shown
        assert "step router_exposed:" not in shown, shown
        # another process's apply (or down) writes the journal since: the header stops saying it (a fresh user saw
        # it stay after a headless apply had succeeded)
        from dataclasses import replace

        from pdctl.console.collect import Snapshot
        from pdctl.statemachine.journal import JournalState

        topo = app.plan.to_topology
        app.show_snapshot(Snapshot(at=time.time(), topology=topo, journal=JournalState(name="x", updated_at=None)))
        assert app.sub_title.startswith("LAST APPLY REFUSED"), app.sub_title  # (the journal as it was)
        later = JournalState(name="x", serial=1, updated_at=time.time() + 1)
        app.show_snapshot(replace(app.snapshot, journal=later))
        assert "LAST APPLY" not in app.sub_title, app.sub_title
        fake = Recorder()
        app.apply_fn = fake
        await pilot.press("a", "y")  # the next apply clears them
        await wait_for(pilot, lambda: fake.calls)
        await wait_for(pilot, lambda: "Last apply" not in str(app.query_one(PlanPanel).render()))


async def test_a_failed_apply_toast_keeps_the_bracketed_section_its_hint_names(console_demo):
    # (the toast read "…on BOTH prefill and decode (), then apply": "[parsers]" was taken for markup and dropped)
    from textual.content import Content

    from pdctl.statemachine.errors import ApplyFailed

    def failed(loaded, *, confirm=None, expect_plan=None, sink=None, timeouts=None):  # noqa: ANN001, ANN202
        raise ApplyFailed("parsers not configured [router] side", step="parsers_configured",
                          hint="set the parsers on BOTH prefill and decode ([parsers]), then apply")

    app = make_app(console_demo, apply_fn=failed)
    async with app.run_test(size=(160, 40)) as pilot:
        await _apply_that_fails(pilot, app)
        await wait_for(pilot, lambda: list(app._notifications))
        # (each message as Textual's Toast.render reads it)
        shown = " ".join(str(Content.from_markup(n.message) if n.markup else Content(n.message))
                         for n in app._notifications)
        assert "([parsers]), then apply" in shown and "[router] side" in shown, shown


async def test_reloading_is_not_offered_while_an_apply_runs(console_demo):
    # (r mid-apply replaced the topology, plan and header with an edited spec's while the old plan went on applying)
    fake = BlockingApply()
    app = make_app(console_demo, apply_fn=fake)
    async with app.run_test(size=SIZE) as pilot:
        await _first_apply_running(pilot, app)
        shown = app.plan
        assert app.check_action("reload", ()) is None
        console_demo.spec.write_text(dump_toml({**console_demo.dict, "parsers": {
            "reasoning_parser": "deepseek-r1", "tool_call_parser": "deepseekv3"}}))
        await pilot.press("r")
        await pilot.pause(0.5)
        assert app.plan is shown
        app.action_cancel_apply()
        await wait_for(pilot, lambda: not app.applying, timeout=5)
        assert app.check_action("reload", ()) is True


def test_after_a_quit_mid_apply_the_console_says_how_the_apply_ended(console_demo):
    # the exit code and the words follow the apply's own end: stopped where it was (130), stopped before it journalled
    # anything (130), failed on its own meanwhile (its code), finished meanwhile (0)
    from pdctl.console.app import quit_outcome
    from pdctl.statemachine.errors import ApplyFailed
    from pdctl.statemachine.journal import JournalState, StepRecord
    from pdctl.statemachine.topology import topology_of

    loaded = console_demo.load()
    j = Journal(console_demo.state, console_demo.name)
    target = topology_of(loaded.deployment)
    j.write(JournalState(name=console_demo.name, target=target,
                         steps={"kernels_built": StepRecord(status="skipped"),
                                "prefill_up": StepRecord(status="interrupted")}))
    said, code = quit_outcome(console_demo.load(), ApplyCancelled("cancelled"))
    assert code == 130 and said.startswith("pdctl: the apply stopped at prefill_up; ")
    assert f"`pdctl apply {loaded.path}` resumes" in said
    j.write(JournalState(name=console_demo.name, deployed=target))  # cancelled at its plan: nothing journalled
    said, code = quit_outcome(console_demo.load(), ApplyCancelled("cancelled"))
    assert code == 130 and said.startswith("pdctl: the apply stopped before it changed anything")
    j.write(JournalState(name=console_demo.name, target=target,  # stopped between two steps: none interrupted
                         steps={"kernels_built": StepRecord(status="skipped"), "prefill_up": StepRecord(status="done")}))
    said, _ = quit_outcome(console_demo.load(), ApplyCancelled("cancelled"))
    assert said.startswith("pdctl: the apply stopped after prefill_up; "), said
    said, code = quit_outcome(console_demo.load(), ApplyFailed("ports taken", step="router_exposed"))
    assert code == 3 and said.startswith("pdctl: the apply failed at router_exposed before it could be stopped: ports")
    said, code = quit_outcome(console_demo.load(), type("R", (), {"state": "parsers_configured"})())
    assert code == 0 and "finished before it could be stopped" in said


async def test_reloading_an_edited_spec_shows_its_plan(console_demo):
    from pdctl.statemachine.journal import JournalState
    from pdctl.statemachine.topology import topology_of

    # Deployed exactly as the spec asks: no changes.
    Journal(console_demo.state, console_demo.name).write(JournalState(name=console_demo.name, deployed=topology_of(console_demo.load().deployment)))
    app = make_app(console_demo)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.plan is not None)
        assert not app.plan.has_changes
        edited = dict(console_demo.dict)
        edited["parsers"] = {"reasoning_parser": "deepseek-r1", "tool_call_parser": "deepseekv3"}
        console_demo.spec.write_text(dump_toml(edited))
        # (helper-109: until reloaded, the plan tab said "No changes" of a spec file rewritten meanwhile)
        panel = app.query_one("PlanPanel")
        await wait_for(pilot, lambda: panel.spec_changed)
        assert "The spec file changed on disk since this plan was made: r reloads it" in str(panel.render())
        await pilot.press("r")
        await wait_for(pilot, lambda: app.plan is not None and app.plan.has_changes)
        assert app.plan.cls == "disruptive" and app.plan.restarts() == ["prefill", "decode"]
        assert app.query_one("#tabs").active == "plan"
        await wait_for(pilot, lambda: not panel.spec_changed)
        assert "reasoning_parser" in str(panel.render()) and "changed on disk" not in str(panel.render())


class GrowingLogs(FakeManager):
    """Each read of a unit's log has one line more than the last (*n* at first)."""

    def __init__(self, n: int = 0) -> None:
        super().__init__()
        self.n = n

    def logs(self, unit: str, *, lines: int = 50) -> list[str]:
        self.n += 1
        return [f"{unit} #{i}" for i in range(self.n)][-lines:]


async def test_the_logs_panel_follows_the_selected_role(console_demo):
    mgr = GrowingLogs()
    app = make_app(console_demo, manager=mgr)
    async with app.run_test(size=SIZE) as pilot:
        from textual.widgets import Log

        await pilot.press("4")
        log = app.query_one(Log)
        await wait_for(pilot, lambda: log.line_count >= 3)
        assert "prefill" in log.lines[-1]
        await pilot.press("right_square_bracket")
        await wait_for(pilot, lambda: log.line_count >= 1 and "decode" in log.lines[-1])
        assert all("decode" in ln for ln in log.lines)


async def test_the_logs_panel_keeps_following_after_a_resize_until_the_operator_scrolls_back(console_demo):
    # Textual's Log follows only while its view is at the end: a resize that left it mid-way stopped the panel
    # following for good (role switches did not help) while its head still said "following"
    mgr = GrowingLogs(100)
    app = make_app(console_demo, manager=mgr)
    async with app.run_test(size=(200, 50)) as pilot:
        from pdctl.console._logs import FollowingLog, LogsPanel

        await pilot.press("4")
        log = app.query_one(FollowingLog)
        head = app.query_one("#logs-head")
        await wait_for(pilot, lambda: log.line_count >= 50)
        for size in ((80, 24), (200, 50), (80, 24)):
            await pilot.resize_terminal(*size)
            await pilot.pause(0.1)
        seen = mgr.n
        await wait_for(pilot, lambda: mgr.n >= seen + 3)
        await wait_for(pilot, lambda: log.is_vertical_scroll_end)
        assert log.following and log.max_scroll_y > 0 and "following" in str(head.render()), str(head.render())
        log.focus()
        await pilot.press("pageup")
        await wait_for(pilot, lambda: not log.following)
        assert "scrolled back: End to follow" in str(head.render()), str(head.render())
        seen, y = mgr.n, log.scroll_y
        await wait_for(pilot, lambda: mgr.n >= seen + 3)
        await pilot.pause(0.1)
        assert log.scroll_y == y and not log.is_vertical_scroll_end  # (the operator reads back: the view stays)
        await pilot.press("end")
        await wait_for(pilot, lambda: log.following and log.is_vertical_scroll_end)
        assert "following" in str(app.query_one(LogsPanel).query_one("#logs-head").render())


async def test_apply_is_greyed_and_named_while_another_process_holds_the_lock(console_demo):
    """A headless apply (here: a child process holding the real lock) greys the console's apply key and
    names the holder in the header; after a kill -9 of that holder, apply is available again."""
    import os
    import signal
    import subprocess
    import sys

    journal = Journal(console_demo.state, console_demo.name)
    journal.dir.mkdir(parents=True, exist_ok=True)
    code = (f"from pdctl.statemachine.journal import Journal\nimport time\n"
            f"with Journal({str(console_demo.state)!r}, {console_demo.name!r}).lock('apply (headless)'):\n"
            f"    print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    from rich.console import Console

    def banner() -> str:
        console = Console(width=200, record=True, file=io.StringIO())
        console.print(app.query_one("#topology-panel").render())
        return console.export_text()

    try:
        assert holder.stdout.readline().strip() == "locked"
        recorder = Recorder()
        app = make_app(console_demo, apply_fn=recorder)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.plan is not None and app.snapshot is not None and app.snapshot.locked_by)
            assert app.snapshot.locked_by["pid"] == holder.pid
            assert app.check_action("apply", ()) is None  # greyed, not hidden
            assert f"LOCKED by PID {holder.pid} (apply (headless))" in app.sub_title
            # the topology tab's pending-plan banner does not offer `a` meanwhile (it did, while `a` did nothing)
            await wait_for(pilot, lambda: "holds the lock" in banner())
            assert (f"(another pdctl, PID {holder.pid} (apply (headless)), holds the lock: a waits until it ends)"
                    in banner() and "a: review" not in banner()), banner()
            await pilot.press("a")
            await pilot.pause(0.2)
            assert recorder.calls == [] and not isinstance(app.screen, YesNoScreen)
            os.kill(holder.pid, signal.SIGKILL)  # the kernel drops the flock; the lock file still names it
            holder.wait(5)
            await wait_for(pilot, lambda: app.check_action("apply", ()) is True)
            assert "LOCKED" not in app.sub_title and journal.lock_holder()["pid"] == holder.pid
            await wait_for(pilot, lambda: "(a: review, apply)" in banner())
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(5)


def test_the_consoles_sink_halts_a_long_wait_at_its_checkpoint_once_cancel_is_asked():
    # the engine polls Context.checkpoint during waits of minutes (a model loading): cancel must not wait them out
    import threading

    from pdctl.console.app import _PostingSink

    cancel = threading.Event()
    sink = _PostingSink(app=None, cancel=cancel)
    sink.checkpoint()  # nothing asked: the wait goes on
    cancel.set()
    with pytest.raises(ApplyCancelled):
        sink.checkpoint()


async def test_the_header_says_when_what_reached_its_step_no_longer_serves_or_units_run_unrecorded(console_demo):
    # (decode killed: the header still read "reached parsers_configured"; a journal moved aside, or a cancelled
    # collapse: "not deployed" while servers ran)

    from pdctl.statemachine.journal import JournalState, StepRecord
    from pdctl.statemachine.topology import topology_of

    manager = FakeManager()  # every unit active
    app = make_app(console_demo, manager=manager)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "not deployed, yet units run" in app.sub_title)
    now = time.time()
    Journal(console_demo.state, console_demo.name).write(JournalState(
        name=console_demo.name, deployed=topology_of(console_demo.load().deployment),
        steps={s: StepRecord(status="done", started_at=now, finished_at=now) for s in PD_STATES}))
    manager.down = {"decode"}
    app = make_app(console_demo, manager=manager)
    async with app.run_test(size=SIZE) as pilot:
        # (most urgent first: an 80-column header cuts its end)
        await wait_for(pilot, lambda: app.sub_title.startswith("NOT serving: decode · reached parsers_configured"))
        manager.down = set()
        await wait_for(pilot, lambda: "NOT serving" not in app.sub_title and "reached parsers_configured" in app.sub_title)
        # a server whose supervisor is gone still serves: the header said "NOT serving: decode"
        manager.unsupervised = {"decode"}
        await wait_for(pilot, lambda: app.sub_title.startswith("UNSUPERVISED: decode · reached parsers_configured"))
        assert "NOT serving" not in app.sub_title, app.sub_title
        manager.unsupervised = set()
        # an SSH host that stops answering: what runs there is unknown, not down (it said "NOT serving: prefill,
        # decode, router" while every server ran)
        manager.unreachable = True
        await wait_for(pilot, lambda: "HOST NOT ANSWERING: prefill, decode, router unknown" in app.sub_title)
        assert "NOT serving" not in app.sub_title, app.sub_title
        manager.unreachable = False
        await wait_for(pilot, lambda: "HOST NOT ANSWERING" not in app.sub_title)
        # decode serving again after a crash its supervisor recovered from: a process younger than its proof (the
        # header said all was well while `pdctl status` marked the proof "proven before … restarted")
        time.sleep(max(0.0, now + 2.5 - time.time()))  # (/proc/stat's btime is whole seconds: starts read up to 1 s early)
        import subprocess

        younger = subprocess.Popen(["sleep", "30"])
        try:
            manager.pids = {"decode": younger.pid}
            await wait_for(pilot, lambda: app.sub_title.startswith(
                "RESTARTED since proven: decode · reached parsers_configured"))
            manager.pids = {}
            await wait_for(pilot, lambda: "RESTARTED" not in app.sub_title)
        finally:
            younger.kill()
            younger.wait(5)
    # an apply stopped after decode_up: the router never started, which is not "NOT serving" (it never served)
    Journal(console_demo.state, console_demo.name).write(JournalState(
        name=console_demo.name, target=topology_of(console_demo.load().deployment),
        steps={s: StepRecord(status="done", started_at=now, finished_at=now) for s in PD_STATES[:3]}))
    manager.down = {"router"}
    app = make_app(console_demo, manager=manager)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "reached decode_up" in app.sub_title)
        assert "NOT serving" not in app.sub_title
        manager.down = {"router", "prefill"}
        await wait_for(pilot, lambda: "NOT serving: prefill ·" in app.sub_title)
        assert "reached decode_up · an apply was interrupted" in app.sub_title, app.sub_title
    # a collapse into one server stopped while it removed PD, before its first step: no step journalled, nothing
    # runs, and the header said "not deployed" where `pdctl status` said "(pd → single) … an apply was interrupted"
    pd = topology_of(console_demo.load().deployment)
    single = console_demo.dict | {"server": [{"gpus": list(range(8)), "tp": 8, "port": console_demo.ports["router"]}]}
    for k in ("prefill", "decode", "kv_transfer", "router"):
        single.pop(k)
    Journal(console_demo.state, console_demo.name).write(JournalState(
        name=console_demo.name, deployed=pd,
        target=topology_of(console_demo.load(console_demo.write(single, "single.toml")).deployment)))
    manager.down = {"prefill", "decode", "router", "server"}
    app = make_app(console_demo, manager=manager)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.sub_title.endswith("an apply was interrupted (pd → single)"))
        assert "not deployed" not in app.sub_title, app.sub_title


@pytest.mark.parametrize("shows,hides", [("question_mark", "question_mark"), ("question_mark", "escape"),
                                          ("f1", "escape")])
async def test_question_mark_shows_every_key_and_hides_them_again(console_demo, shows, hides):
    # (1-6, [ ], s and Enter were in no footer and no help: only the source's binding table named them; and only ? or
    # F1 closed it, where an operator reaches for Escape)
    from textual.widgets import HelpPanel

    app = make_app(console_demo)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.plan is not None)
        assert app.check_action("hide_keys", ()) is False  # Escape is no key of the console's until the panel shows
        await pilot.press(shows)
        await wait_for(pilot, lambda: bool(app.screen.query(HelpPanel)))
        await pilot.press(hides)
        await wait_for(pilot, lambda: not app.screen.query(HelpPanel))
        assert app.screen is app.screen_stack[0] and app.is_running


async def test_during_its_apply_the_console_offers_cancel_not_apply_in_the_footer_and_the_topology_tab(console_demo):
    # (the footer still showed "a Apply/resume" and the topology tab "Pending … (a: review, apply)" while a did nothing)
    from rich.console import Console
    from textual.widgets._footer import FooterKey

    def footer_actions() -> set[str]:
        return {k.action for k in app.screen.query(FooterKey) if not k.has_class("-disabled")}

    def banner() -> str:
        console = Console(width=200, record=True, file=io.StringIO())
        console.print(app.query_one("#topology-panel").render())
        return console.export_text()

    fake = BlockingApply()
    app = make_app(console_demo, apply_fn=fake)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.plan is not None)
        await wait_for(pilot, lambda: "apply" in footer_actions())
        plan_id, cls = app.plan.plan_id, app.plan.cls
        assert f"Pending {cls} plan {plan_id}" in banner() and "(a: review, apply)" in banner()
        await _first_apply_running(pilot, app)
        try:
            await wait_for(pilot, lambda: "cancel_apply" in footer_actions())
            assert "apply" not in {k.action for k in app.screen.query(FooterKey)}
            text = banner()
            assert f"Applying {cls} plan {plan_id}" in text and "x: cancel" in text
            assert "a: review" not in text and "Pending" not in text
        finally:
            fake.release.set()  # (a failure must not leave the app waiting on the apply's thread at exit)
        await wait_for(pilot, lambda: not app.applying, timeout=5)
        await wait_for(pilot, lambda: "apply" in footer_actions())
        assert "Applying" not in banner()


async def test_the_first_frame_shows_the_journals_steps_not_all_pending(console_demo):
    # (for the first 0.4–1 s every step of a deployed deployment read "pending", and a y/N could be drawn over them)
    from pdctl.statemachine.journal import JournalState, StepRecord
    from pdctl.statemachine.machine import PD_STATES
    from pdctl.statemachine.topology import topology_of

    topo = topology_of(console_demo.load().deployment)
    Journal(console_demo.state, console_demo.name).write(JournalState(
        name=console_demo.name, deployed=topo, steps={s: StepRecord(status="done") for s in PD_STATES}))
    app = make_app(console_demo, live=False)  # no snapshot ever comes: what shows is the first frame's
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert app.snapshot is None
        assert [v.status for v in app.query_one(StepsPanel).steps] == ["done"] * len(PD_STATES)


async def test_a_snapshot_begun_before_the_last_step_event_does_not_take_the_steps_back(console_demo):
    # The telemetry worker read the journal (parsers_configured running), the apply then journalled the step done and
    # its event set the steps panel, and only then was the worker's snapshot delivered: it showed the last step
    # "running" after the apply had reached it (seen in test_console_applies_the_demo_to_parsers_configured). The
    # snapshots are posted here as the worker posts them; live=False: no worker of its own posts others between.
    from pdctl.statemachine.journal import JournalState, StepRecord
    from pdctl.statemachine.topology import topology_of

    loaded = console_demo.load()
    j = Journal(console_demo.state, console_demo.name)
    target = topology_of(loaded.deployment)
    done = {name: StepRecord(status="skipped" if name == "kernels_built" else "done") for name in PD_STATES}
    app = make_app(console_demo, live=False)

    def status_of(step: str) -> str:
        return next(s.status for s in app.query_one(StepsPanel).steps if s.name == step)

    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        j.write(JournalState(name=console_demo.name, target=target,
                             steps={**done, "parsers_configured": StepRecord(status="running")}))
        began = time.monotonic()
        stale = app.collector.collect()
        state = JournalState(name=console_demo.name, deployed=target, steps=done)
        j.write(state)
        app.post_message(ConsoleApp.ApplyProgressed(Event("step_done", "parsers configured",
                                                          step="parsers_configured"), state))
        await wait_for(pilot, lambda: status_of("parsers_configured") == "done")
        app.post_message(ConsoleApp.TelemetryUpdated(stale, started=began))
        await wait_for(pilot, lambda: app.snapshot is stale)
        assert status_of("parsers_configured") == "done"
        # a snapshot begun after the step event is shown whole, steps too
        app.post_message(ConsoleApp.TelemetryUpdated(stale, started=time.monotonic()))
        await wait_for(pilot, lambda: status_of("parsers_configured") == "running")


async def test_a_cancelled_telemetry_worker_leaves_its_wait_within_a_second(console_demo):
    # Textual cancels the worker on exit without waking it; --refresh takes up to 3600 s, and one wait that long held
    # the process's exit (seen as a test run that hung at its end).
    app = make_app(console_demo)
    app.refresh_s = 3600
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.snapshot is not None)
        app._wake.set()  # (one more round, so that the worker waits with the new interval)
        await pilot.pause(0.3)
        assert _telemetry_threads()
        app.workers.cancel_group(app, "telemetry")
        deadline = time.monotonic() + 2
        while _telemetry_threads() and time.monotonic() < deadline:
            await pilot.pause(0.05)
        assert not _telemetry_threads()


def _telemetry_threads() -> list[int]:
    """Threads now inside ``ConsoleApp.poll_telemetry``."""
    import sys

    def inside(frame) -> bool:  # noqa: ANN001
        while frame is not None:
            if frame.f_code.co_name == "poll_telemetry":
                return True
            frame = frame.f_back
        return False

    return [tid for tid, frame in sys._current_frames().items() if inside(frame)]


async def test_the_plan_tab_warns_of_a_port_held_outside_the_deployment_as_pdctl_plan_does(console_demo, monkeypatch):
    # `pdctl plan` warned of a port held outside the deployment (which apply then refuses, exit 3); the console's plan
    # tab said nothing of it. It asks the host in its plan worker, off the UI thread, as it asks what runs.
    import os
    import socket

    from pdctl.statemachine import service

    real, threads = service.host_warnings, []

    def watched(loaded, recorded, **kw):  # noqa: ANN001, ANN202
        threads.append(threading.current_thread())
        return real(loaded, recorded, **kw)

    monkeypatch.setattr(service, "host_warnings", watched)
    with open(f"/proc/{os.getpid()}/cmdline") as f:
        me = f.read().replace("\0", " ").strip()
    port = console_demo.ports["router"]
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", port))  # the router's address and port in the spec
    squatter.listen()
    app = make_app(console_demo)
    try:
        async with app.run_test(size=(160, 40)) as pilot:
            await wait_for(pilot, lambda: app.plan is not None)
            await pilot.press("6")
            await pilot.pause()
            [held] = app.plan.ports_held
            assert (held.port, held.role, held.step, held.pid) == (port, "router", "router_exposed", os.getpid())
            assert held.command and me.startswith(held.command.removesuffix(" …")), (held.command, me)
            shown = app.query_one(PlanPanel).render().plain
            assert "Warning: ports this deployment will listen on are held outside it" in shown, shown
            assert (f"  ! router needs port {port} at router_exposed, held by PID {os.getpid()} ({held.command})"
                    in shown), shown
            assert shown.index("Plan:") < shown.index("Warning:")  # after the plan, as `pdctl plan` puts it
            assert "note:" not in shown
            assert threads and threading.main_thread() not in threads  # the plan worker's, never the UI's
    finally:
        squatter.close()


async def test_the_plan_tab_notes_when_the_host_could_not_be_asked_which_ports_are_held(console_demo, monkeypatch):
    from pdctl.statemachine import service
    from pdctl.statemachine.errors import HostError

    def unreachable(loaded, recorded, **kw):  # noqa: ANN001, ANN202
        raise HostError("ssh gpu-1: connection refused")

    monkeypatch.setattr(service, "host_warnings", unreachable)
    app = make_app(console_demo)
    async with app.run_test(size=(160, 40)) as pilot:
        await wait_for(pilot, lambda: app.plan is not None)
        assert app.plan.ports_held is None  # (null in `pdctl plan --json`)
        shown = app.query_one(PlanPanel).render().plain
        assert "Plan: 4 to add" in shown, shown  # the plan stands
        assert ("note: the plan could not check whether the deployment's ports and GPUs are free (apply checks them "
                "before its first step): ssh gpu-1: connection refused") in shown, shown
        assert "Warning:" not in shown


def test_a_signal_while_the_console_starts_ends_it_with_its_code(console_demo, tmp_path):
    # Between Textual taking the terminal and on_mount handing SIGTERM / SIGHUP to the event loop, their default action
    # killed the console and left the terminal raw, on the alternate screen (a fresh user, `timeout -s TERM 1.3 pdctl
    # console`). run_console's early_signals ends it as a later SIGTERM does: exit 143, the app's own exit.
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    import pdctl.console.app as console_app

    script = tmp_path / "early.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal
        from pdctl.console.app import ConsoleApp, early_signals
        from pdctl.statemachine.service import load

        class Early(ConsoleApp):
            CSS_PATH = {str(Path(console_app.__file__).with_name("console.tcss"))!r}  # (beside ConsoleApp's file)

            def compose(self):  # (before on_mount, where the event loop takes the signals)
                os.kill(os.getpid(), signal.SIG{{}})
                yield from super().compose()

        app = Early(load({str(console_demo.spec)!r}, state_dir={str(console_demo.state)!r}), nvml=False, live=False)
        with early_signals(app):
            rc = app.run(headless=True)
        print("rc", rc, "signal", app.early_signal, "handler back", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    """))
    source = script.read_text()
    for sig, code in (("TERM", 143), ("HUP", 129), ("INT", 130)):  # (SIGINT raised KeyboardInterrupt mid-start-up)
        script.write_text(source.replace("SIG{}", f"SIG{sig}"))  # (a file: Textual reads an app class's source file)
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (sig, r.returncode, r.stderr[-2000:])
        assert r.stdout.split() == ["rc", str(code), "signal", str(code), "handler", "back", "True"], (sig, r.stdout)


async def test_a_spec_broken_while_open_is_said_in_pdctls_words_not_a_python_class_name(console_demo):
    # (the toast read "Spec not planned: SpecError: …", with the error's class name before its text)
    from textual.content import Content

    app = make_app(console_demo)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.plan is not None)
        console_demo.spec.write_text("name = \"x\"\n[model\n")
        app.clear_notifications()
        await pilot.press("r")
        await wait_for(pilot, lambda: list(app._notifications))
        shown = " ".join(str(Content.from_markup(n.message) if n.markup else Content(n.message))
                         for n in app._notifications)
        assert "Spec not planned: " in shown and "TOML syntax error" in shown, shown
        assert "SpecError" not in shown, shown
