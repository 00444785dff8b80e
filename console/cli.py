"""The ``pdctl`` command line (typer). A thin shell over :mod:`pdctl.statemachine.service`.

stdout carries data (plans, JSON, JSON-lines events); stderr carries diagnostics for people.
Exit codes are documented in :mod:`pdctl.console.exit_codes` and in ``pdctl --help``.

``pdctl --apply SPEC`` is ``pdctl apply SPEC``; ``pdctl SPEC`` opens the console.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shlex
import signal
import stat
import sys
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from pdctl.console.exit_codes import ExitCode, exit_code_for
from pdctl.statemachine.errors import PdctlError, SpecError, findings_fields, os_error_text
from pdctl.units import unsupervised_reason
from pdctl.units.errors import UnitsError

EXIT_HELP = (
    "Exit codes: 0 ok / no changes; 1 error; 2 changes present (plan) or topology change refused or stale saved "
    "plan (apply); 3 a step failed, or apply refused before its first step (a port or GPU taken, or what the host "
    "lacks: bind address, engine.python, router executable, NUMA node, supervisor folder), or the host's connection "
    "was lost; 4 deployment locked; 5 state directory not writable; 64 usage; 130 interrupted; 129 / 143 an apply, down, plan, status, chat, logs or "
    "the console stopped by SIGHUP / SIGTERM."
)

app = typer.Typer(
    name="pdctl",
    help="Plan, deploy and prove SGLang prefill-decode (PD) disaggregated deployments.\n\n"
         "`pdctl SPEC.toml` opens the console on SPEC; `pdctl --apply SPEC` is `pdctl apply SPEC`.\n\n" + EXIT_HELP,
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

SpecArg = Annotated[Path, typer.Argument(metavar="SPEC", help="Deployment spec (TOML), e.g. examples/demo.toml")]
def _state_dir_given(value: Optional[str]) -> Optional[Path]:
    # `--state-dir ''` was Path(''), the current folder: a down wrote its audit log and lock there, and status said
    # "not deployed" (an empty PDCTL_STATE_DIR is no value at all to click, so only the option reaches this)
    if value is not None and not value.strip():
        raise typer.BadParameter(f"{value!r} names no folder; give the journal's folder, or leave the option out for "
                                 "the default (PDCTL_STATE_DIR, else per service scope)")
    return None if value is None else Path(value)


StateDirOpt = Annotated[
    Optional[str],
    typer.Option("--state-dir", envvar="PDCTL_STATE_DIR", help="Journal directory (default per service scope)",
                 callback=_state_dir_given),
]


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        sys.stdout.write(f"pdctl {version('pdctl')}\n")
        raise typer.Exit(ExitCode.OK)


@app.callback()
def _root(
    _version_flag: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print pdctl's version and exit")
    ] = False,
) -> None:
    pass


class _PipeSafe:
    """A text stream that writes nowhere, instead of raising, once its reader is gone (``pdctl apply … | head``):
    an apply or down must not stop half-way because nobody reads its progress any more. Everything else is the
    wrapped stream's."""

    def __init__(self, stream, label: str = "<stdout>") -> None:  # noqa: ANN001
        self._stream = stream
        self._label = label  # names the stream in any other OSError (ENOSPC on /dev/full), which still raises
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self._stream.write(text)
            except OSError as exc:
                self._failed(exc)
        return len(text)

    def writelines(self, lines) -> None:  # noqa: ANN001
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._stream.flush()
            except OSError as exc:
                self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        # A closed pipe (`| head`) or a terminal that went away (EIO after SIGHUP) mutes the stream: the exit code
        # still says how the command ended. Any other error (ENOSPC on /dev/full) names the stream and is raised.
        if isinstance(exc, BrokenPipeError) or exc.errno == errno.EIO:
            self._mute()
            return
        exc.filename = exc.filename or self._label
        raise exc

    def _mute(self) -> None:
        self.gone = True
        try:  # the descriptor too: the interpreter's own flush at exit then finds a reader (/dev/null)
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
        except (OSError, ValueError, AttributeError):
            pass

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._stream, name)


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _visible(text: str) -> str:
    """*text* with its control characters but newline and tab written ``\\xNN``: what a message or a report quotes —
    a spec's line, a process's command line, a role's log — must not retitle, recolour or clear the operator's
    terminal."""
    return _CONTROL.sub(lambda c: f"\\x{ord(c.group()):02x}", text)


def _err(msg: str) -> None:
    try:
        sys.stderr.write(_visible(msg.rstrip("\n")) + "\n")
    except OSError:  # stderr itself fails (a full disk): the exit code still says it
        pass


def _warnings(loaded) -> None:  # noqa: ANN001
    for w in loaded.warnings:
        _err(f"warning: {w.field}: {w.message}\n  fix: {w.fix}")


@app.command()
def validate(
    spec: SpecArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print {spec, valid, findings, warnings} as JSON")] = False,
) -> None:
    """Check SPEC against pdctl's rules. Contacts no host, changes nothing. Exit 0: valid, printing "SPEC: valid (N
    warning(s))" on stdout; 1: invalid. Warnings and errors go to stderr. With --json, stdout has one object:
    {spec, valid, findings: [{field, message, fix}] (the errors), warnings: [...], error, hint}."""
    from pdctl.statemachine.service import load

    try:
        loaded = load(spec)
    except SpecError as exc:
        if as_json:
            sys.stdout.write(json.dumps({"spec": str(spec), "valid": False, **findings_fields(exc),
                                         "warnings": exc.findings_json("warning"), "error": exc.message,
                                         "hint": exc.hint}, indent=1) + "\n")
        raise
    _warnings(loaded)
    if as_json:
        warned = [w.to_json() for w in loaded.warnings]
        sys.stdout.write(json.dumps({"spec": str(spec), "valid": True, "findings": [], "warnings": warned,
                                     "error": None, "hint": None}, indent=1) + "\n")
        return
    sys.stdout.write(f"{spec}: valid ({len(loaded.warnings)} warning(s))\n")


@app.command("capacity")
def capacity_cmd(
    spec: SpecArg,
    context: Annotated[Optional[int], typer.Option("--context", metavar="N", min=1,
                                                   help="The request length to ask about, tokens (default: the spec's "
                                                        "model.context_length, else the model's)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the estimate as JSON")] = False,
    gpu_memory: Annotated[Optional[float], typer.Option("--gpu-memory", metavar="GIB", min=1,
                                                        help="Each GPU's memory, GiB, instead of the spec's or the "
                                                             "host's")] = None,
) -> None:
    """Estimate each role's KV pool (tokens) and what it holds: GPU memory (declared gpu_name, else read on the host
    with nvidia-smi), weights per GPU, the pool at mem_fraction, requests of the context length at once, whether one
    request of --context N tokens fits, and what would make it fit. Changes nothing. Exit 0: it fits every role and
    the servers accept it; 2: it does not (or the spec's context_length refuses it); 1: no estimate (model or GPU
    memory unknown) or an error."""
    from pdctl.statemachine.capacity import capacity_of_spec, render_report

    rep = capacity_of_spec(str(spec), context=context, gpu_memory_gib=gpu_memory)
    if as_json:
        sys.stdout.write(json.dumps({"spec": str(spec), **rep.to_json()}, indent=1) + "\n")
    else:
        sys.stdout.write(_visible(render_report(rep)) + "\n")
    raise typer.Exit(ExitCode.ERROR if rep.fits is None else ExitCode.OK if rep.fits else ExitCode.CHANGES)


@app.command()
def plan(
    spec: SpecArg,
    state_dir: StateDirOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON")] = False,
    # (a string, not a Path: Path("") is ".", and `-o ''` was then reported as `-o .`, a folder)
    out: Annotated[Optional[str], typer.Option("-o", "--out", metavar="FILE",
                                               help="Save the plan to FILE (JSON); - prints it on stdout")] = None,
    restart: Annotated[Optional[list[str]], typer.Option(
        "--restart", metavar="ROLE", show_default=False,
        help="Plan a restart of this role although nothing of it changed, as `pdctl apply --restart` would (a plan "
             "saved with it restarts it when applied)")] = None,
    target: Annotated[_Target, typer.Option("--target", help="k8s: plan from the Kubernetes export in --from DIR to "
                                                             "this spec's export")] = None,  # type: ignore[assignment]
    from_dir: Annotated[Optional[Path], typer.Option("--from", metavar="DIR",
                                                     help="--target k8s: the folder of the earlier export")] = None,
    fmt: Annotated[Optional[_Format], typer.Option("--format", help="--target k8s: the new export's format "
                                                                    "(default: the earlier one's)")] = None,
    image: Annotated[Optional[str], typer.Option("--image", metavar="IMAGE",
                                                 help="--target k8s: the new export's image (default: the earlier "
                                                      "one's)")] = None,
    router_image: Annotated[Optional[str], typer.Option("--router-image", metavar="IMAGE",
                                                        help="--target k8s: the router's image")] = None,
) -> None:
    """Show what applying SPEC would change. Exit 0: nothing to do (what was deployed matches SPEC and runs); 2:
    changes, or none to the recorded deployment while an earlier apply did not finish or a unit of it is not running,
    unsupervised or answered for by another process (`pdctl apply` has work either way: said on stdout); 1: error. A
    running server that only fails its health probe (busy?) is a note on stderr, not exit 2. A port the deployment
    will listen on that a process outside it holds, or a GPU a role will run on that a compute process outside it uses
    (nvidia-smi), is a warning after the plan (`ports_held`, `gpus_held` in --json), which apply refuses (exit 3): it
    does not change plan's exit code. 130 / 143 / 129: interrupted (Ctrl-C / SIGTERM / SIGHUP),
    ending any command it had started here (nvidia-smi discovering GPUs). With --target k8s --from DIR: the change
    from the export in DIR to this spec's, in the same classes and words (exit 0: none, 2: changes)."""
    if target == _Target.hosts and from_dir is not None:
        raise typer.BadParameter("plans from a Kubernetes export: give --target k8s (or leave --target out)",
                                 param_hint="--from")
    if target == _Target.k8s or from_dir is not None:
        _plan_k8s(spec, from_dir, fmt, image, router_image, as_json,
                  hosts_only=[o for o, v in (("-o", out), ("--restart", restart), ("--state-dir", state_dir)) if v])
        return
    # (SIGTERM would end pdctl at once, leaving the commands it runs in their sessions)
    with _interruptible("plan"), contextlib.ExitStack() as opened:
        _plan(spec, state_dir, as_json, out, tuple(dict.fromkeys(restart or ())), opened)


def _plan(spec: Path, state_dir: Path | None, as_json: bool, given: str | None, restart: tuple[str, ...] = (),
          _opened: contextlib.ExitStack | None = None) -> None:
    from pdctl.statemachine.plan import render_text
    from pdctl.statemachine.service import load, plan_spec, plan_unsettled

    to_stdout = given == "-"  # the usual spelling of stdout
    if to_stdout:
        given, as_json = None, True
    out = None if given is None else Path(given)
    shown = None if given is None else shlex.quote(given)  # the path as given, as a shell would take it back
    discard = out is not None and given != "" and _is_null_device(out)  # -o /dev/null: shown, and saved nowhere
    try:
        if given == "":  # (refused before anything is read or written: Path("") would be the current folder)
            raise PdctlError("-o '': an empty path names no file to save the plan to; nothing on any host changed",
                             hint=f"give -o/--out {_PLAN_OUT_EXAMPLE}")
        refused = None if out is None or discard else _out_not_a_file(out)
        if refused is not None:  # (refused before anything is read or written)
            raise _out_unwritable(out, refused, "the plan", _PLAN_OUT_EXAMPLE, shown=shown,
                                  hint=_DESCRIPTOR_OUT_HINT if _a_descriptor_link(out) else None)
        if out is not None and not out.parent.is_dir():  # (refused before anything is read or written, never created)
            # the path cannot be written, as one the OS refuses (_out_unwritable): exit 1 with the same error and hint,
            # and with --json the same {error, hint} object, not a usage error
            why = (f"{out.parent} is not a folder" if os.path.lexists(out.parent)  # (a file: -o FILE/sub)
                   else f"folder {out.parent} does not exist")
            raise PdctlError(f"-o {shown}: cannot write the plan there: {why}; nothing on any host changed",
                             hint="give -o/--out a file path in an existing folder: e.g. -o plan.json (or -o - for "
                                  "stdout)")
        loaded = load(spec, state_dir=state_dir, discover=True)
        _refuse_unknown_restarts(loaded, list(restart))
        if out is not None and not discard:  # (refused before anything is written)
            _refuse_own_file(out, shown, spec, loaded.journal)
        _warnings(loaded)
        _unset_secrets_note(loaded.deployment)
        recorded = loaded.journal.read()
        pending = recorded.target
        from pdctl.statemachine.service import deployment_host

        # (one connection for every question the plan asks the host: it logged in three times over SSH)
        host = deployment_host(loaded.deployment)
        if _opened is not None:
            _opened.enter_context(contextlib.closing(host))
        if recorded.machine and (recorded.deployed or pending):  # apply would refuse: the host reaches another machine
            from pdctl.statemachine.service import machine_of, refuse_another_machine

            refuse_another_machine(loaded, recorded, machine_of(host), "applying")
        try:
            p = plan_spec(loaded, recorded, restart=restart, host=host)  # (asks what runs while an apply is unfinished)
            why = plan_unsettled(loaded, recorded, p, host=host)
        except (PdctlError, UnitsError):
            # a host or service manager that cannot be asked is an error, not "all serve": exit 0 would tell a script
            # that gates apply on plan that nothing needs doing (HostError, ManagerUnavailable…)
            _err("note: the plan cannot tell whether what was deployed still runs, for the error that follows")
            raise
        for note in why.notes:
            _err(f"note: {note}")
        unsettled = why.text
        if unsettled:
            p = p.model_copy(update={"unsettled": unsettled})
        p = p.model_copy(update=_host_warnings(loaded, recorded, host))
        # (apply PLANFILE re-reads the spec it names: what --json prints is a plan file too, as -o - prints it)
        p = p.model_copy(update={"spec_path": str(spec.resolve()),
                                 "warnings": tuple(w.to_json() for w in loaded.warnings)})
        if discard:
            _err(f"plan not saved: -o {shown} discards it")
        elif out is not None:
            from pdctl.statemachine.journal import atomic_write

            try:
                atomic_write(out, p.to_json().encode())
            except OSError as exc:
                raise _out_unwritable(out, exc, "the plan", _PLAN_OUT_EXAMPLE, shown=shown) from exc
            _err(f"plan saved to {out}")
        if as_json:
            sys.stdout.write(p.to_json() + "\n")
        else:
            sys.stdout.write(_visible(render_text(p)) + "\n")
        raise typer.Exit(ExitCode.CHANGES if p.has_changes or unsettled else ExitCode.OK)
    except (PdctlError, UnitsError, OSError) as exc:
        if as_json:  # scripts still get an object, as from status --json, whatever refused the plan
            sys.stdout.write(json.dumps(_json_error(exc), indent=1) + "\n")
        raise


def _host_warnings(loaded, recorded, host=None):  # noqa: ANN001, ANN202
    """The plan's warnings as its fields (``ports_held``, ``gpus_held``, ``binds_unusable``): the ports and GPUs apply
    would refuse (used outside the deployment) and why it would refuse the bind addresses; none, with a note, when the
    host or its service manager cannot be asked (:func:`~pdctl.statemachine.service.plan_host_checks`, as the
    console's plan tab). They never change plan's exit code: apply refuses them itself (exit 3), nothing changed, so
    a script that applies on exit 2 stays safe."""
    from pdctl.statemachine.service import plan_host_checks

    fields, why = plan_host_checks(loaded, recorded, host=host)
    if why:
        _err(f"note: {why}")
    return fields


def _unset_secrets_note(dep) -> None:  # noqa: ANN001
    """A ``[secrets]`` entry ``env:NAME`` whose variable pdctl's environment lacks, or any secret whose value is empty
    (a CI system's missing secret): the plan shows the roles' secrets as changed; say why (that apply refuses it is a
    warning after the plan, ``Plan.secrets_refused``)."""
    from pdctl.statemachine.spec import secret_value

    for key, value in sorted(dep.secret_refs().items()):
        got = secret_value(value, os.environ)
        if got is None:
            _err(f"note: secrets.{key} = {value!r}: {value[4:]} is not set here, so the plan cannot compare the secret "
                 "with the deployed one and shows it as changed")
        elif not got:
            _err(f"note: secrets.{key} = {value!r} is empty here, so the plan shows it as changed")


class _Reporter:
    """Headless progress: one line per event on stderr, or one JSON object per line on stdout."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.failure_shown = False
        """A failure's message is on the terminal already: the command's end need not repeat it."""
        self.hint_shown = False
        self.step_started = False
        self.ended = False
        """An event that ends a run (apply_done, apply_failed, apply_interrupted) was emitted."""
        self.engine_spoke = False
        """The engine emitted an event (its plan, a step…): from then on it reports an interruption itself."""
        self.started = False
        """The apply began (``apply_started``): a failure from then on may have changed the deployment."""

    def emit(self, event) -> None:  # noqa: ANN001
        global _work_done
        # (from its apply_done on, an apply's work is journalled done: a Ctrl-C then must not turn it into 130)
        _work_done = _work_done or event.kind == "apply_done"
        self.engine_spoke = True
        self.started = self.started or event.kind == "apply_started"
        self.ended = self.ended or event.kind in ("apply_done", "apply_failed", "apply_interrupted")
        if event.kind == "apply_interrupted":
            from pdctl.statemachine.events import APPLY_NOT_STARTED

            global _interrupted_step, _interrupted_hint
            _interrupted_step = event.step
            if event.message == APPLY_NOT_STARTED:  # (the engine's, after its plan: a first deployment not begun)
                _interrupted_hint = _APPLY_NOT_STARTED
            elif event.data.get("stopped"):  # a unit it was restarting is down: not "what already runs stays as it is"
                _interrupted_hint = event.message
        if self.as_json:
            sys.stdout.write(json.dumps(event.to_json(), default=str) + "\n")
            sys.stdout.flush()
            return
        if event.kind == "step_started":
            self.step_started = True
            return
        if event.kind == "apply_interrupted":
            return  # main() ends an interrupted command with the same advice (and its step)
        if event.kind == "apply_failed" and self.failure_shown:
            return  # the failed step's line said it
        # (a role still loading says its elapsed time in its words: "prefill loading: 6 s of an expected …")
        el = f" [{event.elapsed_s:.1f}s]" if event.elapsed_s is not None and event.kind != "progress" else ""
        mark = {"step_verified": "✓", "step_skipped": "=", "step_failed": "✗", "apply_done": "●", "apply_failed": "✗",
                "progress": "…"}.get(event.kind, "·")
        _err(f"{mark} {event.message}{el}")
        if event.kind == "step_failed" and event.data.get("hint"):
            _err(f"  hint: {event.data['hint']}")
            self.hint_shown = True
        if event.kind in ("step_failed", "apply_failed"):
            self.failure_shown = True


_interrupted_step: str | None = None
_apply_entered = False  # apply's body began: from there on it says itself how an interruption ended it
_interrupted_hint: str | None = None  # a command's own words for an interruption (down's), instead of _INTERRUPTED
_interrupted_apply: str | None = None  # _INTERRUPTED naming the apply's spec, once apply_cmd knows it
"""The step an apply was interrupted in (its ``apply_interrupted`` event), for main()'s last line."""

_work_done = False
"""The command's work is done and journalled (apply: ``apply_done`` emitted; down: the engine's down returned): a signal
from then on is ignored, so that a finished apply or down exits 0 (a Ctrl-C just after it read 130, "interrupted", with
nothing interrupted)."""

_signalled = False
"""Ctrl-C, SIGTERM or SIGHUP stopped the command (``_signals_as_interrupt``, however deeply nested): from then on they
are ignored, so that a second one does not cut off the line that says where it stopped."""

_terminated: int | None = None
"""The signal that stopped the command, SIGTERM or SIGHUP (``_signals_as_interrupt``): main() then exits 143 or 129,
not 130."""


def _json_refusal(rep: _Reporter, exc: BaseException) -> None:
    # A --json stream that ends without a terminal event gets one: apply_failed naming the error (and, for an OSError,
    # the hint the text output gives).
    if rep.as_json and not rep.ended:
        from pdctl.statemachine.events import Event

        ev = Event.apply_failed(exc, started=rep.started)
        if isinstance(exc, OSError) and not isinstance(exc, PdctlError) and not ev.data.get("hint"):
            ev = Event(ev.kind, ev.message, step=ev.step, data={**ev.data, "hint": os_error_hint(exc)})
        rep.emit(ev)


@contextlib.contextmanager
def _signals_as_interrupt() -> Iterator[None]:
    # SIGTERM (`timeout`, CI runners, process managers) and SIGHUP (the SSH session of a remote admin dropped) stop a
    # headless apply or down the way Ctrl-C does: the engine journals where it stopped (and ends a --json stream with
    # apply_interrupted) instead of dying mid-write. Once a signal has come, repeats are ignored while that is
    # reported; the previous handlers come back after. A signal already ignored stays ignored: `nohup pdctl apply &`
    # (SIGHUP) or a background job of a script (SIGINT) asked to run on whatever the terminal does.
    stops = tuple(s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) != signal.SIG_IGN)

    def on_signal(signum, frame) -> None:  # noqa: ANN001
        global _terminated, _signalled
        if _work_done:
            return
        _signalled = True
        if _terminated is None and signum != signal.SIGINT:
            _terminated = signum
        for s in stops:
            signal.signal(s, signal.SIG_IGN)
        hosts = sys.modules.get("pdctl.statemachine.hosts")  # (not imported yet: no host command is starting)
        if hosts is not None and hosts.defer_interrupt():  # (mid-fork: LocalHost.run raises it, the child's PID known)
            return
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in stops}
    try:
        yield
    finally:
        # finished, or interrupted: only its last line is left, which a second Ctrl-C must not cut off (main() puts
        # an in-process caller's handlers back at its end)
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_IGN if _work_done or _signalled else handler)


@contextlib.contextmanager
def _interruptible(command: str) -> Iterator[None]:
    # A command that changes nothing (plan, status, chat), stopped by Ctrl-C, SIGTERM or SIGHUP: main() ends it with
    # exit 130 / 143 / 129 and its own one line (_SAID_WHEN_INTERRUPTED), no traceback, and LocalHost.run ends the
    # command it was waiting on (nvidia-smi, systemctl: their own sessions, which no terminal signal reaches)
    global _interrupted_hint
    _interrupted_hint = _SAID_WHEN_INTERRUPTED[command]
    with _signals_as_interrupt():
        yield


@contextlib.contextmanager
def _interrupt_before_the_plan_reported(rep: _Reporter) -> Iterator[None]:
    # The engine ends a run it interrupts with apply_interrupted, from its plan on. Ctrl-C (SIGTERM, SIGHUP) before
    # that, while the engine's modules load, the spec is read, its hosts discovered (over SSH, seconds) or the plan
    # made, changed nothing: say so, and end a --json stream the same way, with the plan id null. (Earlier still,
    # while Python starts and imports this module, Python's default handler ends the process with a KeyboardInterrupt
    # traceback and no event; reporting that would need an entry point that parses the command line before typer is
    # loaded.)
    try:
        yield
    except KeyboardInterrupt:
        if not rep.engine_spoke:
            global _interrupted_hint
            _interrupted_hint = _APPLY_NOT_STARTED
            if rep.as_json:
                rep.emit(_apply_not_started_event())
        raise


@app.command("apply")
def apply_cmd(
    spec: Annotated[Path, typer.Argument(metavar="SPEC", help="Spec (TOML) or a plan saved with `pdctl plan -o`")],
    state_dir: StateDirOpt = None,
    confirm_topology: Annotated[
        Optional[str], typer.Option("--confirm-topology", metavar="PLAN_ID", help="Confirm a topology change: the exact plan id")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON event per line on stdout")] = False,
    restart: Annotated[Optional[list[str]], typer.Option(
        "--restart", metavar="ROLE", show_default=False,
        help="Restart this role (prefill, decode, router, as status names them) although nothing of it changed, and "
             "prove it again (new weights at the same path, an engine upgraded in place); repeat for more")] = None,
) -> None:
    """Plan, then bring the deployment to parsers_configured, proving every step (also `pdctl --apply SPEC`).

    A topology change is refused (exit 2, plan printed) unless --confirm-topology names this exact plan. A saved plan applies only while the deployment still matches its "from" side.

    Exit 0: parsers_configured reached and proven; 2: topology change refused or saved plan stale; 3: a step failed, or a check refused the apply before its first step (a port or GPU taken, or a bind address, engine.python, router executable, NUMA node, service_user or supervisor folder unusable on the host; named on stderr); 4: locked by another apply or down; 5: the state directory cannot be written (full, read-only, over quota, or less free space than PDCTL_STATE_MIN_FREE_MIB, 8 by default, before it starts; named with the fix, and what runs if it filled mid-way); 1: any other error; 64: bad command line; 130 / 143 / 129: interrupted (Ctrl-C / SIGTERM / SIGHUP), what runs stays as it is.
    """
    global _apply_entered
    _apply_entered = True
    rep = _Reporter(as_json)
    saved = None
    # (the handlers first: a signal while the engine still loads, or while the spec is read and its hosts discovered,
    # ends a --json stream with an event as well)
    with _signals_as_interrupt(), _interrupt_before_the_plan_reported(rep):
        from pdctl.statemachine.plan import render_text
        from pdctl.statemachine.service import apply, load, load_saved_plan

        try:
            plan_file = None
            if _is_saved_plan(spec):
                saved = load_saved_plan(spec)
                plan_file, spec = spec, Path(saved.spec_path)
            if plan_file is not None and not spec.is_file():  # a saved plan is applied from its spec, re-read
                raise PdctlError(f"{plan_file}: the spec this plan was made from, {spec}, is not there any more "
                                 "(a saved plan names its spec and apply reads it again, checking that it still "
                                 "makes the plan's topology)",
                                 hint=f"put the spec back at {spec}, or make the plan again where the spec is "
                                      "(`pdctl plan SPEC -o FILE`)")
            if restart and plan_file is not None:
                raise typer.BadParameter(f"{plan_file} is a saved plan, which applies what it holds: give the spec "
                                         f"with --restart (`pdctl apply {shlex.quote(str(spec))} --restart ROLE`)",
                                         param_hint="--restart")
            global _interrupted_apply
            _interrupted_apply = _interrupted_apply_words(spec, state_dir)
            loaded = load(spec, state_dir=state_dir, discover=True)
            _refuse_unknown_restarts(loaded, restart)
        except (PdctlError, UnitsError, OSError) as e:  # refused before planning
            _json_refusal(rep, e)
            raise
        _warnings(loaded)
        try:
            result = apply(loaded, confirm=confirm_topology, saved_plan=saved, sink=rep,
                           restart=tuple(dict.fromkeys(restart or ())))
        except (UnitsError, OSError) as e:
            _json_refusal(rep, e)
            raise
        except PdctlError as e:
            _json_refusal(rep, e)  # (lock held, topology not confirmed, stale plan: the engine emitted nothing)
            from pdctl.statemachine.errors import StepError, TopologyNotConfirmed

            if isinstance(e, TopologyNotConfirmed) and not as_json:
                from pdctl.statemachine.service import plan_spec

                sys.stdout.write(_visible(render_text(saved or plan_spec(loaded))) + "\n")
            if isinstance(e, StepError) and rep.failure_shown:
                # said once, on the failed step's line; end with where it stopped instead of repeating it
                if e.hint and not rep.hint_shown:
                    _err(f"  hint: {e.hint}")
                if rep.step_started:
                    _err(f"apply stopped at {e.step}: `pdctl status` shows what runs now; apply again after the fix")
                else:
                    _err("apply refused before its first step; apply again after the fix")
                raise typer.Exit(exit_code_for(e)) from None
            raise
    if not as_json:
        _err(f"deployment {loaded.deployment.name!r}: {result.state} (plan {result.plan.plan_id})")


def _refuse_unknown_restarts(loaded, restart: "list[str] | None") -> None:  # noqa: ANN001
    """A usage error (64) for a ``--restart`` name the spec's deployment lacks, naming the ones it has."""
    if not restart:
        return
    from pdctl.statemachine.plan import not_restartable
    from pdctl.statemachine.topology import topology_of

    topo = topology_of(loaded.deployment)
    if unknown := not_restartable(topo, restart or ()):
        names = [r.name for r in topo.roles] + (["router"] if topo.router is not None else [])
        raise typer.BadParameter(f"{', '.join(map(repr, unknown))}: the spec ({loaded.path}) has no such role; its "
                                 f"roles are {', '.join(names)}", param_hint="--restart")


def _broken_rules_note(loaded, what: str) -> None:  # noqa: ANN001
    # down and status load the spec without refusing its broken rules (loaded.warnings holds them): say so once
    broken = [f for f in loaded.warnings if f.level == "error"]
    if broken:
        _err(f"note: the spec breaks {len(broken)} rule(s) (`pdctl validate {loaded.path}` lists them: "
             f"{', '.join(f.field for f in broken[:3])}{', …' if len(broken) > 3 else ''}); {what}")


def _is_saved_plan(path: Path) -> bool:
    """A plan saved with ``plan -o`` (JSON, whatever its file name: ``-o /tmp/c.plan``), not a TOML spec: the first
    character that is not white space is ``{``, which no TOML document starts with."""
    if path.suffix == ".json":
        return True
    try:
        with path.open("rb") as f:
            return f.read(4096).lstrip().startswith(b"{")
    except OSError:  # load() names the path and why
        return False


@app.command("status")
def status_cmd(
    spec: SpecArg,
    state_dir: StateDirOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print status as JSON")] = False,
    canary: Annotated[Optional[bool], typer.Option("--canary/--no-canary",
                                                   help="Send one canary request through the router (default: the "
                                                        "spec's console.canary)")] = None,
    watch: Annotated[bool, typer.Option("--watch", help="Redraw the status in place until Ctrl-C")] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.2, help="Seconds between --watch redraws")] = 2.0,
) -> None:
    """Each role's unit state, health and last proof (and its age); the router's view and what its clients get.
    Exit 0 when everything is healthy, 1 otherwise; 130 / 143 / 129: interrupted (Ctrl-C / SIGTERM / SIGHUP), ending
    any command it had started here (systemctl)."""
    with _interruptible("status"):  # (SIGTERM would end pdctl at once, leaving a hung systemctl in its session)
        if watch:
            _watch(spec, state_dir, canary, interval)
        _status(spec, state_dir, as_json, canary)


def _watch(spec: Path, state_dir: Path | None, canary: bool | None, interval: float) -> None:
    """``status --watch``: the status text redrawn in place (rich's Live) every *interval* seconds until Ctrl-C."""
    import time as _time

    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    from pdctl.statemachine.service import load, status

    loaded = load(spec, state_dir=state_dir, rules=False, discover="try")
    with Live(console=Console(stderr=False), auto_refresh=False, transient=False) as live:
        while True:
            t0 = _time.monotonic()
            try:
                text = _visible(_status_text(status(loaded, canary=canary)))
            except (PdctlError, OSError) as exc:
                text = f"status failed: {exc}"
            stamp = _time.strftime("%H:%M:%S")
            live.update(Text(f"{text}\n  ({stamp}; every {interval:g} s; Ctrl-C ends)"), refresh=True)
            _time.sleep(max(0.0, interval - (_time.monotonic() - t0)))


def _status(spec: Path, state_dir: Path | None, as_json: bool, canary: bool | None = None) -> None:
    from pdctl.statemachine.service import load, status

    try:
        loaded = load(spec, state_dir=state_dir, rules=False, discover="try")
    except (PdctlError, OSError) as exc:  # a spec that does not parse or validate: no deployment name to report
        if as_json:  # scripts still get an object, as from plan --json (they got nothing on stdout)
            sys.stdout.write(json.dumps({"deployment": None, "healthy": False, **_json_error(exc)}, indent=1) + "\n")
        raise
    _broken_rules_note(loaded, "status reads what the journal records")
    try:
        st = status(loaded, canary=canary)
    except (PdctlError, OSError) as exc:  # (an OSError: a state directory the OS refuses, e.g. a file in its path)
        if as_json:  # scripts still get an object: what failed and the fix
            sys.stdout.write(json.dumps({"deployment": loaded.deployment.name, "healthy": False, **_json_error(exc)},
                                        indent=1) + "\n")
        raise
    if not st.get("matches_spec", True):  # (an unset env: secret alone makes it differ: say so, as plan does)
        _unset_secrets_note(loaded.deployment)
    if as_json:
        sys.stdout.write(json.dumps(st, indent=1, default=str) + "\n")
    else:
        sys.stdout.write(_visible(_status_text(st)) + "\n")
    raise typer.Exit(ExitCode.OK if st["healthy"] else ExitCode.ERROR)


FOLLOW_POLL_S = 1.0
"""How often ``pdctl logs --follow`` reads each log's end again, in seconds."""
FOLLOW_WINDOW = 500
"""Lines read from each log's end per ``--follow`` poll: more new lines than this between two polls are shown with a
note that some were skipped."""


@app.command("logs")
def logs_cmd(
    spec: SpecArg,
    roles: Annotated[Optional[list[str]], typer.Argument(
        metavar="ROLE", show_default=False,
        help="The roles to show, by name (prefill, decode, router, as status names them); default: every role")] = None,
    state_dir: StateDirOpt = None,
    lines: Annotated[int, typer.Option("--lines", "-n", min=1, max=100000, help="Lines from the end of each log")] = 50,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines as they come")] = False,
) -> None:
    """The last lines each role's server (and the router) wrote, stdout and stderr: under systemd from its journal,
    under the process supervisor from its log file, on the deployment's host (over SSH for a remote one).

    With several roles each line starts with its role's name. --follow prints new lines every second until Ctrl-C,
    or until the deployment is taken down (exit 0). Exit 0: read; 1: none of the roles' units is installed here and
    none left lines, or an error (a host that cannot be reached); 64: a role the deployment lacks; 130 / 143 / 129:
    interrupted (Ctrl-C / SIGTERM / SIGHUP)."""
    with _interruptible("logs"):
        _logs(spec, list(dict.fromkeys(roles or [])), state_dir, lines, follow)


def _logs(spec: Path, roles: list[str], state_dir: Path | None, n: int, follow: bool) -> None:
    import time

    from pdctl.statemachine.service import RoleLogs, load

    loaded = load(spec, state_dir=state_dir, rules=False)
    with RoleLogs(loaded) as logs:
        unknown = [r for r in roles if r not in logs.units]
        if unknown:
            raise typer.BadParameter(
                f"{', '.join(map(repr, unknown))}: deployment {loaded.deployment.name!r} has no such role; its roles "
                f"are {', '.join(logs.units)}", param_hint="ROLE")
        chosen = roles or list(logs.units)
        if not logs.deployed:
            _err(f"note: deployment {loaded.deployment.name!r} is not deployed (nothing recorded in "
                 f"{loaded.journal.dir}): showing what its units logged, if anything")
        width = max(map(len, chosen))

        def show(role: str, got: "tuple[str, ...] | list[str]") -> None:
            lead = f"{role:<{width}} | " if len(chosen) > 1 else ""
            sys.stdout.write("".join(f"{lead}{_visible(line)}\n" for line in got))

        window = max(n, FOLLOW_WINDOW)
        seen, marks = {}, {}
        for role in chosen:
            if follow:  # (read by offset from here on: every line once, however alike)
                got, marks[role], _ = logs.follow(role, None, window)
            else:
                got = logs.lines(role, n)
            seen[role] = got[-n:]
            show(role, seen[role])
            installed = logs.installed(role)
            if not seen[role]:
                _err(f"{role}: no log lines ({logs.units[role]} "
                     f"{'has written none' if installed else 'is not installed here'})")
            elif not installed:  # (the process supervisor keeps a removed unit's log, as the journal does)
                _err(f"{role}: {logs.units[role]} is not installed here: the lines above are its log as it was removed")
        sys.stdout.flush()
        if not any(seen.values()) and not any(logs.installed(r) for r in chosen):
            raise typer.Exit(ExitCode.ERROR)  # (nothing of it here to show or to follow: said per role above)
        if not follow:
            return
        gone = 0  # polls in a row that found none of the units installed: taken down
        while not getattr(sys.stdout, "gone", False):  # (a reader that went away, `| head`: nothing to follow for)
            installed = any(logs.installed(r) for r in chosen)
            gone = 0 if installed else gone + 1
            if gone >= 2:
                _err(f"{', '.join(logs.units[r] for r in chosen)}: not installed here (any more): nothing to follow")
                return
            time.sleep(FOLLOW_POLL_S)
            for role in chosen:
                fresh, marks[role], missed = logs.follow(role, marks[role], window)
                if missed:
                    _err(f"{role}: more than {window} lines came in a second, or its log was emptied or rotated: "
                         "lines may be missing before these")
                show(role, fresh)
            sys.stdout.flush()


@app.command("support-bundle")
def support_bundle_cmd(
    spec: SpecArg,
    out: Annotated[Optional[Path], typer.Option(
        "-o", "--out", metavar="FILE.tar.gz", show_default=False,
        help="Where to write the bundle (default: pdctl-support-NAME-TIME.tar.gz here)")] = None,
    state_dir: StateDirOpt = None,
    lines: Annotated[int, typer.Option("--lines", "-n", min=1, max=100000, help="Lines from the end of each log")] = 200,
    timeout: Annotated[float, typer.Option("--timeout", min=0.5, max=600,
                                           help="Seconds each HTTP read or host command may take")] = 10.0,
) -> None:
    """Write what an operator attaches to a bug report, as one .tar.gz: the spec, the plan (text and JSON), the
    journal and audit log, `status --json`, each role's and the router's last log lines, each server's /server_info,
    the router's /workers and /metrics, the unit files, `nvidia-smi -q`, the kernels' manifest and the versions of
    pdctl, SGLang, smg and NIXL on the host. Its MANIFEST says what each file is and what could not be read (never
    fatal). Secret values (the spec's [secrets], env values whose name says secret, the installed secrets files) are
    replaced by ***REDACTED*** everywhere in it. Reads only. Exit 0: written (the path on stdout; parts that failed
    are listed on stderr); 1: the spec does not parse, or FILE cannot be written; 130 / 143 / 129: interrupted."""
    with _interruptible("support-bundle"):
        _support_bundle(spec, out, state_dir, lines, timeout)


def _support_bundle(spec: Path, out: Path | None, state_dir: Path | None, lines: int, timeout: float) -> None:
    import time

    from pdctl.statemachine.bundle import write_bundle
    from pdctl.statemachine.service import load

    loaded = load(spec, state_dir=state_dir, rules=False, discover="try")
    if out is None:
        out = Path(f"pdctl-support-{loaded.deployment.name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.tar.gz")
    if out.is_dir():
        raise PdctlError(f"-o {out}: a folder, not a file; nothing was written",
                         hint=f"give -o a file path, e.g. -o {out / 'bundle.tar.gz'}")
    if not out.parent.is_dir():
        raise PdctlError(f"-o {out}: folder {out.parent} does not exist; nothing was written",
                         hint="give -o a file path in an existing folder, e.g. -o bundle.tar.gz")
    members = write_bundle(loaded, out, lines=lines, timeout_s=timeout)
    for m in members:
        if m.status == "error":
            _err(f"note: {m.name}: {m.error}")
    failed = sum(m.status == "error" for m in members)
    absent = sum(m.status == "absent" for m in members)
    _err(f"support bundle of {loaded.deployment.name!r} written: {len(members)} files, {absent} absent, {failed} "
         "could not be read (its MANIFEST says what each is); secret values redacted")
    sys.stdout.write(f"{out}\n")


_DOWN_UNFINISHED = {"down-interrupted": "a `pdctl down` was interrupted",
                    "down-started": "a `pdctl down` was killed before it finished"}


def _applying_text(st: dict) -> str:
    # The lock first: a running apply keeps the previous run's failed steps in the journal until it starts its own.
    holder = st.get("locked_by")
    if holder:
        return (f" [{holder.get('purpose', 'apply')} in progress: PID {holder.get('pid', '?')} "
                f"({holder.get('user', '?')}@{holder.get('host', '?')}) since {holder.get('since', '?')}]")
    down = st.get("unfinished_down")
    if down and down["event"] == "down-failed":  # (refused before stopping anything, perhaps: its error says)
        # (its first line: the error's hint, or a multi-line spec error, would break the header line)
        error = (down.get("error") or "").strip().splitlines()
        said = error[0] + (" …" if len(error) > 1 else "") if error else "see the audit log"
        return f" [the last `pdctl down` failed at {down.get('ts') or '?'}: {said}]"
    if down:
        return (f" [{_DOWN_UNFINISHED.get(down['event'], 'a `pdctl down` did not finish')} at {down.get('ts') or '?'}: "
                "what it stopped stays stopped; `pdctl down` again finishes it, `pdctl apply` brings the deployment "
                "back]")
    if not st["applying"]:
        return ""
    failed = next((name for name, v in st.get("steps", {}).items() if v.get("status") == "failed"), None)
    if failed:
        return f" [the last apply failed at {failed}: apply again after the fix]"
    return " [an apply was interrupted: apply again to converge, or `pdctl down` to stop it]"


def _state_word(unit: dict) -> str:
    """A unit's state as :func:`~pdctl.console.views.state_word` words it (why it failed; a wait to restart)."""
    from pdctl.console.views import state_word

    return state_word(unit["state"], unit.get("sub_state"))


_START_LIMIT = ("  [failed again and again until its start limit stopped the restarts: its log says why "
                "(`pdctl logs SPEC {name}`, or the console's log panel); `pdctl apply` starts it after the fix]")


def _main_stopped(unit: dict) -> str:
    """The note on a unit whose main process is stopped (``main_stopped``: kill -STOP, a debugger), or ``""``."""
    if not unit.get("main_stopped"):
        return ""
    return (f"  [its main process is stopped (kill -STOP? a debugger?): it answers nothing and no supervisor restarts "
            f"it; `kill -CONT {unit['main_pid']}` resumes it, or `pdctl apply` restarts it]")


def _unsupervised(unit: dict) -> str:
    """The note on a unit that runs without a working supervisor (``supervised`` false), or ``""``."""
    if unit.get("supervised", True):
        return ""
    return (f"  [UNSUPERVISED: its supervisor is {unsupervised_reason(unit.get('sub_state'))}, a crash would not be "
            "restarted; `pdctl apply` restarts it]")

_WATCHDOG_GONE = ("  [its supervisor (pdctl's watchdog process) and its server are both gone, killed or crashed: nothing "
                  "runs or restarts it; its log may say why (`pdctl logs SPEC {name}`); `pdctl apply` starts it again]")


def _log_tail_lines(unit: dict, nw: int) -> list[str]:
    """The last lines of a failed or restarting unit's log (``log_tail``), under its line as ``systemctl status``
    quotes them, each cut to 200 characters."""
    return [f"  {'':<{nw}} │ {line[:200]}" + ("…" if len(line) > 200 else "") for line in unit.get("log_tail") or ()]


def _router_workers_text(rt: dict, mode: str = "pd") -> str:
    """The workers the router registered, by kind (prefill and decode for a PD deployment, even when none is
    registered; regular for a single server), and how many of them it holds unhealthy (smg's ``/workers``
    ``is_healthy``): ``prefill 1, decode 1 (1 unhealthy)``. Registered is not serving: a decode that went down stays
    registered. Without ``/workers`` (router down), smg's counts or ``?``."""
    workers = rt.get("workers")
    if workers is None:
        stats = rt.get("stats") or {}
        return f"prefill {stats.get('prefill_count', '?')}, decode {stats.get('decode_count', '?')}"
    kinds = ["prefill", "decode"] if mode == "pd" else ["regular"]
    kinds += sorted({str(w.get("worker_type")) for w in workers} - set(kinds))
    words = []
    for kind in kinds:
        mine = [w for w in workers if w.get("worker_type") == kind]
        sick = sum(not w.get("is_healthy") for w in mine)
        words.append(f"{kind} {len(mine)}" + (f" ({sick} unhealthy)" if sick else ""))
    return ", ".join(words)


def _status_text(st: dict) -> str:
    nothing = not st.get("deployed", True) and not st.get("applying")
    unrecorded = nothing and (any(r["state"] != "inactive" for r in st["roles"]) or bool(st.get("leftover"))
                              or (st.get("router") or {}).get("state", "inactive") != "inactive")
    # (an apply toward another mode, running or unfinished: the roles below are its; the recorded mode goes first, as
    # the plan of the recorded spec starts from it)
    was = st.get("recorded_mode")
    mode = f"{was} → {st['mode']}" if st.get("applying") and was and was != st["mode"] else st["mode"]
    lines = [f"deployment {st['deployment']} ({mode}): "
             + ("not deployed, yet units of it run (no journal here records them: applying takes them over, a "
                "topology change to confirm that `pdctl plan` shows)" if unrecorded else
                "not deployed (`pdctl plan` shows what apply would start)" if nothing
                else "healthy" if st["healthy"] else "NOT healthy")
             + ("" if nothing or st.get("matches_spec", True) else " [differs from this spec: see `pdctl plan`]")
             + (f", reached {st['reached']}" if st["reached"] else "") + _applying_text(st)]
    rt = st.get("router")
    own = {u["unit"] for u in st.get("leftover") or ()}  # (this deployment's, of its recorded topology: not another's)
    # (columns as wide as their longest word: "deactivating", "failed (watchdog-gone)", a step "interrupted")
    sw = max([11, *(len(_state_word(x)) for x in [*st["roles"], *([rt] if rt else [])]),
              *(len(u["state"]) for u in st.get("leftover") or ())])
    # (and the name column as wide as the longest role name, up to 32 characters: a longer one pushed the rest out)
    nw = max([10, *(len(x["name"]) for x in [*st["roles"], *(st.get("leftover") or ()), *(st.get("removed") or ())])])
    for r in st["roles"]:
        health = f"{r['health'] or 'down':<5}"
        if r["health"] and not r.get("port_owned", True):  # an inactive unit's port can answer too (another state dir)
            health += _from_another_process(r, own)
        elif r.get("port_silent_holder"):  # (a listener that answers no HTTP: it keeps the role from its port)
            health += f" (its port is held by {r['port_silent_holder']})"
        lines.append(
            f"  {r['name']:<{nw}} {_state_word(r):<{sw}} pid {r['main_pid'] or '-':<8} health {health} "
            f"restarts {r['restarts']}  {r['url']}" + _unsupervised(r) + _main_stopped(r)
            + _START_LIMIT.format(name=r["name"]) * (r.get("sub_state") == "start-limit-hit")
            + _WATCHDOG_GONE.format(name=r["name"]) * (r.get("sub_state") == "watchdog-gone")
        )
        lines += _log_tail_lines(r, nw)
    if rt:
        lines.append(
            f"  {'router':<{nw}} {_state_word(rt):<{sw}} pid {rt['main_pid'] or '-':<8} readiness {rt.get('readiness') or 'down'}"
            + (_from_another_process(rt, own) if rt.get("readiness") and not rt.get("port_owned", True) else "")
            + f"  restarts {rt.get('restarts', 0)}  "
            + (", ".join(rt["listening"]) if rt.get("exposure_differs") else rt["exposure"]) + f"  workers: {_router_workers_text(rt, st.get('mode', 'pd'))}"
            + _unsupervised(rt) + _main_stopped(rt)
            + _START_LIMIT.format(name="router") * (rt.get("sub_state") == "start-limit-hit")
            + _WATCHDOG_GONE.format(name="router") * (rt.get("sub_state") == "watchdog-gone")
        )
        lines += _log_tail_lines(rt, nw)
        if rt.get("exposure_differs"):  # (where it listens is what the network sees; the topology's is the intent)
            public = [a for a in rt["listening"] if a.startswith(("0.0.0.0:", "[::]:"))]
            lines.append(f"  {'':<{nw}} it listens on {', '.join(rt['listening'])}"
                         + (" (every interface)" if public else "")
                         + f", not on {rt['exposure']} as the deployment says: "
                         + ("the unfinished apply has not restarted it yet; applying its spec again restarts it there"
                            if st.get("applying") else "`pdctl apply` restarts it there"))
        if rt.get("mismatches"):  # (what router_exposed proves, no longer so)
            lasting = bool(rt.get("mismatches_lasting"))
            lines.append(f"  {'':<{nw}} its workers differ from the deployment: {'; '.join(rt['mismatches'])} ["
                         + ("registered otherwise than the deployment (started for other workers, or one removed from "
                            "it since), which its health checks do not mend: applying the deployment's spec restarts "
                            "the router with its workers]" if lasting else
                            "its health checks call a worker unhealthy until its server answers them; `pdctl apply` "
                            "restarts a server that does not serve]"))
        serving = rt.get("serving") or {}
        if serving.get("problems") and rt.get("readiness"):  # (what a client of the router gets: truth under traffic)
            lines.append(f"  {'':<{nw}} NOT serving clients: {'; '.join(serving['problems'])}" + (
                " [the router's circuit breaker holds a worker out after failures, for up to "
                "--cb-timeout-duration-secs (60 s) once it serves again; `pdctl apply` re-admits it]"
                if any("circuit" in p for p in serving["problems"]) else ""))
    # what each choice does to them: the recorded spec is planned as `pdctl plan` plans it (from the interrupted
    # target, a topology change to confirm, once that apply began the other shape: recorded_requires_confirmation)
    recorded_spec = f"the recorded ({was}) spec" if was else "the recorded spec"
    target_spec = f"the unfinished apply's ({st['mode']}) spec"
    confirm = st.get("recorded_requires_confirmation")
    back = f"applying {recorded_spec} is a topology change to confirm (`pdctl plan` shows its id)"
    for u in st.get("leftover") or ():
        if u.get("unrecorded"):
            lines.append(f"  {u['name']:<{nw}} {u['state']:<{sw}} pid {u['main_pid'] or '-':<8} [installed here, but "
                         "neither the journal nor this spec names it (a journal lost?): `pdctl down` stops and removes "
                         "it with the rest]")
            continue
        kept = "keeps it" if u["state"] in ("active", "activating") else "starts it again"
        lines.append(f"  {u['name']:<{nw}} {u['state']:<{sw}} pid {u['main_pid'] or '-':<8} [of the recorded deployment, "
                     f"which the unfinished apply drops: {back if confirm else f'applying {recorded_spec} {kept}'}; "
                     f"applying {target_spec} again, or `pdctl down`, removes it]")
    for u in st.get("removed") or ():
        lines.append(f"  {u['name']:<{nw}} {'removed':<{sw}} pid {'-':<8} [of the recorded deployment, removed already by "
                     f"the unfinished apply that drops it: " + (f"{back} that starts it again]" if confirm else
                                                                 f"applying {recorded_spec} starts it again]"))
    if st["steps"]:
        lines.append("  steps:")
        ssw = max(8, *(len(s["status"]) for s in st["steps"].values()))
        for name, s in st["steps"].items():
            age = f" ({s['age_s']:.0f}s ago)" if s.get("age_s") is not None else ""
            summary = (s.get("summary") or "").split("\n", 1)[0]  # a failure's log excerpt stays in --json
            since = s.get("restarted_since") or []
            stale = (f"  [proven before {', '.join(since)} restarted (a crash its supervisor recovered from?): "
                     "`pdctl apply` proves it again]") if since else ""
            lines.append(f"    {name:<20} {s['status']:<{ssw}} {summary}{age}{stale}")
    for path in st.get("unit_files_not_pdctls") or ():
        lines.append(f"  {path}: not a unit file pdctl wrote (damaged?); `pdctl apply` refuses it until it is restored "
                     "or moved aside (apply then stops what its unit still runs and installs it anew)")
    for unit in st.get("missing_units") or ():
        lines.append(f"  {unit}: its files are gone (removed outside pdctl?): `pdctl apply` stops what it still "
                     "runs and installs the unit again; `pdctl down` stops it")
    for unit in st.get("edited_units") or ():
        effect = ("its supervisor keeps the unit file it started with (a secrets file it reads again at each restart)"
                  if st.get("service_manager") == "process" else "a crash or reboot would start the edited one")
        lines.append(f"  {unit}: its unit file differs from what pdctl writes (edited outside pdctl?); {effect}: "
                     "`pdctl apply` writes it back")
    target = st.get("target") or {}
    if target.get("enabled") is False:
        lines.append(f"  {target['unit']} is not enabled: a reboot would not start the deployment; `pdctl apply` "
                     "enables it")
    elif target.get("state") not in (None, "active") and st.get("deployed"):
        lines.append(f"  {target['unit']} is {target['state']}: the units it groups run without it; `pdctl apply` "
                     "starts it")
    views = [*st["roles"], *([rt] if rt else [])]
    if any(x.get("port_held_for") and x["port_held_for"] not in own for x in views):
        from pdctl.statemachine.plan import OTHER_DEPLOYMENT_HINT

        lines.append(f"  hint: {OTHER_DEPLOYMENT_HINT}")
    elif any(x.get("port_applied_elsewhere") is not None for x in views):
        lines.append("  hint: this deployment runs, applied another way: give status, plan, apply and down the way it "
                     "was applied (the same user, service_manager and --state-dir or XDG_STATE_HOME)")
    return "\n".join(lines)


def _from_another_process(view: dict, leftover: "set[str] | frozenset[str]" = frozenset()) -> str:
    """A role's or the router's health answered by a process outside its unit, and which pdctl unit that process runs
    for where another deployment's (``port_held_for``), or how this deployment's own was applied where it runs under
    another state directory, user or service manager (``port_applied_elsewhere``). A unit in *leftover* is this
    deployment's own, of the recorded topology that an unfinished apply drops (status lists it below)."""
    unit, how = view.get("port_held_for"), view.get("port_applied_elsewhere")
    if unit in leftover:
        return f" (from this deployment's {unit}, of the recorded deployment the unfinished apply drops: see below)"
    if unit:
        return f" (from another process on its port: pdctl unit {unit})"
    if view.get("port_orphaned"):
        return " (from this deployment's own process, whose supervisor's files are gone)"
    if how is not None:
        return " (from this deployment's own process, applied another way" + (f": it runs under {how})" if how else ")")
    return " (from another process on its port)"


@app.command("down")
def down_cmd(
    spec: SpecArg,
    state_dir: StateDirOpt = None,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask (headless)")] = False,
) -> None:
    """Stop everything in reverse order (router, decode, prefill) and remove the units.

    Exit 0: stopped, or nothing of it installed here (this state directory and service manager) and none of its own processes running; 1: nothing installed here, yet its own processes hold its ports (applied with another --state-dir, user or service manager: the holders are named, nothing is stopped), or any other error; 4: locked; 5: the state directory cannot be written (full, read-only, over quota: named with the fix; nothing was stopped); 64: bad command line, or no terminal to ask on and no --yes; 130 / 143 / 129: interrupted (Ctrl-C / SIGTERM / SIGHUP), what is stopped stays stopped.
    """
    from pdctl.statemachine.service import down, load

    loaded = load(spec, state_dir=state_dir, rules=False)
    _broken_rules_note(loaded, "down stops what the journal records")
    if not yes:
        if not sys.stdin.isatty():
            raise typer.BadParameter("refusing to stop without a terminal to ask on: pass --yes")
        answer = input(f"Stop every role of deployment {loaded.deployment.name!r}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            _err("nothing stopped")
            raise typer.Exit(ExitCode.OK)
    global _interrupted_hint, _work_done
    named = shlex.quote(str(spec)) + (f" --state-dir {shlex.quote(str(state_dir))}" if state_dir else "")
    _interrupted_hint = (f"interrupted: what is already stopped stays stopped; run `pdctl down {named} --yes` again to "
                         f"finish (`pdctl status {named}` shows what still runs)")
    reporter = _Reporter(False)
    touched: list[str] = []  # the units it began stopping (or found stopped), from its events

    class _Sink:
        def emit(self, event) -> None:  # noqa: ANN001
            if event.data.get("unit"):
                touched.append(event.data["unit"])
            reporter.emit(event)

    with _signals_as_interrupt():
        try:
            names = down(loaded, sink=_Sink())
            _work_done = True  # (stopped and journalled: a Ctrl-C from here on changes nothing)
        except PdctlError as exc:
            if touched:  # (it had begun stopping units: a lost connection, say, cut it short)
                exc.hint = ((exc.hint + "; ") if exc.hint else "") + (
                    f"the down did not finish: what it stopped stays stopped; `pdctl down {named} --yes` again finishes it")
            raise
    if names:  # the lines above say which were running (stopped) and which were not
        _err(f"removed {len(names)} unit(s) of {loaded.deployment.name!r}")
    else:
        _err(f"nothing of {loaded.deployment.name!r} is installed here (service manager "
             f"{loaded.deployment.service_manager}, state directory {loaded.journal.dir}): nothing to stop")


@app.command("units")
def units_cmd(
    spec: SpecArg,
    given: Annotated[str, typer.Option("-o", "--out", metavar="DIR",
                                       help="Directory to write the unit files into (created if missing)")],
    state_dir: StateDirOpt = None,
) -> None:
    """Write the deployment's systemd units (one per role and a target) into a directory: what apply installs
    (a user-scope spec's secrets file named under the state directory, as apply keeps it)."""
    from pdctl.statemachine.launch import write_units
    from pdctl.statemachine.service import load

    example = "a directory path, e.g. -o ./units"
    if given == "":  # (Path("") is the current folder: the units were written there without a word)
        raise PdctlError("-o '': an empty path names no directory to write the units into; nothing was written",
                         hint=f"give -o/--out {example} (-o . for the current one)")
    if given == "-":  # (stdout for `plan -o -`; here it made a folder named "-")
        raise PdctlError("-o -: the units are several files, not one stream for stdout; nothing was written",
                         hint=f"give -o/--out {example} (-o ./- for a folder named -)")
    out = Path(given)
    # a file, device or link to neither where the folder should be: unwritable, as `plan -o` calls a folder (a link to
    # a folder is fine: the units are written inside it, and the link stays)
    if os.path.lexists(out) and not out.is_dir():
        raise _out_unwritable(out, NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(out)),
                              "the units", example)
    loaded = load(spec, state_dir=state_dir, discover="try")  # (a discovering host: what apply binds to)
    global _interrupted_hint
    _interrupted_hint = (f"interrupted while the unit files were written: some may be in {out}, none is installed; "
                         "run it again")
    from pdctl.units.errors import ForeignUnit

    try:
        written = write_units(loaded.deployment, out, state_dir=str(loaded.journal.dir))
    except ForeignUnit as exc:  # (a file of that name pdctl did not write: this user could write there all the same)
        raise _out_unwritable(out, exc, "the units", example,
                              hint=f"give -o/--out another folder (e.g. -o ./units), or move {out / exc.unit} aside "
                                   "if it is an old copy of it") from exc
    except OSError as exc:
        raise _out_unwritable(out, exc, "the units", example) from exc
    except ValueError as exc:  # a path systemd would not read back as one (rendered before anything is written)
        raise PdctlError(f"the units cannot be written: {exc}; nothing was written",
                         hint="give --state-dir (or PDCTL_STATE_DIR / XDG_STATE_HOME) a path without spaces, quotes or "
                              "backslashes: a user-scope spec's secrets are kept under it") from None
    for p in written:
        sys.stdout.write(f"{p}\n")


class _Target(str, Enum):
    hosts = "hosts"
    k8s = "k8s"


class _Format(str, Enum):
    rbg = "rbg"
    lws = "lws"


class _Exported(str, Enum):
    k8s = "k8s"


def _plan_k8s(spec: Path, from_dir: Path | None, fmt, image, router_image, as_json: bool,  # noqa: ANN001
              hosts_only: list[str]) -> None:
    """``pdctl plan SPEC --target k8s --from DIR``: :func:`pdctl.statemachine.k8s.plan_spec`, rendered."""
    from pdctl.statemachine.k8s import plan_spec
    from pdctl.statemachine.plan import render_text

    if from_dir is None:
        raise typer.BadParameter("give the folder of the earlier export: --from DIR", param_hint="--target k8s")
    if hosts_only:
        raise typer.BadParameter(f"{', '.join(hosts_only)}: for a plan on hosts, not with --target k8s",
                                 param_hint="--target k8s")
    p, notes, warnings = plan_spec(spec, from_dir, fmt=fmt.value if fmt else None, image=image,
                                   router_image=router_image)
    for w in warnings:
        _err(f"warning: {w.field}: {w.message}\n  fix: {w.fix}")
    for n in notes:
        _err(f"note: {n}")
    sys.stdout.write((p.to_json() if as_json else _visible(render_text(p))) + "\n")
    if p.has_changes and not as_json:
        k8s = p.to_topology.deployment.get("kubernetes") or {}
        _err(f"note: `pdctl export k8s {shlex.quote(str(spec))} --format {k8s.get('format')} --image "
             f"{shlex.quote(str(k8s.get('image')))} -o {shlex.quote(str(from_dir))}` writes it"
             + (f" with --confirm-topology {p.plan_id}" if p.requires_confirmation else "")
             + f"; `kubectl apply -f {shlex.quote(str(from_dir))}` makes it")
    raise typer.Exit(ExitCode.CHANGES if p.has_changes else ExitCode.OK)


@app.command("export")
def export_cmd(
    target: Annotated[_Exported, typer.Argument(metavar="k8s", help="k8s: Kubernetes manifests")],
    spec: SpecArg,
    fmt: Annotated[_Format, typer.Option("--format", help="rbg: one RoleBasedGroup (sgl-project/rbg v0.7.0); lws: a "
                                                          "LeaderWorkerSet per server group and a Deployment for the "
                                                          "router (kubernetes-sigs/lws v0.10.0)")],
    given: Annotated[str, typer.Option("-o", "--out", metavar="DIR", help="Folder to write the manifests into "
                                                                          "(created if missing)")],
    image: Annotated[str, typer.Option("--image", metavar="IMAGE",
                                       help="The servers' container image: engine.python with SGLang in it")],
    router_image: Annotated[Optional[str], typer.Option("--router-image", metavar="IMAGE",
                                                        help="The router's image (default: --image)")] = None,
    confirm_topology: Annotated[Optional[str], typer.Option(
        "--confirm-topology", metavar="PLAN_ID",
        help="Confirm a topology change to the export already in DIR: the exact plan id")] = None,
) -> None:
    """Write SPEC as Kubernetes manifests into DIR (the same argv the units run; see the README's Kubernetes part):
    validated against the pinned CRD schemas and Kubernetes' own where the k8s extra is installed, not run. An
    earlier export in DIR is planned from: a topology change is refused (plan printed) unless --confirm-topology
    names this exact plan. Exit 0: written (paths on stdout); 2: topology change not confirmed; 1: error."""
    from pdctl.statemachine.errors import TopologyNotConfirmed
    from pdctl.statemachine.k8s import export_spec
    from pdctl.statemachine.plan import render_text

    if given in ("", "-"):
        raise PdctlError(f"-o {given!r}: the manifests are files in a folder; nothing was written",
                         hint="give -o/--out a folder, e.g. -o ./k8s")
    try:
        done = export_spec(spec, fmt=fmt.value, image=image, router_image=router_image, out=given,
                           confirm=confirm_topology)
    except TopologyNotConfirmed as exc:
        if getattr(exc, "plan", None) is not None:
            sys.stdout.write(_visible(render_text(exc.plan)) + "\n")
        raise
    for w in done.warnings:
        _err(f"warning: {w.field}: {w.message}\n  fix: {w.fix}")
    for n in done.export.notes:
        _err(f"note: {n}")
    if done.plan.from_topology is not None:
        _err(_visible(render_text(done.plan)) if done.plan.has_changes else f"no change to the export in {given}")
    for p in done.removed:
        _err(f"removed {p} (no longer part of the export)")
    _err("validated against: " + "; ".join(done.validated) if done.validated is not None
         else f"not validated: {done.not_validated}")
    if done.export.secret_keys:
        keys = " ".join(f"--from-literal={k}=…" for k in done.export.secret_keys)
        _err(f"the pods read {', '.join(done.export.secret_keys)} from Secret {done.export.secret}: create it first "
             f"(kubectl create secret generic {done.export.secret} {keys})")
    for p in done.written:
        sys.stdout.write(f"{p}\n")


@app.command("verify")
def verify_cmd(
    spec: SpecArg,
    endpoints: Annotated[Optional[list[str]], typer.Option(
        "--endpoints", metavar="ROLE=URL[,ROLE=URL…]", show_default=False,
        help="Where pdctl reaches each role from here (repeatable): prefill=http://127.0.0.1:8001, decode=…, "
             "router=…; also router.metrics=… and PREFILL.bootstrap=HOST:PORT")] = None,
    target: Annotated[_Target, typer.Option("--target", help="hosts: the spec's own addresses; k8s: its export's "
                                                             "(every role needs an endpoint)")] = _Target.hosts,
    fmt: Annotated[Optional[_Format], typer.Option("--format", help="--target k8s: the export's format (default "
                                                                    "rbg)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON event per line on stdout")] = False,
) -> None:
    """Run the KV-link, router and parsers proofs of SPEC against a deployment pdctl did not start (Services reached
    through a port-forward, or any URLs), with the same proofs and words as apply's steps; nothing is started or
    recorded. Exit 0: every proof held; 3: one failed (its step says which); 1: error."""
    from pdctl.statemachine.errors import StepError
    from pdctl.statemachine.verify import parse_endpoints, verify_spec

    rep = _Reporter(as_json)
    with _signals_as_interrupt():
        try:
            verify_spec(str(spec), parse_endpoints(endpoints or []), target=target.value,
                        fmt=fmt.value if fmt else None, sink=rep)
        except StepError as exc:
            if rep.failure_shown:  # (said on the failed step's line, as apply says it)
                if exc.hint and not rep.hint_shown:
                    _err(f"  hint: {exc.hint}")
                raise typer.Exit(exit_code_for(exc)) from None
            raise
    if not as_json:
        _err(f"verified: every proof of {spec} held")


_PLAN_OUT_EXAMPLE = "a file path, e.g. -o plan.json (or -o - for stdout)"


def _refuse_own_file(out: Path, shown: str | None, spec: Path, journal) -> None:  # noqa: ANN001
    """Raise :class:`PdctlError` where ``plan -o`` would replace the spec the plan is made from (a plan saved over
    its spec names itself as the spec to apply: both were lost), or a file pdctl keeps in the deployment's state
    directory (its journal, audit log and lock, the supervisor's and the secrets' folders: a plan over the journal
    made every later plan, apply, status and down fail on "not a readable pdctl journal"). Another file in that
    folder is the operator's (``--state-dir .`` with ``-o plan.json``)."""
    target = out.resolve()
    try:
        same = target == spec.resolve() or (out.exists() and os.path.samefile(out, spec))
    except OSError:
        same = False
    if same:
        raise PdctlError(f"-o {shown} is the spec the plan is made from ({spec}): saving the plan there would replace "
                         "it; nothing was written", hint=f"give -o/--out another file: {_PLAN_OUT_EXAMPLE}")
    home = journal.dir.resolve()
    # this deployment's state directory, and any other deployment's (a folder with a journal.json, which plan -o
    # ../other/journal.json replaced: that deployment could then be neither planned, applied nor taken down)
    homes = [home] + [d for d in target.parents if d != home and ((d / journal.path.name).is_file() or (
        (d / journal.audit_path.name).is_file() and (d / journal.lock_path.name).is_file()))]
    for d in homes:
        files = {d / journal.path.name, d / journal.audit_path.name, d / journal.lock_path.name}
        folders = (d / "supervisor", d / "secrets")
        if target in files or any(target == f or f in target.parents for f in folders):
            whose = "the deployment" if d == home else "another deployment"
            raise PdctlError(f"-o {shown} is one of the files pdctl keeps for {whose} in {d} (its journal, audit "
                             "log, lock, supervisor and secrets); nothing was written",
                             hint=f"give -o/--out another file: {_PLAN_OUT_EXAMPLE}")


_DESCRIPTOR_OUT_HINT = "-o - prints the plan (JSON) on stdout; to save it, give -o/--out a file path, e.g. -o plan.json"
"""The hint for ``-o /dev/stdout`` and its kin: what works instead (the path such a link points to never does)."""
_DESCRIPTOR_LINK = re.compile(r"/(?:dev/(?:stdin|stdout|stderr|fd/\d+)|proc/(?:self|thread-self|\d+)(?:/task/\d+)?/fd/\d+)")


def _a_descriptor_link(path: Path) -> bool:
    """*path* names an open file of the process that opens it (``/dev/stdout``, ``/dev/fd/1``, ``/proc/self/fd/1``),
    or is a symbolic link that leads to such a name. Those links point at ``/proc/self/fd/N`` and from there at a pipe
    or a terminal, never at a path a plan could be saved to."""
    p = os.path.abspath(path)
    for _ in range(40):  # (as many links as the kernel follows)
        if _DESCRIPTOR_LINK.fullmatch(p):
            return True
        try:
            p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
        except OSError:  # not a link (any more)
            return False
    return False


def _is_null_device(path: Path) -> bool:
    """*path* is the null device itself (``/dev/null``, not a link to it): ``plan -o /dev/null`` discards the plan,
    as any command's output sent there is, instead of being refused (the atomic rename would replace the device with
    a file, as root)."""
    try:
        st, null = os.lstat(path), os.stat(os.devnull)
    except OSError:
        return False
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == null.st_rdev


def _out_not_a_file(out: Path) -> OSError | None:
    """Why ``plan -o OUT`` would not save the plan as a file at *out*, before anything is read or written; None when it
    can try. A plan is saved by a rename over *out* (``atomic_write``): that would replace a symbolic link (never
    writing where it points: a link planted in a shared folder must not choose what a root ``pdctl`` replaces) and
    cannot replace a folder; a device (other than the null device), FIFO or socket would be replaced by a file."""
    if out.is_symlink():
        replaced = "a symbolic link, which saving would replace (a plan is saved by renaming a new file over the path)"
        if _a_descriptor_link(out):  # /dev/stdout → /proc/self/fd/1 → a pipe or terminal: no path to point at
            return OSError(errno.ELOOP, "a symbolic link to one of pdctl's own open files (its stdout, stderr…), "
                                        "not a file the plan can be saved as", str(out))
        target = Path(os.path.realpath(out))
        if target.is_file() or (not os.path.lexists(target) and target.parent.is_dir()):
            return OSError(errno.ELOOP, f"{replaced}: give the path it points to, {shlex.quote(str(target))}",
                           str(out))
        return OSError(errno.ELOOP, f"{replaced}, and what it points to, {target}, is not a file the plan can be saved "
                                    "as either", str(out))
    if out.is_dir():
        return IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(out))
    if os.path.lexists(out) and not out.is_file():
        return OSError(errno.EINVAL, "not a regular file (a device, FIFO or socket), which saving would replace",
                       str(out))
    return None


def _out_unwritable(out: Path, exc: OSError, what: str, example: str, *, shown: str | None = None,
                    hint: str | None = None) -> PdctlError:
    """An ``-o/--out`` path the OS refused (``/proc/x``, a read-only mount, another user's folder): the error names
    the option (*shown*: the path as given, else *out*) and the fix, a writable path (or *hint*). ``os_error_hint``
    would point at ``--state-dir``, which is not where the output goes. Only this machine's file system was touched:
    nothing on any host changed."""
    failed = Path(exc.filename) if exc.filename else None
    own = failed is None or failed == out or (failed.name.startswith(".") and failed.name.endswith(".tmp"))
    why = (exc.strerror or str(exc)) + ("" if own else f" ({failed})")  # a temp file's name would only confuse
    return PdctlError(f"-o {shown or out}: cannot write {what} there: {why}; nothing on any host changed",
                      hint=hint or f"give -o/--out a path this user can write: {example}")


@app.command("bench")
def bench_cmd(
    spec: SpecArg,
    concurrency: Annotated[str, typer.Option("--concurrency", metavar="LIST",
                                             help="Comma-separated concurrency levels, one AIPerf run each")] = "1,4,16",
    isl: Annotated[int, typer.Option("--isl", metavar="N", min=1, help="Prompt tokens per request")] = 256,
    osl: Annotated[int, typer.Option("--osl", metavar="N", min=1, help="Output tokens asked per request")] = 128,
    requests_per_level: Annotated[int, typer.Option(
        "--requests-per-level", metavar="N", min=1,
        help="Requests per level: max(N × concurrency, 32) (ignored with --duration-s)")] = 8,
    duration_s: Annotated[Optional[float], typer.Option(
        "--duration-s", metavar="S", min=1, max=3600, help="Run each level for S seconds instead of a request count")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(
        "--tokenizer", metavar="PATH", help="Tokenizer for the prompts (default: the model's path; a local one for "
                                            "the stand-in)")] = None,
    timeout: Annotated[float, typer.Option("--timeout", metavar="SECONDS", min=10, max=7200,
                                           help="Bound on the whole sweep (AIPerf's runs)")] = 600,
    as_json: Annotated[bool, typer.Option("--json", help="Print the saved results.json on stdout instead of the table")] = False,
    state_dir: StateDirOpt = None,
) -> None:
    """Measure the deployment through its router: a bounded concurrency sweep of streamed chat completions driven by
    AIPerf (installed on first use into its own venv, .venv-bench beside pdctl's, or PDCTL_BENCH_VENV). Reports
    output tok/s, requests/s, TTFT and ITL p50/p90/p99 and errors per level, saved with the plan id and versions under
    the state directory (bench/<UTC time>/: results.json, table.txt, throughput.png), which the console's throughput
    tab shows. Against the SGLang stand-in the figures are the HTTP path's, not a GPU's. Exit 0: every request
    answered; 1: a deployment that is not up (`pdctl apply SPEC` first), AIPerf's venv that cannot be created (no
    network to PyPI: the fix is named), AIPerf failing or a level past its bound, or some requests failed;
    130 / 143 / 129: interrupted (Ctrl-C / SIGTERM / SIGHUP)."""
    from pdctl.statemachine import bench
    from pdctl.statemachine.service import load

    try:
        levels = tuple(sorted({int(x) for x in concurrency.split(",") if x.strip()}))
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise typer.BadParameter(f"{concurrency!r}: give positive whole numbers, e.g. 1,4,16",
                                 param_hint="--concurrency")
    with _interruptible("bench"):
        loaded = load(spec, state_dir=state_dir, rules=False, discover="try")
        _broken_rules_note(loaded, "bench measures what runs")
        opts = bench.BenchOptions(levels=levels, isl=isl, osl=osl, requests_per_level=requests_per_level,
                                  duration_s=duration_s, tokenizer=tokenizer, timeout_s=timeout)
        done = bench.run(loaded, opts, progress=lambda m: _err(m))
    res = done.result
    if as_json:
        sys.stdout.write(json.dumps({**res, "dir": str(done.out), "png": str(done.png) if done.png else None},
                                    indent=1) + "\n")
    else:
        from rich.console import Console

        from pdctl.console.bench_view import bench_table

        con = Console(file=sys.stdout, highlight=False, width=None if sys.stdout.isatty() else 120)
        sys.stdout.write(_visible("\n".join(done.header)) + "\n")
        sys.stdout.flush()
        con.print(bench_table(res))
        sys.stdout.write("(TTFT and ITL in ms; tok/s and req/s over each level's run)\n\n"
                         + bench.terminal_plot(res["levels"]) + "\n\n"
                         + f"saved: {done.out} (results.json, table.txt, aiperf/)\n"
                         + (f"PNG: {done.png}\n" if done.png else "PNG: not drawn\n"))
    if done.png_error:
        _err(f"note: the PNG could not be drawn: {done.png_error}")
    failed = sum(int(r.get("errors") or 0) for r in res["levels"])
    if failed:
        _err(f"error: {failed} request(s) failed (the err column); AIPerf's output is in {done.out / 'aiperf.log'}; "
             f"`pdctl status {spec}` says whether every role serves")
    raise typer.Exit(ExitCode.ERROR if failed else ExitCode.OK)


@app.command("chat")
def chat_cmd(
    spec: SpecArg,
    message: Annotated[str, typer.Argument(help="The user message")] = "What is the weather in Paris? Use the tool.",
    state_dir: StateDirOpt = None,
    timeout: Annotated[float, typer.Option("--timeout", metavar="SECONDS", min=1, max=3600,
                                           help="How long to wait for the answer")] = 120,
) -> None:
    """Send one chat completion (with a tool and thinking on) through the deployment's router (or its single server).

    The answer's JSON goes to stdout. Exit 0: HTTP 200; 1: a deployment that is not deployed (nothing recorded in the
    state directory: whatever listens on the spec's port is not asked), any other status, no connection, or no
    answer within --timeout (120 s: a busy or frozen server); 130 / 143 / 129: interrupted (Ctrl-C / SIGTERM /
    SIGHUP).
    """
    with _interruptible("chat"):  # (SIGTERM ended pdctl at once, with no word of why)
        _chat(spec, message, state_dir, timeout)


def _chat(spec: Path, message: str, state_dir: Path | None, timeout: float) -> None:
    import httpx

    from pdctl.statemachine.probes import PROBE_TOOL
    from pdctl.statemachine.service import load
    from pdctl.statemachine.topology import topology_of

    loaded = load(spec, state_dir=state_dir, discover="try")  # (a discovering host: what apply binds to)
    spec_topo = topology_of(loaded.deployment)
    state = loaded.journal.read()  # what runs (or is being applied), as `pdctl status` reads it
    if state.target is None and state.deployed is None:
        # (it asked whatever listened on the spec's port: another deployment's router answered for one never applied)
        _err(f"error: deployment {spec_topo.name!r} is not deployed (nothing recorded in {loaded.journal.dir}), so "
             f"pdctl does not know what would answer on {(spec_topo.router or spec_topo.roles[0]).url}\n"
             f"  hint: `pdctl apply {spec}` first, or give the state directory it was applied with (--state-dir, "
             "PDCTL_STATE_DIR or XDG_STATE_HOME)")
        raise typer.Exit(ExitCode.ERROR)
    topo = state.target or state.deployed
    if topo != spec_topo:
        _err(f"note: deployment {topo.name!r} runs other settings than this spec's (`pdctl plan {spec}` shows which); "
             "chatting with what runs")
    if topo.router is not None:
        url = topo.router.url
    else:
        url = topo.roles[0].url
    model = topo.roles[0].served_model  # the name what runs serves, which the router registered (not the spec's, unapplied)
    body = {"model": model, "messages": [{"role": "user", "content": message}], "tools": [PROBE_TOOL],
            "chat_template_kwargs": {"thinking": True}, "max_tokens": 256}
    from pdctl.statemachine.errors import PdctlError
    from pdctl.statemachine.service import deployment_host, machine_of, refuse_another_machine

    try:
        dhost = deployment_host(loaded.deployment)
    except PdctlError as exc:
        _err(f"error: {exc}")
        raise typer.Exit(ExitCode.ERROR) from None
    try:  # (as status: a host setting that now reaches another machine would chat with whatever listens there)
        if state.machine:
            refuse_another_machine(loaded, state, machine_of(dhost), "chatting with it")
    except PdctlError:
        dhost.close()
        raise
    try:  # through the deployment's host: an SSH forward when the router listens on a remote machine
        with httpx.Client(trust_env=False, transport=dhost.http_transport()) as client:
            r = client.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)
    except (httpx.HTTPError, PdctlError) as exc:
        hint = (f"; is the deployment up? `pdctl status {spec}` shows it" if isinstance(exc, httpx.ConnectError) else
                f": no answer within {timeout:g} s (--timeout); `pdctl status {spec}` shows whether a server is stuck"
                if isinstance(exc, httpx.TimeoutException) else "")
        _err(f"error: POST {url}/v1/chat/completions: {exc}{hint}")
        raise typer.Exit(ExitCode.ERROR) from None
    finally:
        dhost.close()
    sys.stdout.write(json.dumps(r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text, indent=1) + "\n")
    if r.status_code != 200:  # (the body alone, on stdout, did not say that the request failed)
        _err(f"error: POST {url}/v1/chat/completions answered HTTP {r.status_code} (its body is on stdout); "
             f"`pdctl status {spec}` shows whether every role serves")
    raise typer.Exit(ExitCode.OK if r.status_code == 200 else ExitCode.ERROR)


@app.command("console")
def console_cmd(
    spec: SpecArg,
    state_dir: StateDirOpt = None,
    readonly: Annotated[bool, typer.Option("--readonly", help="Watch only: every mutating key binding is removed")] = False,
    refresh: Annotated[
        Optional[float],
        typer.Option("--refresh", metavar="SECONDS", min=0.1, max=3600,
                     help="Telemetry interval (default: the spec's console.refresh_s, 1 s)"),
    ] = None,
) -> None:
    """Open the console on SPEC: steps and proofs, topology, GPU/NUMA, throughput, logs; apply from it (also `pdctl SPEC`).

    Needs a terminal: without one (stdin or stderr not a TTY) it exits 64 at once. Exit 0 when quit; 130 when quit
    during an apply (which stops at its next step event; the journal records where); 130 / 143 / 129 on SIGINT /
    SIGTERM / SIGHUP.
    """
    # (Textual is imported here only: the headless commands never load it.)
    from pdctl.statemachine.service import load

    global _interrupted_hint
    _interrupted_hint = "interrupted before the console opened: nothing was changed"
    with _signals_as_interrupt():  # (discovery runs nvidia-smi: SIGTERM there ends it too, as Ctrl-C does)
        loaded = load(spec, state_dir=state_dir, discover=True)
    # Textual reads keys from stdin and draws on the process's stderr (its Linux driver writes to sys.__stderr__):
    # either one not a terminal and it would wait on no keys, writing escapes into a file or pipe
    if not (sys.__stdin__ is not None and sys.__stdin__.isatty() and sys.__stderr__ is not None
            and sys.__stderr__.isatty()):
        _err("error: the console needs a terminal (stdin and stderr); nothing was opened\n"
             "  hint: for scripts use `pdctl status SPEC [--json]`, `pdctl plan SPEC` or `pdctl apply SPEC`")
        raise typer.Exit(ExitCode.USAGE)
    if _in_the_background(sys.__stdin__.fileno()):
        # (Textual would set the terminal up and be stopped by SIGTTOU, drawing nothing, until killed)
        _err("error: the console needs the terminal to itself, and this process runs in the background of it (another "
             "process group has the terminal); nothing was opened\n"
             "  hint: run it in the foreground (`fg`; under `timeout`, `timeout --foreground`)")
        raise typer.Exit(ExitCode.USAGE)
    from pdctl.console.app import run_console

    _interrupted_hint = "interrupted: the console was quit or signalled during an apply (where it stopped is said above)"
    rc, applying = run_console(loaded, readonly=readonly, refresh_s=refresh, state_dir=state_dir)
    if not applying:  # (SIGINT from another process: in the console's raw mode Ctrl-C is a key)
        _interrupted_hint = "interrupted (SIGINT): the console was closed; no apply was running"
        by = {ExitCode.TERMINATED: "terminated (SIGTERM)", ExitCode.HANGUP: "hung up (SIGHUP)"}.get(rc)
        if by:  # (main says a line for 130 only; SIGTERM and SIGHUP said nothing where SIGINT did)
            _err(f"{by}: the console was closed; no apply was running")
    raise typer.Exit(rc)


def _in_the_background(fd: int) -> bool:
    """Whether this process is not in the foreground process group of the terminal on *fd* (``tcgetpgrp(3)``): a job
    in the background, or a command under ``timeout`` without ``--foreground`` (it makes its own group)."""
    try:
        return os.tcgetpgrp(fd) != os.getpgrp()
    except OSError:  # (no controlling terminal: the isatty checks above decide)
        return False


def _rewrite(argv: list[str]) -> list[str]:
    """``--apply X`` → ``apply X`` (options written before ``--apply``, as in ``--json --apply X``, are apply's); a
    bare spec path → ``console SPEC``; ``--apply=X`` is ``--apply X``, as click reads ``--opt=value``."""
    end = argv.index("--") if "--" in argv else len(argv)
    argv = [y for i, a in enumerate(argv)
            for y in (["--apply", a[len("--apply="):]] if i < end and a.startswith("--apply=") else [a])]
    if "--apply" in argv:
        at = argv.index("--apply")
        if all(a.startswith("-") and a != "--" for a in argv[:at]):
            return ["apply", *argv[:at], *argv[at + 1:]]
    if argv and not argv[0].startswith("-") and argv[0] not in _command_names() and (
            argv[0].endswith((".toml", ".json")) or os.path.exists(argv[0])):  # a path: the console says what is wrong
        return ["console", *argv]
    return argv


def _command_names() -> set[str]:
    return {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands}  # type: ignore[union-attr]


def _click_kinds() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """``(Exit, UsageError, Abort)`` classes of click and of the copy typer vendors (typer >= 0.24
    ships its own ``typer._click``; its exceptions are not click's)."""
    mods = []
    for name in ("click.exceptions", "typer._click.exceptions"):
        try:
            mods.append(__import__(name, fromlist=["UsageError"]))
        except ImportError:
            pass
    def kinds(attr: str) -> tuple[type, ...]:
        return tuple(getattr(m, attr) for m in mods if hasattr(m, attr))

    return kinds("Exit"), kinds("UsageError"), kinds("Abort")


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: runs the app and maps errors to exit codes."""
    global _interrupted_step, _interrupted_hint, _interrupted_apply, _terminated, _apply_entered, _work_done, _signalled
    _interrupted_step = _interrupted_hint = _interrupted_apply = _terminated = None
    _apply_entered = _work_done = _signalled = False
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    if not isinstance(sys.stdout, _PipeSafe):
        sys.stdout, sys.stderr = _PipeSafe(sys.stdout, "<stdout>"), _PipeSafe(sys.stderr, "<stderr>")
    exit_kinds, usage_kinds, abort_kinds = _click_kinds()
    args = _rewrite(list(sys.argv[1:] if argv is None else argv))
    try:
        # (SIGTERM / SIGHUP while typer parses the command line, before a command installs its own handling, ended pdctl
        # at once with no word: they are Ctrl-C's KeyboardInterrupt here too, and say what the command would)
        with _signals_as_interrupt():
            rc = app(args=args, prog_name="pdctl", standalone_mode=False)
        sys.stdout.flush()  # a full disk or a dead terminal is this command's failure, not an error at exit
    except typer.Exit as e:
        rc = e.exit_code
    except exit_kinds as e:
        rc = e.exit_code
    except usage_kinds as e:
        if type(e).__name__ != "NoArgsIsHelpError":  # that one has already printed the help
            e.show(file=sys.stderr)
            took = _confirm_took_the_spec(args, e)
            if took:
                _err(f"  hint: {took}")
            _usage_error_as_json(args, e, hint=took)
        rc = ExitCode.USAGE
    except abort_kinds:
        rc = ExitCode.INTERRUPTED
    except PdctlError as e:
        _err(f"error: {e}")
        rc = exit_code_for(e)
    except UnitsError as e:  # pdctl.units has its own root (it imports nothing of pdctl)
        _err(f"error: {e}")
        rc = exit_code_for(e)
    except OSError as e:  # the state directory or a spec path the OS refused, or where the output goes
        _err(f"error: {os_error_text(e)}")
        _err(f"  hint: {os_error_hint(e)}")
        # raised while the engine recorded an interruption (a full disk refusing the journal write): the command was
        # still stopped by Ctrl-C / SIGTERM / SIGHUP, and says so in its exit code, which scripts and `timeout` read
        rc = ExitCode.INTERRUPTED if _during_interrupt(e) else ExitCode.ERROR
    except KeyboardInterrupt:
        rc = ExitCode.INTERRUPTED
    if rc == ExitCode.INTERRUPTED and _interrupted_hint is None and not _apply_entered:
        _interrupted_before_the_command(args)
    if rc == ExitCode.INTERRUPTED:  # typer turns Ctrl-C into Exit(130), which outside standalone mode comes back as rc
        during = f" during {_interrupted_step}" if _interrupted_step else ""
        said = _interrupted_hint or (_interrupted_apply or _INTERRUPTED).replace("interrupted:", f"interrupted{during}:", 1)
        by = {signal.SIGTERM: ("terminated (SIGTERM); ", ExitCode.TERMINATED),
              signal.SIGHUP: ("hung up (SIGHUP); ", ExitCode.HANGUP)}.get(_terminated, ("", rc))  # type: ignore[arg-type]
        _err(by[0] + said)
        rc = by[1]
    try:
        sys.stdout.flush()
    except OSError as e:
        _err(f"error: <stdout>: {e.strerror or e}")
        rc = rc or ExitCode.ERROR
    if argv is not None:  # (called in-process, not as the program: its caller's handlers back; the program exits here)
        for s, handler in handlers.items():
            signal.signal(s, handler)
    sys.exit(rc if isinstance(rc, int) else ExitCode.OK)


def _confirm_took_the_spec(args: list[str], e: Exception) -> str | None:
    """``apply --confirm-topology SPEC`` (or ``--confirm-topology=SPEC``) with the id left out: click takes the spec
    for the id and says "Missing argument 'SPEC'", which points nowhere near the mistake. The hint that says what was
    taken for what, or None."""
    if "SPEC" not in e.format_message():
        return None
    given = None
    for i, a in enumerate(args):
        if a == "--confirm-topology" and i + 1 < len(args):
            given = args[i + 1]
        elif a.startswith("--confirm-topology="):
            given = a.split("=", 1)[1]
    if given is None or not (given.endswith((".toml", ".json")) or os.path.isfile(given)):
        return None
    return (f"--confirm-topology took {given!r} as its plan id; it takes the id that `pdctl plan SPEC` prints (16 hex "
            f"digits): pdctl apply {given} --confirm-topology PLAN_ID")


def _usage_error_as_json(args: list[str], e: Exception, *, hint: str | None = None) -> None:
    """A usage error (an unknown option, a missing SPEC) of a command line that asks for ``--json``: stdout gets the
    ``{error, hint}`` object (``apply``: the ``apply_failed`` event that ends its stream, nothing started), so that a
    script reading stdout gets an answer, not nothing, beside click's usage text on stderr (exit 64 either way)."""
    if "--json" not in args[: args.index("--") if "--" in args else len(args)]:
        return
    from pdctl.statemachine.errors import PdctlError

    command = next((a for a in args if not a.startswith("-")), None)
    known = command if command in _command_names() else None
    err = PdctlError(f"usage: {e.format_message()}", hint=hint or f"`pdctl {known or ''} -h`".replace("  ", " ")
                     + " lists the options")
    if known == "apply":
        from pdctl.statemachine.events import Event

        sys.stdout.write(json.dumps(Event.apply_failed(err, started=False).to_json(), default=str) + "\n")
    else:
        sys.stdout.write(json.dumps(_json_error(err), indent=1) + "\n")


def _interrupted_before_the_command(args: list[str]) -> None:
    """Ctrl-C (SIGTERM, SIGHUP) after pdctl's modules loaded but before the command's own code ran (while the command
    line is parsed): plan and apply say what they say when interrupted just after, and ``apply --json`` ends its
    stream with the same ``apply_interrupted`` event (plan id null)."""
    global _interrupted_hint
    command = next((a for a in args if not a.startswith("-")), None)
    if command in _SAID_WHEN_INTERRUPTED:
        _interrupted_hint = _SAID_WHEN_INTERRUPTED[command]
    elif command in _SAID_BEFORE_THE_COMMAND:
        _interrupted_hint = _SAID_BEFORE_THE_COMMAND[command]
    elif command == "apply":
        _interrupted_hint = _APPLY_NOT_STARTED
        if "--json" in args:
            sys.stdout.write(json.dumps(_apply_not_started_event().to_json(), default=str) + "\n")


def _apply_not_started_event():  # noqa: ANN202
    """The ``apply_interrupted`` event that ends an ``apply --json`` stream interrupted before the engine's plan."""
    from pdctl.statemachine.events import Event

    return Event.apply_not_started(None)


def _during_interrupt(exc: BaseException) -> bool:
    """Whether *exc* was raised while a KeyboardInterrupt (Ctrl-C, or SIGTERM / SIGHUP through
    ``_signals_as_interrupt``) was being handled: one is in its chain of contexts."""
    seen: set[int] = set()
    cur = exc.__context__
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, KeyboardInterrupt):
            return True
        seen.add(id(cur))
        cur = cur.__context__
    return False


_STREAMS = ("<stdout>", "<stderr>")


def _json_error(exc: BaseException) -> dict:
    """``{error, hint}`` (plus ``findings`` for a spec error) of a ``--json`` error object: an OSError (a state
    directory or spec path the OS refused) in the words and with the hint stderr gives it."""
    if isinstance(exc, OSError) and not isinstance(exc, PdctlError):
        return {"error": os_error_text(exc), "hint": os_error_hint(exc)}
    return {"error": getattr(exc, "message", str(exc)), "hint": getattr(exc, "hint", None), **findings_fields(exc)}


def os_error_hint(e: OSError) -> str:
    """What to do about an OSError the CLI reports: where output goes, a state directory it may not write, a path."""
    import errno

    if e.filename in _STREAMS:
        return "check where the output goes (a full disk, a closed terminal)"
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return ("that path is not writable here (a read-only file system, or another user's): give a writable "
                "--state-dir / PDCTL_STATE_DIR, or run as the user that owns it")
    if e.errno == errno.ENOTDIR:
        return "a file is in that path where a folder should be: give --state-dir / PDCTL_STATE_DIR a folder's path"
    if e.errno == errno.EISDIR and e.filename:
        return (f"a folder is where pdctl keeps a file (its lock, journal or audit log): move {e.filename} aside "
                "(pdctl writes no folder of that name; it creates the file itself), or give another --state-dir")
    return "check the path; the journal lives in --state-dir / PDCTL_STATE_DIR (default per service scope)"
_SAID_WHEN_INTERRUPTED = {
    "plan": "interrupted: a plan changes nothing; run it again",
    "status": "interrupted: status only reads, it changes nothing; run it again",
    "chat": "interrupted: the chat was abandoned unanswered (it changes nothing of the deployment); run it again",
    "logs": "interrupted: logs only reads, it changes nothing",
    "support-bundle": "interrupted: no bundle was written (support-bundle only reads the deployment); run it again",
    "bench": "interrupted: the benchmark stopped (AIPerf ended; nothing of the deployment changed, its partial output "
             "stays in the state directory's bench/); run it again",
}
"""The one line that ends a command that changes nothing, when Ctrl-C, SIGTERM or SIGHUP stops it (``_interruptible``),
also while its command line is still being parsed."""
_SAID_BEFORE_THE_COMMAND = {
    "down": "interrupted before down started: nothing was stopped; run it again",
    "validate": "interrupted: validate only reads the spec, it changes nothing; run it again",
    "units": "interrupted before the unit files were written: nothing was written; run it again",
}
"""The line for an interrupt while these commands' command lines are parsed (they said apply's "what already runs
stays as it is … converge"); once running, down says its own (what is stopped stays stopped)."""
_APPLY_NOT_STARTED = "interrupted before the apply started: nothing was changed; run the same command again"
_INTERRUPTED = ("interrupted: what already runs stays as it is (`pdctl status SPEC` shows it); run the same command "
                "again to converge, or `pdctl down SPEC --yes` to stop it")
"""An apply's line when interrupted (its spec unknown yet: :func:`_interrupted_apply_words` names it once read)."""


def _interrupted_apply_words(spec: Path, state_dir: Path | None) -> str:
    """:data:`_INTERRUPTED` with the apply's own spec (and ``--state-dir``) in its status and down commands, shell-quoted,
    so that they can be pasted as they are, as down's line does."""
    extra = f" --state-dir {shlex.quote(str(state_dir))}" if state_dir else ""
    named = shlex.quote(str(spec)) + extra
    return (f"interrupted: what already runs stays as it is (`pdctl status {named}` shows it); run the same command "
            f"again to converge, or `pdctl down {named} --yes` to stop it")
