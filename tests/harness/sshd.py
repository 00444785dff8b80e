"""A real OpenSSH server on loopback for tests (``/usr/sbin/sshd``; scripts/setup installs openssh-server).

``Sshd.start(root)`` writes an ed25519 host key and client key (``ssh-keygen``), an ``authorized_keys`` and a
``known_hosts`` naming ``[127.0.0.1]:PORT``, and an ``sshd_config`` that listens on 127.0.0.1 only, on a free
port, public-key login only, no PAM, then runs ``sshd -D -e`` as a child and waits (bounded) for the port.
``stop()`` ends that one PID. Logins are as the user running the tests (root on CI machines: sshd's
privilege separation needs root, and its ``/run/sshd`` directory, which the harness creates).
``Sshd.skip_reason()`` says why it cannot run here.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"


def _free_port() -> int:
    from harness.sim import free_port

    return free_port()


@dataclass
class Sshd:
    root: Path
    port: int
    proc: subprocess.Popen
    user: str
    client_key: Path
    known_hosts: Path
    wrong_key: Path
    log: Path

    @staticmethod
    def skip_reason() -> str | None:
        if not os.path.exists(SSHD) or not shutil.which("ssh-keygen"):
            return f"needs OpenSSH ({SSHD}, ssh-keygen): apt-get install openssh-server"
        if os.geteuid() != 0:
            return "sshd's privilege separation needs root"
        return None

    @classmethod
    def start(cls, root: Path) -> Sshd:
        root.mkdir(parents=True, exist_ok=True)
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        for name in ("host_ed25519", "client_ed25519", "wrong_ed25519"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)], check=True)
        (root / "authorized_keys").write_text((root / "client_ed25519.pub").read_text())
        port = _free_port()
        hostpub = (root / "host_ed25519.pub").read_text().split()
        known = root / "known_hosts"
        known.write_text(f"[127.0.0.1]:{port} {hostpub[0]} {hostpub[1]}\n")
        config = root / "sshd_config"
        config.write_text(
            f"ListenAddress 127.0.0.1\nPort {port}\nHostKey {root / 'host_ed25519'}\nPidFile {root / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {root / 'authorized_keys'}\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "PermitRootLogin prohibit-password\nUsePAM no\nStrictModes no\nSubsystem sftp internal-sftp\n"
            "MaxSessions 64\nMaxStartups 64:30:128\n"
        )
        subprocess.run([SSHD, "-t", "-f", str(config)], check=True, capture_output=True)
        log = root / "sshd.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None:
                raise RuntimeError(f"sshd exited {proc.returncode}: {log.read_text()[-500:]}")
            time.sleep(0.05)
        else:
            proc.kill()
            raise RuntimeError(f"sshd did not listen on 127.0.0.1:{port} within 10 s")
        return cls(root, port, proc, getpass.getuser(), root / "client_ed25519", known, root / "wrong_ed25519", log)

    def host_spec(self) -> dict:
        """A ``[hosts.NAME]`` table that reaches this sshd."""
        return {"address": "127.0.0.1", "connect": "ssh", "ssh_port": self.port, "ssh_user": self.user,
                "ssh_identity": str(self.client_key), "ssh_known_hosts": str(self.known_hosts)}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
