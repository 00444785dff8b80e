"""The layers hold: units, kernels and sim import nothing of pdctl; the engine never imports the
console, textual or rich (import-linter contracts in pyproject.toml), and the headless path
(`pdctl plan`) loads no Textual at run time either."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _layout_tree(tmp: Path) -> Path:
    """A tree where ``pdctl/`` holds the mapped folders, as an installed wheel would."""
    pkg = tmp / "tree" / "pdctl"
    pkg.mkdir(parents=True)
    for f in (ROOT / "pdctl").glob("*.py"):
        (pkg / f.name).symlink_to(f)
    for sub in ("console", "statemachine", "kernels", "units", "sim"):
        (pkg / sub).symlink_to(ROOT / sub, target_is_directory=True)
    return pkg.parent


def test_import_linter_contracts_hold(tmp_path):
    import os

    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    tree = _layout_tree(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    r = subprocess.run(
        [exe, "--no-cache", "--config", str(ROOT / "pyproject.toml")],
        cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Contracts: 3 kept, 0 broken." in r.stdout


def test_the_engine_imports_without_textual_or_torch():
    code = (
        "import sys, pdctl.statemachine.service, pdctl.statemachine.steps, pdctl.statemachine.plan;"
        # (rich is not listed: httpx imports it for its own CLI whenever it is installed.)
        "bad = sorted(m for m in ('textual', 'pdctl.console', 'torch', 'triton', 'pynvml') if m in sys.modules);"
        "print(','.join(bad))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""
