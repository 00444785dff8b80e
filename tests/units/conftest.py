"""Fixtures for the service-manager tests: the real systemd user manager (module-scoped)."""

from __future__ import annotations

import pytest

from harness.systemd import user_systemd_session


@pytest.fixture(scope="module")
def user_systemd(tmp_path_factory):
    """One private systemd user manager per test module, torn down after it."""
    yield from user_systemd_session(tmp_path_factory.mktemp("systemd-user"))


@pytest.fixture
def clean_user_systemd(user_systemd):
    """The shared manager, emptied of pdctl units after the test."""
    yield user_systemd
    user_systemd.reset()
