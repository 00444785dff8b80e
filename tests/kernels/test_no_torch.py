"""The kernel package and tests on a machine without the kernels' extras (no torch, no Triton): this module imports
neither. The checks run pytest or Python in a subprocess whose path puts stand-in ``torch`` and ``triton`` packages
first that raise ``ModuleNotFoundError`` on import, as a machine without them does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture
def no_torch_env(tmp_path):
    shim = tmp_path / "shim"
    for name in ("torch", "triton"):
        (shim / name).mkdir(parents=True)
        (shim / name / "__init__.py").write_text(f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PDCTL_KERNELS_GPU", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), env.get("PYTHONPATH", "")) if p)
    return env


def _pytest(env, *args):
    return subprocess.run([sys.executable, "-m", "pytest", str(HERE), "-p", "no:cacheprovider", "-q", *args],
                          capture_output=True, text=True, env=env, cwd=HERE.parents[1], timeout=240)


def test_importing_the_package_imports_neither_torch_nor_triton(no_torch_env):
    code = ("import sys, pdctl.kernels as k; k.__all__; from pdctl.kernels import sglang_plugin; "
            "print('torch' in sys.modules, 'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=no_torch_env,
                         cwd=HERE.parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_the_kernel_tests_collect_and_skip_cleanly_without_torch(no_torch_env):
    r = _pytest(no_torch_env, "--collect-only")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "error" not in r.stdout.lower(), r.stdout[-2000:]
    # every module that needs torch skipped itself at collection, and this module's tests were collected
    for mod in sorted(HERE.glob("test_*.py")):
        if mod.name != Path(__file__).name:
            assert f"SKIPPED [1] tests/kernels/{mod.name}" in r.stdout, (mod.name, r.stdout[-2000:])
    assert "3 tests collected" in r.stdout, r.stdout[-2000:]


def test_the_kernel_tests_fail_without_torch_when_a_gpu_run_is_asked_for(no_torch_env):
    r = _pytest({**no_torch_env, "PDCTL_KERNELS_GPU": "1"}, "--collect-only")
    assert r.returncode != 0
    assert "PDCTL_KERNELS_GPU=1 but torch is not importable" in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
