"""The ``pdctl`` command line (typer). A thin shell over :mod:`pdctl.statemachine.service`.

stdout carries data (plans, JSON, JSON-lines events); stderr carries diagnostics for people.
Exit codes are documented in :mod:`pdctl.console.exit_codes` and in ``pdctl --help``.

``pdctl --apply SPEC`` is ``pdctl apply SPEC``; ``pdctl SPEC`` opens the console.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from pdctl.console.exit_codes import ExitCode, exit_code_for
from pdctl.statemachine.errors import PdctlError

EXIT_HELP = (
    "Exit codes: 0 ok / no changes; 1 error; 2 changes present (plan) or topology change refused "
    "(apply); 3 a step failed; 4 deployment locked; 64 usage; 130 interrupted."
)

app = typer.Typer(
    name="pdctl",
    help="Plan, deploy and prove SGLang prefill-decode (PD) disaggregated deployments.\n\n" + EXIT_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

SpecArg = Annotated[Path, typer.Argument(help="Deployment spec (TOML), e.g. examples/demo.toml")]
StateDirOpt = Annotated[
    Optional[Path],
    typer.Option("--state-dir", envvar="PDCTL_STATE_DIR", help="Journal directory (default per service scope)"),
]


def _err(msg: str) -> None:
    sys.stderr.write(msg.rstrip("\n") + "\n")


def _warnings(loaded) -> None:  # noqa: ANN001
    for w in loaded.warnings:
        _err(f"warning: {w.field}: {w.message}\n  fix: {w.fix}")


@app.command()
def validate(spec: SpecArg) -> None:
    """Check SPEC against pdctl's rules. Contacts no host, changes nothing."""
    from pdctl.statemachine.service import load

    loaded = load(spec)
    _warnings(loaded)
    _err(f"{spec}: valid ({len(loaded.warnings)} warning(s))")


@app.command()
def plan(
    spec: SpecArg,
    state_dir: StateDirOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON")] = False,
    out: Annotated[Optional[Path], typer.Option("-o", "--out", help="Save the plan to FILE (JSON)")] = None,
) -> None:
    """Show what applying SPEC would change. Exit 0: no changes; 2: changes; 1: error."""
    from pdctl.statemachine.plan import render_text
    from pdctl.statemachine.service import load, plan_spec

    loaded = load(spec, state_dir=state_dir)
    _warnings(loaded)
    p = plan_spec(loaded)
    if out is not None:
        from pdctl.statemachine.journal import atomic_write

        atomic_write(out, p.model_dump_json(indent=1).encode())
        _err(f"plan saved to {out}")
    if as_json:
        sys.stdout.write(p.model_dump_json(indent=1) + "\n")
    else:
        sys.stdout.write(render_text(p) + "\n")
    raise typer.Exit(ExitCode.CHANGES if p.has_changes else ExitCode.OK)


def _rewrite(argv: list[str]) -> list[str]:
    """``--apply X`` → ``apply X``; a bare spec path → ``console SPEC``."""
    if argv and argv[0] == "--apply":
        return ["apply", *argv[1:]]
    if argv and not argv[0].startswith("-") and argv[0] not in _command_names() and argv[0].endswith((".toml", ".json")):
        return ["console", *argv]
    return argv


def _command_names() -> set[str]:
    return {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands}  # type: ignore[union-attr]


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: runs the app and maps errors to exit codes."""
    import click

    args = _rewrite(list(sys.argv[1:] if argv is None else argv))
    try:
        rc = app(args=args, prog_name="pdctl", standalone_mode=False)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.UsageError as e:
        e.show(file=sys.stderr)
        sys.exit(ExitCode.USAGE)
    except click.Abort:
        sys.exit(ExitCode.INTERRUPTED)
    except PdctlError as e:
        _err(f"error: {e}")
        sys.exit(exit_code_for(e))
    except KeyboardInterrupt:
        sys.exit(ExitCode.INTERRUPTED)
    sys.exit(rc if isinstance(rc, int) else ExitCode.OK)


_ = json  # used by commands added below
