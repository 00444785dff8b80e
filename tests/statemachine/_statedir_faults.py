"""Driver of ``test_statedir_faults.py``, run as root inside a private mount namespace (``unshare -m --propagation
private``): a small tmpfs is the state directory's file system, made full (filled with ``dd``) or read-only
(``mount -o remount,ro``), and the pdctl CLI runs against it as a user would run it. Prints one JSON report on its
last line. Nothing here mocks a write: the kernel refuses them.

Argument: a JSON object — ``mount`` (an empty folder), ``size`` (tmpfs ``size=``), ``name`` (the deployment),
``spec``, ``fault`` (``full`` or ``ro``), ``mode``:

* ``before``: a journal is written with pdctl's own :class:`Journal` (as an earlier run leaves it), the fault made,
  then each of ``commands`` (pdctl argument lists, ``{state}`` replaced) run with a bound; reported per command: exit
  code, seconds, stderr; and the files under the mount and the journal's SHA-256 before and after.
* ``during``: ``pdctl apply --json SPEC`` runs, and the fault is made once the prefill's supervisor has started its
  process (its ``main.pid`` appears, polled every 10 ms); reported: the events, the exit code, seconds from the fault
  to the exit, stderr, which PIDs its message names are alive after it, the journal's parse; then the fill is removed
  and ``pdctl down --yes`` run (its exit code reported), so that nothing of it outlives the namespace.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time

BOUND_S = 60
"""The most any one pdctl command is given here (the test asserts its own, tighter, bound on what is reported)."""


def main() -> None:
    args = json.loads(sys.argv[1])
    mnt = args["mount"]
    state = os.path.join(mnt, "state")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args['size']}", "tmpfs", mnt], check=True)
    env = {**os.environ, "PDCTL_STATE_DIR": state, **args.get("env", {})}
    journal = os.path.join(state, "journal.json")
    report: dict = {}

    def fault() -> None:
        if args["fault"] == "full":
            subprocess.run(["dd", "if=/dev/zero", f"of={mnt}/fill", "bs=4k"], stderr=subprocess.DEVNULL, check=False)
        else:
            subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)

    if args["mode"] == "before":
        from pdctl.statemachine.journal import Journal, JournalState

        j = Journal(state, args["name"])
        j.write(JournalState(name=args["name"]))
        j.audit("apply-done", plan_id="earlier")
        report["journal_before"] = _digest(journal)
        report["files_before"] = _files(mnt)
        fault()
        report["commands"] = []
        for argv in args["commands"]:
            argv = [a.replace("{state}", state) for a in argv]
            t0 = time.monotonic()
            p = subprocess.run([sys.executable, "-m", "pdctl", *argv], capture_output=True, text=True, env=env,
                               timeout=BOUND_S)
            report["commands"].append({"argv": argv, "rc": p.returncode, "took_s": time.monotonic() - t0,
                                       "stderr": p.stderr})
        report["files_after"] = _files(mnt)
        report["journal_after"] = _digest(journal)
    else:
        p = subprocess.Popen([sys.executable, "-m", "pdctl", "apply", args["spec"], "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        faulted: list[float] = []

        def trigger() -> None:
            pattern = os.path.join(state, "supervisor", "services", "*-prefill.service", "main.pid")
            while p.poll() is None:
                if glob.glob(pattern):
                    fault()
                    faulted.append(time.monotonic())
                    return
                time.sleep(0.01)

        threading.Thread(target=trigger, daemon=True).start()
        try:
            out, err = p.communicate(timeout=BOUND_S * 5)
        finally:
            if p.poll() is None:
                p.kill()
                out, err = p.communicate()
        ended = time.monotonic()
        report["rc"] = p.returncode
        report["stderr"] = err
        report["events"] = [json.loads(line) for line in out.splitlines() if line.strip()]
        report["fault_to_exit_s"] = ended - faulted[0] if faulted else None
        named = [int(pid) for pid in re.findall(r"PID (\d+)", err)]
        report["named_pids_alive"] = {pid: os.path.exists(f"/proc/{pid}") for pid in named}
        try:
            with open(journal) as f:
                report["journal"] = json.load(f)
        except (OSError, ValueError) as exc:
            report["journal"] = f"unreadable: {exc}"
        report["lock"] = _read(os.path.join(state, "lock"))
        report["temp_files"] = [f for f, _ in _files(mnt) if f.endswith(".tmp")]
        if os.path.exists(os.path.join(mnt, "fill")):
            os.remove(os.path.join(mnt, "fill"))
        d = subprocess.run([sys.executable, "-m", "pdctl", "down", args["spec"], "--yes"], capture_output=True,
                           text=True, env=env, timeout=BOUND_S)
        report["down_rc"], report["down_stderr"] = d.returncode, d.stderr
    print(json.dumps(report))


def _digest(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _files(top: str) -> list[tuple[str, int]]:
    return sorted((os.path.relpath(os.path.join(r, f), top), os.path.getsize(os.path.join(r, f)))
                  for r, _, fs in os.walk(top) for f in fs)


if __name__ == "__main__":
    main()
