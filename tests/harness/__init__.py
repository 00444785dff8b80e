"""Test harnesses: engines and routers (``sim``), the demo deployment (``deploy``), a real
systemd user manager (``systemd``). ``skip_or_fail`` turns a missing piece of the test machine into
a failure under CI (``CI`` set), where scripts/setup must have installed it."""

import os


def skip_or_fail(reason: str) -> None:
    """``pytest.skip`` on a developer's machine; ``pytest.fail`` under CI, so a broken set-up
    cannot pass as skipped tests."""
    import pytest

    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must provide it: see scripts/setup)")
    pytest.skip(reason)
