"""Kernel tests: CPU tests run the Triton kernels through Triton's interpreter; ``gpu`` tests need CUDA.

``TRITON_INTERPRET=1`` must be set before Triton builds a kernel, so it is set here, at collection time, unless
``PDCTL_KERNELS_GPU=1`` asks for compiled kernels (the device machine runs ``-m gpu`` that way). The
interpreter computes bf16 ``tl.dot`` wrongly (shared/reference/dependencies.md §9), so CPU tests feed
fp16/fp32/fp8 data; bf16 is covered by the GPU tests.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

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
