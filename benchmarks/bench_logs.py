"""What reading a role's log costs as the log grows: `pdctl logs` (the last 50 lines), one `--follow` poll, and the
whole-file read they replaced, on a process-supervisor unit whose ``output.log`` holds SIZE MiB of SGLang-like
request lines (a busy server writes hundreds of MB a day).

For each size: wall time (median of 5) and bytes read from the file, for the tail read (``ProcessSupervisor.logs``),
a follow poll with 20 new lines (``follow_logs``), and the old way (the whole file read and split). Local host only:
over SSH the bytes are what crosses the network. Prints figures; asserts nothing.
Run: ``.venv/bin/python benchmarks/bench_logs.py [SIZE_MIB ...]`` (default 16 256).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from pdctl.units import ProcessSupervisor, ServiceSpec, TargetSpec, UnitSet
from pdctl.units._manager import clean_log_lines

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness.hosts import CountingHost  # noqa: E402  (tests/harness/hosts.py)

LINE = ("[2026-12-05 00:00:00] Decode batch, #running-req: 64, #token: 91234, token usage: 0.41, cuda graph: True, "
        "gen throughput (token/s): 3012.55, #queue-req: 0\n")


def timed(host: CountingHost, fn) -> tuple[float, int]:  # noqa: ANN001
    times, read = [], 0
    for _ in range(5):
        host.read = 0
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        read = host.read
    return statistics.median(times), read


def main(sizes: list[int]) -> None:
    print(f"{'log MiB':>8} {'tail ms':>9} {'tail KiB':>9} {'poll ms':>9} {'poll KiB':>9} {'whole ms':>9} {'whole MiB':>10}")
    for mib in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            host = CountingHost()
            m = ProcessSupervisor(host, state_dir=str(Path(tmp) / "state"))
            s = ServiceSpec(name="pdctl-bench-decode.service", description="bench", argv=("/bin/true",),
                            deployment="bench", role="decode")
            m.install(UnitSet(target=TargetSpec(name="pdctl-bench.target", description="bench", deployment="bench",
                                                wants=(s.name,)), services=(s,)))
            log = Path(tmp) / "state" / "services" / s.name / "output.log"
            chunk = LINE * (2**20 // len(LINE))
            with open(log, "w") as f:
                for _ in range(mib):
                    f.write(chunk)
            tail_s, tail_b = timed(host, lambda: m.logs(s.name, lines=50))
            marks = [m.follow_logs(s.name, None, lines=500)[1]]

            def poll() -> None:
                with open(log, "a") as f:
                    f.write(LINE * 20)
                got, mark, _ = m.follow_logs(s.name, marks[-1], lines=500)
                assert len(got) == 20, len(got)
                marks.append(mark)

            poll_s, poll_b = timed(host, poll)
            whole_s, whole_b = timed(host, lambda: clean_log_lines(host.read_file(str(log)).decode(), 50))
            print(f"{mib:>8} {tail_s * 1e3:>9.2f} {tail_b / 1024:>9.0f} {poll_s * 1e3:>9.2f} {poll_b / 1024:>9.1f} "
                  f"{whole_s * 1e3:>9.0f} {whole_b / 2**20:>10.0f}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [16, 256])
