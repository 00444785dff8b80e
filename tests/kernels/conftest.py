"""Kernel tests: CPU tests run the Triton kernels through Triton's interpreter; ``gpu`` tests need CUDA.

``TRITON_INTERPRET=1`` must be set before Triton builds a kernel, so it is set here, at collection time, unless
``PDCTL_KERNELS_GPU=1`` asks for compiled kernels (the device machine runs ``-m gpu`` that way). The
interpreter computes bf16 ``tl.dot`` wrongly (shared/reference/dependencies.md §9), so CPU tests feed
fp16/fp32/fp8 data; bf16 is covered by the GPU tests.

Without torch (or Triton, or numpy for Triton's interpreter) the modules that need them skip themselves at
collection (``pytest.importorskip``), so the directory collects cleanly on a machine without the kernels' extras.
With ``PDCTL_KERNELS_GPU=1`` a missing torch, Triton or CUDA GPU is a failure instead: the run stops with an error
naming what is missing (``pytest_configure`` below), rather than passing on skips.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

if os.environ.get("PDCTL_KERNELS_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _bootstrap() -> None:
    # A bare checkout (the device machine) has no editable install: map kernels/ to pdctl.kernels by hand.
    try:
        import pdctl.kernels  # noqa: F401

        return
    except ImportError:
        pass
    repo = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo))
    import pdctl

    spec = importlib.util.spec_from_file_location(
        "pdctl.kernels", repo / "kernels" / "__init__.py", submodule_search_locations=[str(repo / "kernels")]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["pdctl.kernels"] = mod
    spec.loader.exec_module(mod)
    pdctl.kernels = mod


_bootstrap()


def _gpu_missing() -> str | None:
    """What a GPU run (``PDCTL_KERNELS_GPU=1``) lacks: torch, Triton or a CUDA GPU; None when all are there."""
    try:
        import torch
    except ImportError as e:
        return f"torch is not importable ({e})"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not importable ({e})"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch"
    return None


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PDCTL_KERNELS_GPU") == "1" and (missing := _gpu_missing()):
        raise pytest.UsageError(f"PDCTL_KERNELS_GPU=1 but {missing}: the kernel tests cannot run here")
