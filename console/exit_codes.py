"""pdctl's exit codes: an API for scripts and CI. One mapping, :func:`exit_code_for`.

====  ==============  ==========================================================================
code  name            meaning
====  ==============  ==========================================================================
0     OK              success; ``plan``: no changes
1     ERROR           invalid spec, host or probe error, anything unexpected
2     CHANGES         ``plan``: changes present (``terraform plan -detailed-exitcode``; its warnings, such as a port
                      held outside the deployment, never change the code), or apply has work
                      all the same (an earlier apply did not finish; what runs no longer serves as proven);
                      ``apply``: a topology change refused (no or wrong ``--confirm-topology``),
                      or a saved plan that no longer matches the deployment
3     STEP_FAILED     ``apply``: a state-machine step failed (a lost connection to the host included), or a
                      check refused the apply before its first step: a port or GPU used outside the
                      deployment, a bind address, ``engine.python``, the router executable, a NUMA node or CPUs,
                      ``service_user`` or the process supervisor's folder unusable on the host (the step is named
                      on stderr)
4     LOCKED          another apply or down holds the deployment's lock
5     STATE_DIR       the state directory refused a write: full, over quota, read-only or not permitted (``apply``
                      also when it has less free space than it wants to start, ``PDCTL_STATE_MIN_FREE_MIB``); the
                      directory, the file and the fix on stderr. Nothing is left behind (no lock file, no temp
                      file) and the journal keeps its previous content; an apply that fails so mid-way names what it
                      left running
64    USAGE           bad command line
129   HANGUP          ``apply``, ``down``, ``plan``, ``status``, ``chat``, ``logs``, the console: SIGHUP (the
                      terminal or SSH session went away), handled like Ctrl-C
130   INTERRUPTED     Ctrl-C; the console: quit during an apply that then stopped where it was
143   TERMINATED      ``apply``, ``down``, ``plan``, ``status``, ``chat``, ``logs``: SIGTERM (``timeout``, a CI
                      runner, a process manager), handled like Ctrl-C
====  ==============  ==========================================================================

It lives beside the CLI, not in the engine: the engine raises typed errors and never exits.
"""

from __future__ import annotations

from enum import IntEnum

from pdctl.statemachine.errors import LockHeld, PlanError, StateDirUnwritable, StepError

__all__ = ["ExitCode", "exit_code_for"]


class ExitCode(IntEnum):
    OK = 0
    ERROR = 1
    CHANGES = 2
    STEP_FAILED = 3
    LOCKED = 4
    STATE_DIR = 5
    USAGE = 64
    HANGUP = 129
    INTERRUPTED = 130
    TERMINATED = 143


def exit_code_for(exc: BaseException) -> ExitCode:
    """The exit code for an error that ended a command."""
    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.INTERRUPTED
    if isinstance(exc, LockHeld):
        return ExitCode.LOCKED
    if isinstance(exc, StateDirUnwritable):
        return ExitCode.STATE_DIR
    if isinstance(exc, PlanError):
        return ExitCode.CHANGES
    if isinstance(exc, StepError):
        return ExitCode.STEP_FAILED
    return ExitCode.ERROR
