"""pdctl's error tree. Every error pdctl raises on purpose derives from :class:`PdctlError`.

::

    PdctlError
    ├── SpecError (ValueError)            a spec that cannot be read or breaks a rule
    ├── PlanError
    │   ├── StalePlanError                a saved/confirmed plan no longer matches what is deployed
    │   └── TopologyNotConfirmed          a topology change without the matching --confirm-topology
    ├── StepError                         a state-machine step failed (carries .step)
    │   ├── ApplyFailed
    │   ├── VerifyFailed
    │   ├── StepTimeout (TimeoutError)
    │   └── UndoFailed
    ├── InvalidTransition                 the state machine was asked for a transition it does not have
    ├── LockHeld                          another apply holds the deployment's lock (carries .holder)
    ├── StateDirUnwritable (OSError)      the state directory refuses a write: full, over quota, read-only,
    │                                     not permitted (carries .state_dir, .filename, .errno)
    ├── HostError (OSError)               a host action failed (carries .host)
    │   ├── CommandFailed
    │   └── CommandTimeout (TimeoutError)
    └── ProbeError                        an HTTP/metrics probe could not be made or parsed

Each error has a short ``title`` (for a console modal) and keeps its context as attributes, as
httpx errors keep ``.request``. The exit-code mapping lives beside the CLI (``pdctl.console``).
"""

from __future__ import annotations

__all__ = [
    "ApplyFailed",
    "CommandFailed",
    "CommandTimeout",
    "HostError",
    "InvalidTransition",
    "LockHeld",
    "PdctlError",
    "PlanError",
    "ProbeError",
    "RunCancelled",
    "SpecError",
    "StalePlanError",
    "StateDirUnwritable",
    "StepError",
    "StepTimeout",
    "TopologyNotConfirmed",
    "UndoFailed",
    "VerifyFailed",
    "findings_fields",
]


class RunCancelled(Exception):
    """Raised by an event sink (in ``emit`` or ``checkpoint``) to halt a run, as the console's cancel and its SIGTERM
    do: the engine marks the step in progress interrupted and audits ``apply-interrupted``, as for Ctrl-C. Not a
    :class:`PdctlError`: nothing failed."""


class PdctlError(Exception):
    """Root of every error pdctl raises on purpose."""

    title = "pdctl error"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class SpecError(PdctlError, ValueError):
    """The spec cannot be read, or breaks a rule. ``findings`` holds every error found."""

    title = "Invalid spec"

    def __init__(self, message: str, *, findings: list | None = None, path: str | None = None,
                 hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.findings = findings or []
        self.path = path

    def findings_json(self, level: str = "error") -> list[dict[str, str | None]]:
        """The errors among :attr:`findings` (*level* ``"warning"``: the warnings found beside them) for ``--json``
        output: ``[{field, message, fix}]``. A rule's finding (``rules.Finding``) as it is; a parse error's
        ``(field, message, fix)`` (an unknown or missing key, a wrong type, shape, choice or range) as those; any other
        parse error's line, ``"field: message"`` (always an error), split at its first ``": "`` with ``fix`` null.
        Empty for a spec that cannot be read at all (the message says why)."""
        out: list[dict[str, str | None]] = []
        for f in self.findings:
            if isinstance(f, tuple):
                if level == "error":
                    out.append(dict(zip(("field", "message", "fix"), f)))
            elif isinstance(f, str):
                field, sep, message = f.partition(": ")
                if level == "error":
                    out.append({"field": field if sep else None, "message": message if sep else f, "fix": None})
            elif f.level == level:
                out.append(f.to_json())
        return out


def os_error_text(exc: OSError) -> str:
    """An OSError as pdctl says it, ``PATH: reason`` (``/srv/x/journal.json: Not a directory``), not Python's
    ``[Errno 20] Not a directory: '…'``: one wording on stderr and in every ``--json`` error object."""
    where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
    return f"{where}{exc.strerror or exc}"


def findings_fields(exc: BaseException) -> dict[str, list]:
    """``{"findings": [{field, message, fix}]}`` (:meth:`SpecError.findings_json`) for a spec error's ``--json``
    object or event, so that scripts need not parse the message; empty for any other error."""
    return {"findings": exc.findings_json()} if isinstance(exc, SpecError) else {}


class PlanError(PdctlError):
    title = "Plan error"

    def __init__(self, message: str, *, plan_id: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.plan_id = plan_id


class StalePlanError(PlanError):
    title = "Stale plan"


class TopologyNotConfirmed(PlanError):
    title = "Topology change not confirmed"


class StepError(PdctlError):
    title = "Step failed"

    def __init__(self, message: str, *, step: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.step = step


class ApplyFailed(StepError):
    pass


class VerifyFailed(StepError):
    pass


class UnmendableFault(VerifyFailed):
    """A serving fault that waiting cannot mend, of *kind*: ``port`` (another process answers on a role's port),
    ``swapped`` (a worker registered as prefill runs decode, or the reverse), ``model`` (the router registered a
    worker under another model name than it now serves). The router step restarts at once on one instead of
    waiting for its health checks."""

    def __init__(self, message: str, *, kind: str, step: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, step=step, hint=hint)
        self.kind = kind


class StepTimeout(StepError, TimeoutError):
    pass


class UndoFailed(StepError):
    pass


class InvalidTransition(PdctlError):
    title = "Invalid transition"


class LockHeld(PdctlError):
    title = "Deployment locked"

    def __init__(self, message: str, *, holder: dict | None = None) -> None:
        purpose = (holder or {}).get("purpose") or "apply"
        super().__init__(message, hint=f"wait for the other {purpose} to finish, or check that its PID is gone")
        self.holder = holder or {}


class StateDirUnwritable(PdctlError, OSError):
    """The state directory (journal, audit log, lock, the process supervisor's folders) refused a write: full
    (``ENOSPC``), over quota (``EDQUOT``), read-only (``EROFS``) or not permitted (``EACCES``, ``EPERM``), or had less
    free space than an apply needs to start. Carries ``state_dir``, and as an OSError ``errno``, ``strerror`` and
    ``filename`` (the file or folder refused); its hint is the fix for that ``errno``. Built by
    ``Journal.unwritable``, which leaves nothing behind first (no lock file, no temp file, the journal as it was)."""

    title = "State directory not writable"

    def __init__(self, message: str, *, state_dir: str, filename: str | None = None, errno: int | None = None,
                 strerror: str | None = None, hint: str | None = None) -> None:
        PdctlError.__init__(self, message, hint=hint)
        self.state_dir = state_dir
        self.errno = errno
        self.strerror = strerror
        self.filename = filename


class HostError(PdctlError, OSError):
    title = "Host error"

    def __init__(self, message: str, *, host: str | None = None, hint: str | None = None) -> None:
        PdctlError.__init__(self, message, hint=hint)
        self.host = host


class CommandFailed(HostError):
    def __init__(
        self,
        message: str,
        *,
        host: str | None = None,
        argv: list[str] | None = None,
        returncode: int | None = None,
        stderr: str = "",
        hint: str | None = None,
    ) -> None:
        super().__init__(message, host=host, hint=hint)
        self.argv = argv or []
        self.returncode = returncode
        self.stderr = stderr


class CommandTimeout(HostError, TimeoutError):
    pass


class ProbeError(PdctlError):
    """A probe's request failed. The evidence rides along for :meth:`evidence_hint`: ``status`` and ``body`` (the
    first 300 characters) of an HTTP answer, or the transport error ``cause`` when none came."""

    title = "Probe failed"

    def __init__(self, message: str, *, url: str | None = None, status: int | None = None, body: str | None = None,
                 cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.url, self.status, self.body, self.cause = url, status, (body or "")[:300], cause

    def evidence_hint(self) -> str | None:
        """A hint from what came back rather than from the step that asked, or None where the step's own hint holds
        (a 400, a body that parsed but said something wrong). The router's words for lack of workers are smg 1.13's
        (``No available prefill workers``, ``all circuits open or unhealthy``)."""
        import httpx

        where = self.url or "the server"
        if isinstance(self.cause, httpx.ConnectError):
            return (f"nothing accepts connections at {where}: is the process running and listening there? "
                    "`pdctl status SPEC` and `pdctl logs SPEC ROLE` say")
        if isinstance(self.cause, httpx.TimeoutException):
            return (f"{where} took the request but did not answer in time: busy (a long prefill, a queue) or hung; "
                    "`pdctl logs SPEC ROLE`, then apply again")
        body = self.body.lower()
        if self.status == 503 and ("worker" in body or "circuit" in body):
            return ("the router has no worker it can serve: read its view of them (`pdctl status SPEC --canary`, or "
                    "GET /workers on the router); a worker restarting or held out by its circuit breaker is back once "
                    "it serves, and `pdctl apply` again re-admits one that serves")
        if self.status == 503:
            return f"{where} says it cannot serve yet (503): loading or overloaded; `pdctl status SPEC`"
        if self.status == 404:
            return (f"{where} has no such endpoint: another program answers on that port, or the engine is not the "
                    "spec's sglang_version")
        return None
