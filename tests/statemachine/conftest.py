"""Fixtures for end-to-end deployments (harness.deploy.Demo): the demo spec on free ports, under the
process supervisor, with the SGLang stand-in and the real smg router. Every deployment is taken
down afterwards."""

from __future__ import annotations

import pytest

from harness.deploy import Demo

__all__ = ["Demo"]


@pytest.fixture
def demo(tmp_path):
    d = Demo(tmp_path)
    yield d
    d.down()


@pytest.fixture
def make_demo(tmp_path):
    made: list[Demo] = []

    def make(mutate=None) -> Demo:  # noqa: ANN001
        sub = tmp_path / f"d{len(made)}"
        sub.mkdir()
        d = Demo(sub, mutate)
        made.append(d)
        return d

    yield make
    for d in made:
        d.down()
