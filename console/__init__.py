"""pdctl.console: the ``pdctl`` command line and the Textual console.

The headless path (``pdctl plan/apply/status``) imports :mod:`pdctl.console.cli` and never
Textual: the app (:mod:`pdctl.console.app`) and its panels are imported only by the ``console``
command. The data side of the console — :mod:`~pdctl.console.telemetry` (the only importer of
``pynvml``), :mod:`~pdctl.console.metrics`, :mod:`~pdctl.console.views` and
:mod:`~pdctl.console.collect` — imports no Textual either.
"""

__all__ = ["ConsoleApp", "run_console"]


def __getattr__(name: str):  # noqa: ANN202 - lazy: importing pdctl.console must not import Textual
    if name in __all__:
        from pdctl.console import app

        return getattr(app, name)
    raise AttributeError(name)
