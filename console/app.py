"""The console: a Textual app over the same engine as headless mode (``pdctl console SPEC``).

It holds no deployment logic. Apply runs :func:`pdctl.statemachine.service.apply` in a thread
worker (group ``apply``) with a sink that posts :class:`ConsoleApp.ApplyProgressed` messages;
reloading the spec runs :func:`~pdctl.statemachine.service.plan_spec` in another (group
``plan``), which also asks the host what ``pdctl plan`` says beside the changes: an apply unfinished or a role not
serving (:func:`~pdctl.statemachine.service.plan_unsettled`), ports held outside the deployment
and bind addresses apply would refuse (:func:`~pdctl.statemachine.service.plan_host_checks`); telemetry (journal, service manager, scrapes, NVML/sysfs,
logs) runs in a third (group ``telemetry``) at the configured interval and posts :class:`ConsoleApp.TelemetryUpdated`
snapshots, each superseding the one before. The UI thread only renders.

Key availability is computed in :meth:`ConsoleApp.check_action`: apply is hidden while the
console's own apply runs (``x`` cancels it then) and greyed while another process holds the lock;
cancel is greyed while no apply runs. ``--readonly`` removes every mutating binding from the
keymap itself (as k9s does), so no key can reach them; ``check_action`` hides them as well.
A topology change opens :class:`~pdctl.console._confirm.TopologyConfirmScreen` (type the
deployment's name); a disruptive one a y/N :class:`~pdctl.console._confirm.YesNoScreen`; the
engine re-checks the plan id it is given, so a plan that changed underneath is refused.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingsMap
from textual.containers import VerticalScroll
from textual.css.query import NoMatches
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Footer, Header, TabbedContent, TabPane
from textual.worker import get_current_worker

from pdctl.console._confirm import TopologyConfirmScreen, YesNoScreen
from pdctl.console.exit_codes import ExitCode, exit_code_for
from pdctl.console._gpu import GpuPanel
from pdctl.console._logs import LogsPanel
from pdctl.console._plan import PlanPanel, render_plan
from pdctl.console._proof import ProofPanel
from pdctl.console._steps import StepsPanel
from pdctl.console._throughput import ThroughputPanel
from pdctl.console._topology import TopologyPanel
from pdctl.console.collect import Collector, Snapshot, current_topology, log_sources
from pdctl.console.views import StepView, expected_states, loading_summary, step_views, with_progress
from pdctl.statemachine.errors import PdctlError, RunCancelled
from pdctl.statemachine.events import Event
from pdctl.statemachine.machine import role_steps
from pdctl.statemachine.plan import Plan

__all__ = ["MUTATING_ACTIONS", "ApplyCancelled", "ConsoleApp", "run_console"]

W = TypeVar("W")

MUTATING_ACTIONS = frozenset({"apply", "cancel_apply"})
"""Actions that change (or halt a change to) the deployment: gone in ``--readonly``."""

TABS = ("topology", "gpu", "throughput", "logs", "proof", "plan")


def _said(exc: BaseException) -> str:
    """An error as the console shows it: pdctl's own errors in their words (and hint), as the CLI prints them; any
    other exception with its type, which says more than its text alone (``KeyError: 'name'``)."""
    return str(exc) if isinstance(exc, PdctlError) else f"{type(exc).__name__}: {exc}"


class ApplyCancelled(RunCancelled):
    """Raised by the console's sink to halt an apply at the next event or long wait's poll (the engine journals the
    step in progress as interrupted; what already runs stays as it was)."""


class _PostingSink:
    """An :class:`~pdctl.statemachine.events.EventSink` that reposts each event as a message
    (with the journal as it now stands), and halts the run once cancel is asked."""

    def __init__(self, app: ConsoleApp, cancel: threading.Event) -> None:
        self.app = app
        self.cancel = cancel

    def emit(self, event: Event) -> None:
        journal = None
        try:
            journal = self.app.loaded.journal.read()
        except Exception:  # noqa: BLE001 - progress without the journal is still progress
            pass
        self.app.post_message(ConsoleApp.ApplyProgressed(event, journal))
        # (not on progress said inside a step, "info": a role restarted and the next not yet would be left half-done)
        if self.cancel.is_set() and event.kind not in ("apply_failed", "apply_done", "apply_interrupted", "step_failed",
                                                       "info"):
            raise ApplyCancelled("apply cancelled from the console")

    def checkpoint(self) -> None:
        """The engine's long waits (a model loading, a port still held) call this every poll: cancel halts them
        there, leaving what was started to finish starting, as a cancel at a step event does."""
        if self.cancel.is_set():
            raise ApplyCancelled("apply cancelled from the console")



def _file_signature(path) -> tuple[int, int, int] | None:  # noqa: ANN001
    """``(inode, size, mtime in ns)`` of *path* (None: unreadable or gone): what tells a rewritten spec file."""
    try:
        st = os.stat(path)
    except (OSError, TypeError, ValueError):
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns

class ConsoleApp(App[int]):
    """pdctl's console for one deployment spec."""

    TITLE = "pdctl"
    CSS_PATH = "console.tcss"
    ENABLE_COMMAND_PALETTE = False  # no second path to actions that --readonly removes

    BINDINGS = [
        Binding("a", "apply", "Apply/resume"),
        Binding("x", "cancel_apply", "Cancel apply"),
        Binding("r", "reload", "Reload spec"),
        Binding("1", "show_tab('topology')", "Topology", show=False),
        Binding("2", "show_tab('gpu')", "GPU/NUMA", show=False),
        Binding("3", "show_tab('throughput')", "Throughput", show=False),
        Binding("4", "show_tab('logs')", "Logs", show=False),
        Binding("5", "show_tab('proof')", "Proof", show=False),
        Binding("6", "show_tab('plan')", "Plan", show=False),
        Binding("left_square_bracket", "log_role(-1)", "Prev log", show=False),
        Binding("right_square_bracket", "log_role(1)", "Next log", show=False),
        Binding("s", "focus_steps", "Steps", show=False),
        Binding("question_mark,f1", "toggle_keys", "Keys"),
        Binding("escape", "hide_keys", "Hide keys", show=False),
        Binding("q", "quit", "Quit"),
        # (Textual's own Ctrl-C only says "press ctrl+q to quit": an operator's Ctrl-C quits as q does, asking first
        # while an apply runs; a text field that has focus keeps Ctrl-C for copy)
        Binding("ctrl+c", "quit", "Quit", show=False),
    ]
    """
    | Key(s) | Description |
    | :- | :- |
    | a | Apply the spec (or resume an interrupted apply). Topology change: type the name; disruptive: y/N. Not in --readonly, nor while an apply runs. |
    | x | Cancel the running apply at its next event. Not in --readonly. |
    | r | Reload the spec from disk and show the plan (not while an apply runs: its plan stays shown until it ends). |
    | 1-6 | Topology, GPU/NUMA, Throughput, Logs, Proof, Plan. |
    | [ / ] | Previous / next role in the logs panel. |
    | s | Focus the state-machine panel (↑/↓, Enter shows a proof). |
    | ?, F1 | Show or hide every key of the screen (Textual's keys panel). |
    | Escape | Hide the keys panel. |
    | q, Ctrl-C | Quit (while an apply runs, after a y/N: it stops at its next event; exit 130). |
    """

    applying: reactive[bool] = reactive(False, bindings=True)
    """An apply worker is running."""
    plan: reactive[Plan | None] = reactive(None, bindings=True)
    """The plan from the journal to the loaded spec."""

    # -- messages ----------------------------------------------------------------------------------
    class TelemetryUpdated(Message):
        """A new snapshot from the telemetry worker; a newer one replaces a queued older one. *started*: when its
        collection began (``time.monotonic()``)."""

        def __init__(self, snapshot: Snapshot, started: float | None = None) -> None:
            super().__init__()
            self.snapshot = snapshot
            self.started = started

        def can_replace(self, message: Message) -> bool:
            return isinstance(message, ConsoleApp.TelemetryUpdated)

    class ApplyProgressed(Message):
        """The engine emitted *event* during an apply; *journal* is the journal just after."""

        def __init__(self, event: Event, journal: Any) -> None:
            super().__init__()
            self.event = event
            self.journal = journal

    class ApplyFinished(Message):
        """An apply ended: *result* on success, *error* otherwise."""

        def __init__(self, result: Any, error: BaseException | None) -> None:
            super().__init__()
            self.result = result
            self.error = error

    class Planned(Message):
        """The spec was (re)loaded and planned (*error*: why it could not be)."""

        def __init__(self, loaded: Any, plan: Plan | None, error: str | None, unsettled: str | None = None,
                     kept: tuple[str, ...] = (), ports_unchecked: str | None = None,
                     notes: tuple[str, ...] = ()) -> None:
            super().__init__()
            self.loaded = loaded
            self.plan = plan
            self.error = error
            self.unsettled = unsettled
            """``service.Unsettled.kind``: "drift" when apply would restart a role that does not serve as proven."""
            self.kept = kept
            """``service.Unsettled.kept``: roles the comparison restarts that the plan keeps as an interrupted apply
            left them (running what the spec asks)."""
            self.ports_unchecked = ports_unchecked
            """Why the plan's ``ports_held`` is None: the host could not be asked which of the deployment's ports are
            held outside it."""
            self.notes = notes
            """``service.Unsettled.notes``: what ``pdctl plan`` notes beside the plan (an earlier apply that did not
            finish, a role not serving as proven)."""

    # -- construction ------------------------------------------------------------------------------
    def __init__(
        self,
        loaded: Any,
        *,
        readonly: bool = False,
        refresh_s: float | None = None,
        state_dir: str | Path | None = None,
        live: bool = True,
        apply_fn: Callable[..., Any] | None = None,
        collector: Collector | None = None,
        timeouts: Any = None,
        clock: Callable[[], float] = time.time,
        nvml: bool = True,
    ) -> None:
        super().__init__()
        self.loaded = loaded
        self._spec_read = _file_signature(loaded.path)
        """The spec file as it was when last read (:func:`_file_signature`): the plan tab says when it changes."""
        self.readonly = readonly
        self.refresh_s = float(refresh_s or loaded.deployment.console.refresh_s or 1.0)
        self.state_dir = state_dir if state_dir is not None else loaded.journal.dir
        """Where the journal lives; a reload keeps it (an edited spec plans against the same journal)."""
        self.live = live
        self.apply_fn = apply_fn
        self.timeouts = timeouts
        self.clock = clock
        self.collector = collector or Collector(loaded, interval_s=self.refresh_s, nvml=nvml, clock=clock)
        self.log_role: str | None = None
        self.snapshot: Snapshot | None = None
        self._clients_fail_since: float | None = None  # (the first snapshot whose serving verdict failed, epoch s)
        self.plan_error: str | None = None
        self.plan_unsettled: str | None = None
        """Why apply has work beside the plan's changes (``service.Unsettled.kind``; "drift": it restarts a role)."""
        self.plan_kept: tuple[str, ...] = ()
        """Roles the comparison restarts that the plan keeps: an interrupted apply already started them with what the
        spec asks (``ResourceChange.kept``)."""
        self._down_at_plan: frozenset[tuple[str, str, bool]] = frozenset()
        """The roles not serving when the plan was last made: (role, state, supervised)."""
        self._interrupted_at: str | None = None  # the step the engine journalled as interrupted (apply_interrupted)
        self.early_signal: int | None = None
        """The exit code of a SIGINT / SIGTERM / SIGHUP that came while the app started (:func:`early_signals`)."""
        self.signalled: int | None = None
        """The exit code of the signal that ended the app (:meth:`terminate`); None when the operator quit."""
        self.quit_during_apply = False
        """The operator quit while an apply ran (and said yes to cancelling it): ``run_console`` waits for the apply
        and exits with how it ended, also when it finished while the question was open."""
        self._progressed_at = float("-inf")  # time.monotonic() when an apply's step event last set the steps panel
        self._loading: dict[str, str] = {}
        """Step name → what its role still loading last said (a ``progress`` event), shown in its running row."""
        self.last_apply_error: BaseException | None = None
        self._apply_began = False  # the engine said apply_started: past its plan and checks, it may change things
        self._failed_journal_at: float | None = None  # the journal's updated_at when the last apply's error came
        self._cancel = threading.Event()
        self.apply_ended = threading.Event()
        """Set when the apply worker's call returns or raises (``run_console`` waits on it after a quit mid-apply)."""
        self.apply_outcome: Any = None
        """The last apply's result, or the exception that ended it (set before :attr:`apply_ended`)."""
        self._wake = threading.Event()
        self._planned_serial: int | None = None
        self._selected_step: str | None = None
        self._active_tab = "topology"
        self._show_plan_on_planned = False
        self._panels_ready = False
        """The main screen is composed and mounted (messages arriving outside that are dropped)."""
        if readonly:
            # Remove mutating bindings from the keymap itself: no key reaches them.
            kept = [b for _k, b in self._bindings if b.action.split("(", 1)[0] not in MUTATING_ACTIONS]
            self._bindings = BindingsMap(kept)

    def compose(self) -> ComposeResult:
        yield Header()
        try:  # the journal as it stands: the first frame shows the steps' states, not "pending" until the first poll
            journal = self.loaded.journal.read()
        except Exception:  # noqa: BLE001 - a damaged journal is named by the collector's first snapshot
            journal = None
        topo = current_topology(self.loaded, journal)
        yield StepsPanel(step_views(expected_states(topo), journal, self.clock()), id="steps")
        with TabbedContent(id="tabs", initial="topology"):
            with TabPane("1 Topology", id="topology"):
                with VerticalScroll():
                    yield TopologyPanel(topo, readonly=self.readonly, id="topology-panel")
            with TabPane("2 GPU/NUMA", id="gpu"):
                with VerticalScroll():
                    yield GpuPanel(id="gpu-panel")
            with TabPane("3 Throughput", id="throughput"):
                with VerticalScroll():
                    yield ThroughputPanel(id="throughput-panel")
            with TabPane("4 Logs", id="logs"):
                yield LogsPanel(id="logs-panel")
            with TabPane("5 Proof", id="proof"):
                with VerticalScroll():
                    yield ProofPanel(id="proof-panel")
            with TabPane("6 Plan", id="plan"):
                with VerticalScroll():
                    yield PlanPanel(id="plan-panel")
        yield Footer()

    def _w(self, cls: type[W]) -> W:
        """The main screen's widget of type *cls* (whatever modal is on top)."""
        return self._main.query_one(cls)

    def on_mount(self) -> None:
        # SIGINT (`kill -INT`: in the console's raw mode Ctrl-C is a key, not this signal), SIGTERM, and SIGHUP (the SSH
        # session dropped) end the console as quitting does: a running apply is cancelled at its next event or poll
        # (journalled and audited as interrupted) and the terminal restored; the exit code is the signal's
        import asyncio

        self._signals: list[int] = []
        for sig, code in _SIGNAL_CODES.items():
            if signal.getsignal(sig) == signal.SIG_IGN:  # ignored when started (nohup; SIGINT in a script's `&` job)
                continue
            try:
                asyncio.get_running_loop().add_signal_handler(sig, self.terminate, code)
                self._signals.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no such signal
                pass
        if self.early_signal is not None:  # (came while the app started, before these handlers: run_console)
            self.terminate(self.early_signal)
        self._main = self.screen
        self._panels_ready = True
        self.title = f"pdctl · {self.loaded.deployment.name}"
        self.sub_title = self._status_line()
        topo = current_topology(self.loaded, None)
        self._w(LogsPanel).roles = tuple(log_sources(topo))
        self._w(StepsPanel).focus()
        if self.live:
            self.reload_spec(reread=False)
            self.poll_telemetry()

    def on_unmount(self) -> None:
        import asyncio

        for sig in getattr(self, "_signals", ()):  # the loop may outlive the app (tests run several)
            asyncio.get_running_loop().remove_signal_handler(sig)
        self._panels_ready = False
        self._wake.set()

    # -- key availability -------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in MUTATING_ACTIONS and self.readonly:
            return False
        if action == "apply":  # hidden during our own apply (x cancels it); greyed while another process holds the lock
            return False if self.applying else None if self._locked_by() else True
        if action == "cancel_apply":
            return True if self.applying else None
        if action == "reload":  # the panels show the plan being applied until it ends: r re-reads the spec after
            return None if self.applying else True
        if action == "hide_keys":  # Escape is left to anything else on the screen unless the keys panel shows
            return self._keys_shown()
        return True

    def _keys_shown(self) -> bool:
        from textual.widgets import HelpPanel

        return bool(self.screen.query(HelpPanel))

    def _locked_by(self) -> Mapping[str, Any] | None:
        """The lock's holder when another process holds it (from the last snapshot)."""
        snap = self.snapshot
        return None if snap is None or self.applying else snap.locked_by

    def watch_applying(self, applying: bool) -> None:
        # The topology tab's pending-plan banner offers `a` only while `a` can run (reactive(bindings=True)
        # refreshes the footer).
        if self._panels_ready:
            try:
                self._w(TopologyPanel).applying = applying
            except NoMatches:  # the app is shutting down: its panels are gone
                self._panels_ready = False

    # -- workers ----------------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="telemetry", exit_on_error=False, description="telemetry")
    def poll_telemetry(self) -> None:
        """Collect a snapshot every ``refresh_s`` seconds until cancelled."""
        worker = get_current_worker()
        while not worker.is_cancelled:
            t0 = time.monotonic()
            try:
                # Logs are read only while their tab shows (a log file is re-read whole).
                snap = self.collector.collect(log_role=self.log_role if self._active_tab == "logs" else None)
            except Exception as exc:  # noqa: BLE001 - keep polling; say what broke
                self.call_from_thread(self.notify, f"telemetry: {_said(exc)}", severity="warning")
            else:
                if not worker.is_cancelled:
                    self.post_message(self.TelemetryUpdated(snap, started=t0))
            # Until the next interval or a wake, looking at the cancellation every 0.5 s: Textual cancels this worker
            # without waking it (an exit, a failed test), and one wait of refresh_s (up to 3600 s) held the process's
            # exit that long.
            deadline = max(t0 + self.refresh_s, time.monotonic() + 0.05)
            while not worker.is_cancelled and (left := deadline - time.monotonic()) > 0:
                if self._wake.wait(min(left, 0.5)):
                    break
            self._wake.clear()

    @work(thread=True, exclusive=True, group="plan", exit_on_error=False, description="plan")
    def reload_spec(self, reread: bool = True) -> None:
        """(Re)load the spec from disk when *reread*, then plan it against the journal."""
        from pdctl.statemachine.service import load, plan_host_checks, plan_spec, plan_unsettled

        loaded = self.loaded
        try:
            if reread:
                seen = _file_signature(self.loaded.path)  # (before the read: a write during it reads as changed)
                loaded = load(self.loaded.path, state_dir=self.state_dir, discover=True)
                self._spec_read = seen
            recorded = loaded.journal.read()
            plan = plan_spec(loaded, recorded)
        except Exception as exc:  # noqa: BLE001 - a broken spec is shown, never fatal
            self.post_message(self.Planned(loaded, None, _said(exc)))
            return
        # what `pdctl plan` says beside the changes: an apply running or unfinished, a role not serving as proven
        try:
            why = plan_unsettled(loaded, recorded, plan)
        except Exception as exc:  # noqa: BLE001 - the host cannot be asked now: say so, the plan stands
            why = None
            plan = plan.model_copy(update={"unsettled": f"whether what was deployed still runs cannot be told "
                                                        f"({_said(exc)})"})
        if why is not None and why.text:
            plan = plan.model_copy(update={"unsettled": why.text})
        # the ports a process outside the deployment holds: `pdctl plan`'s warning after the plan (apply refuses them);
        # whatever keeps them from being checked is a note, never a plan left unshown
        warnings, unchecked = plan_host_checks(loaded, recorded, catch=(Exception,))
        plan = plan.model_copy(update=warnings)
        self.post_message(self.Planned(loaded, plan, None, why.kind if why is not None else None,
                                       why.kept if why is not None else (), unchecked,
                                       why.notes if why is not None else ()))

    @work(thread=True, exclusive=True, group="apply", exit_on_error=False, description="apply")
    def run_apply(self, confirm: str | None, expect_plan: str | None) -> None:
        """Drive the engine's apply (the same call as ``pdctl apply``), refused by the engine unless it plans
        *expect_plan*, the plan the operator was shown."""
        fn = self.apply_fn
        if fn is None:
            from pdctl.statemachine.service import apply as fn
        kw: dict[str, Any] = {"confirm": confirm, "expect_plan": expect_plan, "sink": _PostingSink(self, self._cancel)}
        if self.timeouts is not None:
            kw["timeouts"] = self.timeouts
        try:
            result = fn(self.loaded, **kw)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the UI as a value
            self.apply_outcome = exc
            self.apply_ended.set()
            self.post_message(self.ApplyFinished(None, exc))
            return
        self.apply_outcome = result
        self.apply_ended.set()
        self.post_message(self.ApplyFinished(result, None))

    # -- actions ----------------------------------------------------------------------------------
    def action_apply(self) -> None:
        """Apply (or resume). Asks as the plan demands: a topology change to a deployed topology
        needs the deployment's name typed; any other non-trivial plan (a first deployment, a
        disruptive change) a y/N; in-place changes and a resume with no changes none. Spec
        warnings are shown before the question."""
        if self.readonly or self.applying:
            return
        if holder := self._locked_by():
            self.notify(f"Locked by PID {holder.get('pid')} ({holder.get('purpose', '?')}, since {holder.get('since', '?')}): "
                        "wait for it to finish", severity="warning", markup=False)
            return
        plan = self.plan
        if plan is None:
            self.notify("No plan yet: the spec could not be planned" if self.plan_error else "Planning… try again in a moment", severity="warning")
            return
        warnings = self._warnings_text()
        if plan.requires_confirmation:

            def done(ok: bool | None) -> None:
                if ok:
                    self.start_apply(plan.plan_id, plan.plan_id)
                else:
                    self.notify("Topology change cancelled: nothing changed")

            self.push_screen(TopologyConfirmScreen(plan, self.loaded.deployment.name, warnings=warnings), done)
            return
        if plan.has_changes and plan.cls in ("disruptive", "topology"):

            def yn(ok: bool | None) -> None:
                if ok:
                    self.start_apply(None, plan.plan_id)
                else:
                    self.notify("Not applied: nothing changed")

            if plan.from_topology is None:
                question = f"Deploy {plan.deployment!r} (plan {plan.plan_id})?"
            else:
                restarts = plan.restarts()  # (what the plan keeps as it runs restarts nothing)
                question = (f"Apply plan {plan.plan_id}? It restarts "
                            f"{', '.join(restarts) or ('no role' if self.plan_kept else 'serving roles')}"
                            + (f" and keeps {', '.join(self.plan_kept)}, which the interrupted apply already started "
                               "with these settings" if self.plan_kept else "") + ".")
            detail = Text()
            if warnings:
                detail.append(warnings + "\n\n", style="yellow")
            detail.append_text(render_plan(plan))
            self.push_screen(YesNoScreen(question, detail), yn)
            return
        if self.plan_unsettled == "drift":  # apply restarts what does not serve as proven, beyond the plan's changes

            def drift(ok: bool | None) -> None:
                if ok:
                    self.start_apply(None, plan.plan_id)
                else:
                    self.notify("Not applied: nothing changed")

            detail = Text()
            if warnings:
                detail.append(warnings + "\n\n", style="yellow")
            detail.append_text(render_plan(plan))
            first = (f"Apply plan {plan.plan_id}? Beside its changes, " if plan.has_changes
                     else "Apply? The spec has no changes, but ")
            self.push_screen(YesNoScreen(f"{first}{plan.unsettled}: apply restarts what does not serve as specified.",
                                         detail), drift)
            return
        self.start_apply(None, plan.plan_id)

    def _warnings_text(self) -> str:
        return "\n".join(f"warning: {w.field}: {w.message}" for w in getattr(self.loaded, "warnings", ()) or ())

    def start_apply(self, confirm: str | None, expect_plan: str) -> None:
        """Start the apply worker for plan *expect_plan*, the one the operator was shown (and answered, where
        it asked): the engine refuses it if it plans another by then (:class:`StalePlanError`). *confirm*: the
        topology change's confirmation, its plan id."""
        if self.readonly or self.applying:
            return
        self._cancel.clear()
        self.apply_ended.clear()
        self._interrupted_at = None
        self._apply_began = False
        self.applying = True
        self.last_apply_error = None
        self._w(PlanPanel).last_failure = None
        self.sub_title = self._status_line()
        self.run_apply(confirm, expect_plan)

    def action_cancel_apply(self) -> None:
        if self.applying and not self.readonly:
            self._cancel.set()
            self.notify("Cancelling at the next step event…")

    def terminate(self, code: int) -> None:
        """End on a signal (*code*: 128 + its number): cancel a running apply, then exit with *code*."""
        self.signalled = self.signalled or code
        self._cancel.set()
        self.exit(code)

    async def action_quit(self) -> None:
        """Quit; while an apply runs, ask first, then cancel it at its next step event."""
        if not self.applying:
            self.exit(0)
            return

        def done(ok: bool | None) -> None:
            if ok:
                self.quit_during_apply = True  # (the apply may have ended while the question was open)
                self._cancel.set()
                self.exit(ExitCode.INTERRUPTED)  # as a headless apply stopped by Ctrl-C: the apply did not finish

        self.push_screen(
            YesNoScreen(
                "An apply is running. Quit, and cancel it at its next step event?",
                "The apply stops there: what it has already stopped or started stays so (a role it was restarting "
                "may be down, or still loading), and the journal records where it stopped; `pdctl apply SPEC` (or a "
                "from the console) resumes from there.",
            ),
            done,
        )

    def action_reload(self) -> None:
        if self.applying:  # (greyed out; a binding run anyway changes nothing mid-apply)
            return
        self._show_plan_on_planned = True
        self.reload_spec(reread=True)

    def action_toggle_keys(self) -> None:
        """Show every binding of the screen (the footer shows only the main ones), or hide them again."""
        if self._keys_shown():
            self.action_hide_help_panel()
        else:
            self.action_show_help_panel()
        self.refresh_bindings()  # Escape's binding follows the panel

    def action_hide_keys(self) -> None:
        """Hide the keys panel (Escape), as ``?`` does when it shows."""
        if self._keys_shown():
            self.action_hide_help_panel()
            self.refresh_bindings()

    def action_show_tab(self, tab: str) -> None:
        self._w(TabbedContent).active = tab

    def action_log_role(self, delta: int) -> None:
        self._w(LogsPanel).action_cycle(delta)

    def action_focus_steps(self) -> None:
        self._w(StepsPanel).focus()

    # -- message handlers -------------------------------------------------------------------------
    def on_console_app_telemetry_updated(self, message: TelemetryUpdated) -> None:
        # A snapshot whose collection began before the apply's last step event may have read the journal before that
        # step's write: its steps would take the panel back (the last step "running" after the apply reached it).
        fresh = message.started is None or message.started >= self._progressed_at
        try:
            self.show_snapshot(message.snapshot, steps=fresh)
        except NoMatches:  # the app is shutting down: its panels are gone
            self._panels_ready = False

    def show_snapshot(self, snap: Snapshot, *, steps: bool = True) -> None:
        """Render *snap* in every panel (also how tests feed fixed samples); with ``steps=False`` all but the steps
        (and the selected step's proof), which an apply's later step event has already shown."""
        if not self._panels_ready:
            return
        self.snapshot = snap
        failing = snap.serving is not None and snap.serving.seen_failing
        self._clients_fail_since = (self._clients_fail_since or snap.at) if failing else None
        # (helper-109: the spec file rewritten meanwhile — a collapse, say — and the plan tab still said "No changes")
        self._w(PlanPanel).spec_changed = _file_signature(self.loaded.path) != self._spec_read
        if steps:
            self._w(StepsPanel).steps = with_progress(snap.steps, self._loading)
            self._refresh_proof(snap.steps)
        topo_panel = self._w(TopologyPanel)
        topo_panel.topology = snap.topology
        topo_panel.services = dict(snap.services)
        holder = self._locked_by()
        topo_panel.locked_by = None if holder is None else f"PID {holder.get('pid')} ({holder.get('purpose', '?')})"
        gpu = self._w(GpuPanel)
        gpu.topology = snap.topology
        gpu.sample = snap.gpu
        tp_panel = self._w(ThroughputPanel)
        tp_panel.samples = snap.throughput
        tp_panel.plan_id = snap.journal.plan_id if snap.journal is not None else None
        if snap.bench != tp_panel.bench:  # (a fresh dict each tick: compared, not redrawn when equal)
            tp_panel.bench = dict(snap.bench) if snap.bench is not None else None
        logs = self._w(LogsPanel)
        roles = tuple(log_sources(snap.topology))
        if logs.roles != roles:
            logs.roles = roles
        if snap.log_role is not None and snap.log_role == logs.role:
            logs.show(snap.log_role, snap.log_lines)
        self.sub_title = self._status_line()
        self.refresh_bindings()  # the apply key follows the lock (held by another apply, or free again)
        serial = snap.journal.serial if snap.journal is not None else 0
        # plan again when the journal moved, or a role stopped or came back serving since the plan (its "unsettled"
        # account, service.plan_unsettled, is what `a` asks by)
        # (each with its state: a role going from unsupervised to failed changes what the plan's y/N says of it)
        down = frozenset((v.role, v.state, v.supervised) for v in snap.services.values()
                         if v.state != "active" or not v.supervised)
        if (self.live and self._planned_serial is not None and not self.applying
                and (serial != self._planned_serial or down != self._down_at_plan)):
            self._planned_serial = serial
            self._down_at_plan = down
            self.reload_spec(reread=False)

    def _refresh_proof(self, steps: tuple[StepView, ...]) -> None:
        if self._selected_step is None:
            return
        for s in steps:
            if s.name == self._selected_step:
                self._w(ProofPanel).step = s

    def on_steps_panel_step_selected(self, message: StepsPanel.StepSelected) -> None:
        self._selected_step = message.step.name
        self._w(ProofPanel).step = message.step
        self.action_show_tab("proof")

    @on(TabbedContent.TabActivated)
    def _tab_activated(self, event: TabbedContent.TabActivated) -> None:
        self._active_tab = event.pane.id or ""
        if self._active_tab == "logs":
            self._wake.set()

    def on_logs_panel_role_changed(self, message: LogsPanel.RoleChanged) -> None:
        self.log_role = message.role
        self._wake.set()

    def on_console_app_planned(self, message: Planned) -> None:
        try:
            self._planned(message)
        except NoMatches:
            self._panels_ready = False

    def _planned(self, message: Planned) -> None:
        if not self._panels_ready:
            return
        self.loaded = message.loaded
        self.collector.set_loaded(message.loaded)
        self.plan_error = message.error
        self.plan = message.plan
        self.plan_unsettled = message.unsettled
        self.plan_kept = message.kept
        if message.plan is not None:
            self._planned_serial = message.plan.from_serial
        panel = self._w(PlanPanel)
        panel.error = message.error
        panel.ports_unchecked = message.ports_unchecked
        panel.notes = message.notes
        panel.plan = message.plan
        self._w(TopologyPanel).plan = message.plan
        if message.error:
            self.notify(f"Spec not planned: {message.error}", severity="error", timeout=8, markup=False)
        if self._show_plan_on_planned:  # r: reloading the spec shows its plan
            self._show_plan_on_planned = False
            self.action_show_tab("plan")
        self.sub_title = self._status_line()

    def on_console_app_apply_progressed(self, message: ApplyProgressed) -> None:
        try:
            self._progressed(message)
        except NoMatches:
            self._panels_ready = False

    def _progressed(self, message: ApplyProgressed) -> None:
        if not self._panels_ready:
            return
        ev = message.event
        if ev.kind == "apply_interrupted":  # the engine names the step it journalled as interrupted
            self._interrupted_at = ev.step
        if ev.kind == "apply_started":
            self._apply_began = True
            self._loading.clear()
        if ev.kind == "progress" and ev.step:
            self._loading[ev.step] = loading_summary(ev.data)
        elif ev.step and ev.kind != "info":  # (the step began, ended or failed: no role of it loads any more)
            self._loading.pop(ev.step, None)
        if message.journal is not None:
            topo = current_topology(self.loaded, message.journal)
            steps = with_progress(step_views(expected_states(topo), message.journal, self.clock()), self._loading)
            self._w(StepsPanel).steps = steps
            self._progressed_at = time.monotonic()
            self._refresh_proof(steps)
        if ev.kind in ("step_failed", "role_removed"):
            self.notify(ev.message, severity="error" if ev.kind == "step_failed" else "information", timeout=8,
                        markup=False)
        self.sub_title = self._status_line(ev.message)

    def on_console_app_apply_finished(self, message: ApplyFinished) -> None:
        self.applying = False
        self._loading.clear()
        self.last_apply_error = message.error
        if message.error is None:
            self.notify(f"{self.loaded.deployment.name}: reached {message.result.state}", title="Applied", markup=False)
        elif isinstance(message.error, ApplyCancelled):  # the operator's own x: no error, where it stopped
            stopped = self._interrupted_at
            self.notify(f"the apply stopped{' at ' + stopped if stopped else ' before it changed anything'}"
                        + ("; a resumes it" if stopped else ""), title="Apply cancelled", severity="warning", markup=False)
        else:
            err = message.error
            try:  # (another process's later apply or down writes the journal: the header then stops saying this)
                self._failed_journal_at = self.loaded.journal.read().updated_at
            except Exception:  # noqa: BLE001 - the error is said all the same; the journal's reader names its own fault
                self._failed_journal_at = None
            hint = getattr(err, "hint", None)
            step = getattr(err, "step", None)
            # a refusal before the first step (a port or GPU held outside, an unusable address) names the step it would
            # have failed at, yet no step ran: said as the header says it, never as a step that failed
            refused = not self._apply_began
            text = (f"{'step ' + step + ': ' if step and not refused else ''}"
                    f"{getattr(err, 'message', None) or err}"
                    + (f" (it would have failed at {step})" if step and refused else ""))
            title = "Apply refused" if refused else getattr(err, "title", None) or type(err).__name__
            # (not markup: an error's "[parsers]" or "[router]" names the fix)
            self.notify(text + (f"\nhint: {hint}" if hint else ""), title=title, severity="error", timeout=15, markup=False)
            self._w(PlanPanel).last_failure = (f"Last apply ({time.strftime('%H:%M:%S')}): {title}: {text}"
                                               + (f"\nhint: {hint}" if hint else ""))
        self.sub_title = self._status_line()
        if self.live:
            self.reload_spec(reread=False)
            self._wake.set()

    # -- helpers ----------------------------------------------------------------------------------
    def _error_outdated(self, snap: Snapshot | None) -> bool:
        """Whether the journal has been written since the last apply's error came (another process's apply or down,
        as *snap* read it): the header's "LAST APPLY FAILED" then no longer says how the deployment stands."""
        at = self._failed_journal_at
        later = snap.journal.updated_at if snap is not None and snap.journal is not None else None
        return later is not None and (at is None or later > at)

    def _status_line(self, event: str | None = None) -> str:
        bits = []
        if self.readonly:
            bits.append("READ-ONLY")
        if self.applying:
            bits.append(f"applying… {event}" if event else "applying…")
        elif holder := self._locked_by():
            bits.append(f"LOCKED by PID {holder.get('pid')} ({holder.get('purpose', '?')})")
        else:
            # most urgent first: an 80-column header cuts the line's end
            err = self.last_apply_error
            snap = self.snapshot
            if err is not None and not isinstance(err, ApplyCancelled) and not self._error_outdated(snap):
                # (a refusal before the first step leaves no step failed: the plan tab keeps its words in full)
                step = getattr(err, "step", None)
                bits.append(f"LAST APPLY FAILED at {step} (6: why)" if self._apply_began and step else
                            "LAST APPLY FAILED (6: why)" if self._apply_began else "LAST APPLY REFUSED (6: why)")
            where = None
            if snap is not None and snap.steps:
                status = {s.name: s.status for s in snap.steps}
                reached = None
                for s in snap.steps:
                    if s.status in ("done", "skipped"):
                        reached = s.name
                    else:
                        break
                failed = [s.name for s in snap.steps if s.status == "failed"]
                stopped = [s.name for s in snap.steps if s.status == "interrupted"]
                running = [v.role for v in snap.services.values() if v.state in ("active", "activating", "deactivating")]
                j = snap.journal
                # an apply stopped before its first step (while it removed the roles a topology change drops, say)
                # journals its target and no step: it is unfinished, not "not deployed", as `pdctl status` says
                unfinished = None if j is None or j.target is None else (
                    "an apply was interrupted" + (f" ({j.deployed.mode} → {j.target.mode})"
                                                  if j.deployed is not None and j.deployed.mode != j.target.mode else ""))
                where = (f"failed at {failed[0]}" if failed else f"interrupted at {stopped[0]}" if stopped
                         else f"reached {reached} · {unfinished}" if reached and unfinished
                         else f"reached {reached}" if reached else unfinished if unfinished
                         else "not deployed, yet units run" if running else "not deployed")
                # a role whose step was proven may have gone down since: the header says so, not only the panels
                # (a role whose step never ran, e.g. the router of an apply stopped at decode_up, is not "down")
                step_of = role_steps(snap.topology)
                proven = {r: status.get(step_of.get(r, "")) in ("done", "skipped") for r in snap.services}
                unknown = [v.role for v in snap.services.values() if v.state.startswith("unknown")]
                down = [v.role for r, v in snap.services.items() if proven[r] and v.state != "active"
                        and v.role not in unknown]
                if down:
                    bits.append(f"NOT serving: {', '.join(down)}")
                # (every unit active and proven, and still every client of the router gets 503: its breaker)
                sv = snap.serving
                if sv is not None and sv.seen_failing and status.get("router_exposed") in ("done", "skipped") \
                        and not down:
                    since = snap.at - (self._clients_fail_since or snap.at)
                    bits.append(f"CLIENTS FAIL for {since:.0f} s: {'; '.join(sv.problems)}")
                if unknown:  # (an SSH host that stopped answering: the servers may well run; its panels go stale)
                    why = ("HOST NOT ANSWERING" if any("host not answering" in v.state for v in snap.services.values())
                           else "STATE UNKNOWN")
                    bits.append(f"{why}: {', '.join(unknown)} unknown")
                # (serving, but a crash would not be restarted: `pdctl status` says UNSUPERVISED, apply restarts it)
                loose = [v.role for r, v in snap.services.items() if proven[r] and v.state == "active" and not v.supervised]
                if loose:
                    bits.append(f"UNSUPERVISED: {', '.join(loose)}")
                # (serving again after a crash its supervisor or systemd recovered from: not what its step proved, as
                # `pdctl status` marks the proof; apply proves it again)
                proven_at = {s.name: s.finished_at for s in snap.steps}
                restarted = [v.role for r, v in snap.services.items() if proven[r] and v.state == "active"
                             and v.started_at is not None and (at := proven_at.get(step_of.get(r, ""))) is not None
                             and v.started_at > at + 1.0]
                if restarted:
                    bits.append(f"RESTARTED since proven: {', '.join(restarted)}")
            if self.plan is not None and self.plan.has_changes:
                bits.append(f"pending: {self.plan.cls}")
            if where:
                bits.append(where)
        return " · ".join(bits)


_SIGNAL_CODES = {signal.SIGINT: ExitCode.INTERRUPTED, signal.SIGTERM: ExitCode.TERMINATED,
                 signal.SIGHUP: ExitCode.HANGUP}
"""The signals that end the console, and its exit code for each (128 + the signal's number)."""


def run_console(loaded: Any, *, readonly: bool = False, refresh_s: float | None = None,
                state_dir: str | Path | None = None) -> tuple[int, bool]:
    """Run the console in this terminal until the operator quits or a signal ends it.

    Returns ``(exit code, whether an apply was running then)``: 0 quit; 130 / 143 / 129 ended by SIGINT / SIGTERM /
    SIGHUP; quit during an apply, how that apply ended (130 stopped, its error's code, 0 finished), which is said on
    stderr after the console has left the screen."""
    app = ConsoleApp(loaded, readonly=readonly, refresh_s=refresh_s, state_dir=state_dir)
    with early_signals(app):
        rc = int(app.run() or 0)
    return after_the_app(app, rc, loaded)


def after_the_app(app: ConsoleApp, rc: int, loaded: Any) -> tuple[int, bool]:
    """:func:`run_console`'s result once *app* has ended with *rc*: when it ended during an apply (quit, or a signal),
    wait for that apply to stop and say how it ended; see :func:`run_console`."""
    if not (app.applying or app.quit_during_apply):
        return rc, False
    if not app.apply_ended.is_set():
        _say("pdctl: the apply stops at its next step event or poll; waiting for it…")
    if not app.apply_ended.wait(_QUIT_WAIT_S):
        _say(f"pdctl: the apply has not stopped after {_QUIT_WAIT_S:g} s; it ends with this process: "
             "`pdctl status` shows where it got to")
        return rc, True
    said, code = quit_outcome(loaded, app.apply_outcome)
    _say(said)
    if app.signalled is None:  # a quit, not a signal: the exit code says how the apply ended
        rc = code
    return rc, True


@contextlib.contextmanager
def early_signals(app: ConsoleApp) -> Iterator[None]:
    """While *app* starts: SIGINT, SIGTERM and SIGHUP end it with 130 / 143 / 129 and the terminal restored, as once it
    has mounted (``on_mount`` hands them to the event loop). Between Textual taking the terminal (alternate screen, raw
    mode, mouse tracking) and ``on_mount``, their default action killed the process (SIGINT's raised KeyboardInterrupt
    wherever start-up was) and left the terminal in that state. The signal is kept in ``app.early_signal``, which
    ``on_mount`` acts on (ending the app earlier, while its widgets mount, makes them fail). A signal already ignored
    stays ignored (``nohup``)."""
    import signal

    def on_signal(signum, frame) -> None:  # noqa: ANN001
        if app.early_signal is None:
            app.early_signal = _SIGNAL_CODES[signal.Signals(signum)]

    previous = {s: signal.signal(s, on_signal) for s in _SIGNAL_CODES if signal.getsignal(s) != signal.SIG_IGN}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def quit_outcome(loaded: Any, outcome: Any) -> tuple[str, int]:
    """What to say, and the exit code, once an apply the console was quit during has ended with *outcome* (its result,
    or the exception that ended it): stopped (130), failed on its own (its error's code), or finished (0)."""
    from pdctl.statemachine.errors import RunCancelled

    spec = loaded.path
    if isinstance(outcome, RunCancelled | KeyboardInterrupt):
        return _where_it_stopped(loaded), ExitCode.INTERRUPTED
    if isinstance(outcome, BaseException):
        step = getattr(outcome, "step", None)
        return (f"pdctl: the apply failed{' at ' + step if step else ''} before it could be stopped: "
                f"{getattr(outcome, 'message', None) or outcome} (`pdctl status {spec}` shows what runs)",
                exit_code_for(outcome) if isinstance(outcome, Exception) else ExitCode.ERROR)
    return f"pdctl: the apply finished before it could be stopped (`pdctl status {spec}` shows what runs)", ExitCode.OK


_QUIT_WAIT_S = 120.0
"""How long a console quit mid-apply waits for the apply to stop (its next step event or poll: usually a second)."""


def _say(line: str) -> None:
    """One line on stderr after the console has left the screen (after SIGHUP the terminal is gone: EIO)."""
    import sys

    try:
        sys.stderr.write(line + "\n")
    except OSError:
        pass


def _where_it_stopped(loaded: Any) -> str:
    """What a cancelled apply left, from its journal: the step it stopped at and how to go on."""
    try:
        state = loaded.journal.read()
    except Exception as exc:  # noqa: BLE001 - the report is a courtesy; the journal's own reader names the fault
        return f"pdctl: the apply stopped; its journal cannot be read now ({exc}): `pdctl status` says more"
    step = next((name for name, rec in state.steps.items() if rec.status == "interrupted"), None)
    spec = loaded.path
    if state.target is None and step is None:  # cancelled at its plan or port checks: it journalled no target yet
        return f"pdctl: the apply stopped before it changed anything (`pdctl status {spec}` shows what runs)"
    # between two steps none is journalled as interrupted: say the last one it finished
    after = [name for name, rec in state.steps.items() if rec.status in ("done", "skipped")]
    where = f" at {step}" if step else f" after {after[-1]}" if after else ""
    return (f"pdctl: the apply stopped{where}; what it had stopped or started stays so: "
            f"`pdctl status {spec}` shows what runs, `pdctl apply {spec}` resumes")
