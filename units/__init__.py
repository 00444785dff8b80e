"""pdctl.units: SGLang/smg command lines, systemd unit files and the service managers.

This package imports nothing of pdctl (an import-linter contract enforces it). It takes its own
small frozen inputs — :class:`ServerLaunch`, :class:`RouterLaunch`, :class:`ServiceSpec`,
:class:`TargetSpec`, :class:`UnitSet` — which ``pdctl.statemachine.launch`` builds from the spec,
and acts on a host through the :class:`HostLike` protocol (``pdctl.statemachine.hosts`` holds
the concrete hosts).

* command lines: :func:`server_argv`, :func:`server_env`, :func:`router_argv`, :func:`router_env`;
* unit files: :func:`render_service`, :func:`render_target`, :func:`render_env_file`,
  :func:`unit_files` (readiness gate and quoting rules in ``_systemd``'s docstring);
* managers behind :class:`ServiceManager`: :class:`SystemdManager` and :class:`ProcessSupervisor`.
"""

from ._argv import router_argv, router_env, server_argv, server_env
from ._host import CommandResultLike, HostLike
from ._manager import OTHER_DEPLOYMENT_HINT, ServiceManager
from ._process import (
    SUPERVISOR_LINE,
    UNIT_DIR_ENV,
    UNIT_ENV,
    ProcessSupervisor,
    parse_env_file,
    process_stopped,
)
from ._process import _proc_starttime as proc_starttime
from ._systemd import (
    MARKER,
    READINESS_GATE,
    env_assignment,
    env_name,
    exec_line,
    exec_word,
    is_pdctl_unit,
    render_env_file,
    render_service,
    render_target,
    unit_files,
)
from ._systemd_manager import SystemdManager, parse_show
from ._types import (
    STATUS_UNWRITTEN,
    SUPERVISOR_STOPPED,
    RouterLaunch,
    ServerLaunch,
    ServiceSpec,
    ServiceStatus,
    TargetSpec,
    UnitSet,
    cpu_list,
    cpu_set,
    pairs,
    unsupervised_reason,
)
from .errors import (
    ForeignUnit,
    ManagerUnavailable,
    ServiceFailed,
    ServiceTimeout,
    UnitDirNotWritable,
    UnitsError,
)

__all__ = [
    "OTHER_DEPLOYMENT_HINT",
    "MARKER",
    "READINESS_GATE",
    "SUPERVISOR_LINE",
    "STATUS_UNWRITTEN",
    "SUPERVISOR_STOPPED",
    "UNIT_DIR_ENV",
    "UNIT_ENV",
    "CommandResultLike",
    "ForeignUnit",
    "HostLike",
    "ManagerUnavailable",
    "ProcessSupervisor",
    "RouterLaunch",
    "ServerLaunch",
    "ServiceFailed",
    "ServiceManager",
    "ServiceSpec",
    "ServiceStatus",
    "ServiceTimeout",
    "SystemdManager",
    "TargetSpec",
    "UnitDirNotWritable",
    "UnitSet",
    "UnitsError",
    "cpu_list",
    "cpu_set",
    "env_assignment",
    "env_name",
    "exec_line",
    "exec_word",
    "is_pdctl_unit",
    "pairs",
    "proc_starttime",
    "parse_env_file",
    "process_stopped",
    "parse_show",
    "render_env_file",
    "render_service",
    "render_target",
    "router_argv",
    "router_env",
    "server_argv",
    "server_env",
    "unit_files",
    "unsupervised_reason",
]
