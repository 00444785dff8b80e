"""Errors raised by :mod:`pdctl.units` (which imports nothing of pdctl, so it has its own root).

::

    UnitsError                             (carries .unit, .title, .hint)
    ├── ForeignUnit (FileExistsError)       a unit of that name exists and pdctl did not write it
    ├── UnitDirNotWritable (PermissionError) the unit / state directory cannot be written
    ├── ManagerUnavailable (FileNotFoundError) systemctl missing, or no manager answers
    ├── ServiceFailed                       start/stop/restart failed; .log holds recent lines
    └── ServiceTimeout (TimeoutError)       a bounded wait on a service ran out

Each is raised *before* anything changes where that is possible (install checks every unit and
the directory first, then writes). Errors of the host itself (a command that cannot run, a
timeout) come from the host object unchanged — for pdctl's hosts that is
``pdctl.statemachine.errors.HostError`` and its subclasses.
"""

from __future__ import annotations

__all__ = [
    "ForeignUnit",
    "ManagerUnavailable",
    "ServiceFailed",
    "ServiceTimeout",
    "UnitDirNotWritable",
    "UnitsError",
]


class UnitsError(Exception):
    """Root of the errors of :mod:`pdctl.units`."""

    title = "Service manager error"

    def __init__(self, message: str, *, unit: str | None = None, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.unit = unit
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class ForeignUnit(UnitsError, FileExistsError):
    """A unit of the same name exists and was not written by pdctl: never overwritten."""

    title = "Foreign unit"


class UnitDirNotWritable(UnitsError, PermissionError):
    """The directory units (or the supervisor's state) go to cannot be written."""

    title = "Unit directory not writable"


class ManagerUnavailable(UnitsError, FileNotFoundError):
    """No service manager to talk to: ``systemctl`` is missing or its manager does not answer."""

    title = "Service manager unavailable"


class ServiceFailed(UnitsError):
    """A service could not be started, stopped or restarted. ``log`` holds its recent lines."""

    title = "Service failed"

    def __init__(self, message: str, *, unit: str | None = None, hint: str | None = None,
                 log: list[str] | None = None) -> None:
        super().__init__(message, unit=unit, hint=hint)
        self.log = log or []


class ServiceTimeout(UnitsError, TimeoutError):
    """A bounded wait on a service ran out."""

    title = "Service timeout"
