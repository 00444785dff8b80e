"""The headless path never imports Textual; one module imports pynvml.

Each check runs in a fresh interpreter and reads ``sys.modules`` (harlequin's
``test_import_hygiene``): an import added anywhere on the path shows up here."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "demo.toml"

PROBE = """
import json, sys
{body}
mods = sorted(sys.modules)
sys.stderr.write("\\nIMPORTS " + json.dumps({{"textual": [m for m in mods if m == "textual" or m.startswith("textual.")],
                                     "pynvml": "pynvml" in sys.modules}}) + "\\n")
"""


def _modules(body: str) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE.format(body=body)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("IMPORTS ")]
    assert line, r.stderr[-2000:]
    return json.loads(line[-1][len("IMPORTS ") :])


@pytest.mark.parametrize("argv", [["plan", str(DEMO)], ["validate", str(DEMO)], ["status", str(DEMO), "--json"]])
def test_the_headless_cli_does_not_import_textual(argv, tmp_path):
    body = f"""
from pdctl.console.cli import main
try:
    main({[*argv, "--state-dir", str(tmp_path)] if argv[0] != "validate" else argv!r})
except SystemExit:
    pass
"""
    got = _modules(body)
    assert got["textual"] == []
    assert got["pynvml"] is False


def test_the_console_data_modules_do_not_import_textual():
    got = _modules("import pdctl.console, pdctl.console.telemetry, pdctl.console.metrics, pdctl.console.views, pdctl.console.collect")
    assert got == {"textual": [], "pynvml": False}  # pynvml only on the first NVML read


def test_the_console_command_does_import_textual():
    """The check above is not vacuous: the app does pull Textual in."""
    assert _modules("import pdctl.console.app")["textual"]


def test_only_the_telemetry_module_imports_pynvml():
    importers = []
    for folder in ("console", "statemachine", "units", "sim", "kernels", "pdctl"):
        for p in (ROOT / folder).rglob("*.py"):
            if re.search(r"^\s*(import pynvml|from pynvml)", p.read_text(errors="replace"), re.M):
                importers.append(str(p.relative_to(ROOT)))
    assert importers == ["console/telemetry.py"]


@pytest.mark.parametrize("argv", [["console", str(DEMO)], [str(DEMO), "--readonly"]])
def test_the_console_without_a_terminal_refuses_at_once(argv, tmp_path):
    # (it ran on forever, Textual writing escape sequences into the pipe and waiting on keys that never came)
    r = subprocess.run([sys.executable, "-m", "pdctl", *argv, "--state-dir", str(tmp_path / "st")], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 64 and "the console needs a terminal" in r.stderr and "pdctl status" in r.stderr, r.stderr
    assert r.stdout == "" and not (tmp_path / "st").exists()


def test_the_console_refuses_when_its_stderr_is_no_terminal_and_runs_with_stdout_redirected(tmp_path):
    # Textual draws on stderr: `pdctl console SPEC 2>err.log` at a terminal wrote the UI into err.log and waited on
    # keys; `pdctl console SPEC > out.txt` draws fine on the terminal's stderr
    import os
    import pty

    main_fd, tty = pty.openpty()
    try:
        with open(tmp_path / "err.log", "w") as err:
            r = subprocess.run([sys.executable, "-m", "pdctl", "console", str(DEMO), "--state-dir", str(tmp_path / "st")],
                               stdin=tty, stdout=tty, stderr=err, timeout=60, cwd=ROOT)
        assert r.returncode == 64
        assert "the console needs a terminal (stdin and stderr)" in (tmp_path / "err.log").read_text()
        p = subprocess.Popen([sys.executable, "-m", "pdctl", "console", str(DEMO), "--state-dir", str(tmp_path / "st2")],
                             stdin=tty, stdout=subprocess.DEVNULL, stderr=tty, cwd=ROOT)
        try:
            with pytest.raises(subprocess.TimeoutExpired):  # the console runs (drawing on the pty) until told to quit
                p.wait(5)
        finally:
            p.kill()
            p.wait(10)
    finally:
        os.close(main_fd)
        os.close(tty)


def test_the_console_in_the_background_of_its_terminal_refuses_at_once(tmp_path):
    # Under `timeout` (its own process group) or `&`, Textual set the terminal up, was stopped by SIGTTOU and drew
    # nothing until killed (a fresh user: `script -qec "timeout 20 pdctl console SPEC"`). It now refuses: exit 64.
    script = tmp_path / "bg.py"
    script.write_text(
        "import os, pty, sys, time\n"
        "pid, fd = pty.fork()\n"
        "if pid == 0:  # the session leader, the pty its controlling terminal, in the foreground\n"
        "    child = os.fork()\n"
        "    if child == 0:\n"
        "        os.setpgid(0, 0)  # a process group of its own: the background of the terminal\n"
        f"        os.execv(sys.executable, [sys.executable, '-m', 'pdctl', 'console', {str(DEMO)!r}, '--state-dir', "
        f"{str(tmp_path / 'st')!r}])\n"
        "    _, status = os.waitpid(child, 0)\n"
        "    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)\n"
        "out = b''\n"
        "deadline = time.monotonic() + 60\n"
        "while time.monotonic() < deadline:\n"
        "    try:\n"
        "        chunk = os.read(fd, 4096)\n"
        "    except OSError:\n"
        "        break\n"
        "    if not chunk:\n"
        "        break\n"
        "    out += chunk\n"
        "_, status = os.waitpid(pid, 0)\n"
        "sys.stdout.write(out.decode(errors='replace'))\n"
        "sys.exit(os.waitstatus_to_exitcode(status))\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert r.returncode == 64, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "runs in the background" in r.stdout and "timeout --foreground" in r.stdout, r.stdout
    assert "\x1b[?1049h" not in r.stdout  # (the alternate screen was never entered)
