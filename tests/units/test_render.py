"""Golden unit files for examples/seed.toml, systemd quoting, and ``systemd-analyze verify``.

The golden files were written by hand from the seed (GPUs, NUMA nodes and CPU lists, ports,
backend) and the unit design (readiness gate, restart limits, timeouts, memlock for NIXL), with
the argv from test_argv's hand-derived lists. ``systemd-analyze verify`` runs on them in a fake
root with stub executables at the ExecStart paths, and the test fails on any output at all, not
only on a non-zero exit (unknown keys are warnings with exit 0).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from pdctl.statemachine.launch import services_for, unit_set_for, write_units
from pdctl.statemachine.spec import load_spec, parse_spec
from pdctl.units import (
    MARKER,
    ForeignUnit,
    ServiceSpec,
    env_assignment,
    exec_word,
    is_pdctl_unit,
    render_env_file,
    render_service,
    unit_files,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

GATE = (
    '"import sys,time,urllib.request as r\\n'
    "o=r.build_opener(r.ProxyHandler({}));d=time.monotonic()+float(sys.argv[2])\\n"
    "while time.monotonic()<d:\\n"
    " try:o.open(sys.argv[1],timeout=5);sys.exit(0)\\n"
    " except Exception:time.sleep(1)\\n"
    'sys.exit(1)"'
)

SERVER_COMMON = (
    "/opt/sglang/.venv/bin/python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V4-Flash "
    "--served-model-name deepseek-v4-flash --context-length 131072 --kv-cache-dtype fp8_e4m3 "
    "--trust-remote-code --attention-backend dsv4 --tp-size 4 --base-gpu-id 0 --host 127.0.0.1"
)
PARSERS = "--mem-fraction-static 0.85 --reasoning-parser deepseek-v4 --tool-call-parser deepseekv4 --enable-metrics"

GOLDEN_PREFILL = f"""\
# pdctl-managed: deployment=dsv4-flash role=prefill
# Written by pdctl, which rewrites or removes this file: change the spec, not this file.
[Unit]
Description=pdctl dsv4-flash prefill (SGLang prefill server)
PartOf=pdctl-dsv4-flash.target
Wants=network-online.target
After=network-online.target
StartLimitIntervalSec=9030
StartLimitBurst=3

[Service]
Type=exec
ExecStart={SERVER_COMMON} --port 30010 --nccl-port 30110 --disaggregation-mode prefill \
--disaggregation-transfer-backend nixl --disaggregation-bootstrap-port 8998 {PARSERS}
ExecStartPost=/opt/sglang/.venv/bin/python -c {GATE} http://127.0.0.1:30010/health 3000
Environment=CUDA_DEVICE_ORDER=PCI_BUS_ID
Environment=CUDA_VISIBLE_DEVICES=0,1,2,3
Environment=SGLANG_CACHE_DIR=/var/cache/sglang
Environment=SGLANG_PLUGINS=pdctl_kernels
Environment=PDCTL_KERNELS_DIR=/var/cache/sglang
Environment=PDCTL_KERNELS_ROUTE=decode,indexer
Environment=PDCTL_KERNELS_REQUIRED=1
Environment=TRITON_CACHE_DIR=/var/cache/sglang/triton
SyslogIdentifier=pdctl-dsv4-flash-prefill
NUMAPolicy=bind
NUMAMask=0
CPUAffinity=0-31,64-95
LimitMEMLOCK=infinity
Restart=on-failure
RestartSec=10
RestartPreventExitStatus=2
TimeoutStartSec=3000
TimeoutStopSec=120
KillMode=control-group
"""

GOLDEN_DECODE = f"""\
# pdctl-managed: deployment=dsv4-flash role=decode
# Written by pdctl, which rewrites or removes this file: change the spec, not this file.
[Unit]
Description=pdctl dsv4-flash decode (SGLang decode server)
PartOf=pdctl-dsv4-flash.target
Wants=network-online.target
After=network-online.target
StartLimitIntervalSec=9030
StartLimitBurst=3

[Service]
Type=exec
ExecStart={SERVER_COMMON} --port 30020 --nccl-port 30120 --disaggregation-mode decode \
--disaggregation-transfer-backend nixl {PARSERS}
ExecStartPost=/opt/sglang/.venv/bin/python -c {GATE} http://127.0.0.1:30020/health 3000
Environment=CUDA_DEVICE_ORDER=PCI_BUS_ID
Environment=CUDA_VISIBLE_DEVICES=4,5,6,7
Environment=SGLANG_CACHE_DIR=/var/cache/sglang
Environment=SGLANG_PLUGINS=pdctl_kernels
Environment=PDCTL_KERNELS_DIR=/var/cache/sglang
Environment=PDCTL_KERNELS_ROUTE=decode,indexer
Environment=PDCTL_KERNELS_REQUIRED=1
Environment=TRITON_CACHE_DIR=/var/cache/sglang/triton
SyslogIdentifier=pdctl-dsv4-flash-decode
NUMAPolicy=bind
NUMAMask=1
CPUAffinity=32-63,96-127
LimitMEMLOCK=infinity
Restart=on-failure
RestartSec=10
RestartPreventExitStatus=2
TimeoutStartSec=3000
TimeoutStopSec=120
KillMode=control-group
"""

GOLDEN_ROUTER = f"""\
# pdctl-managed: deployment=dsv4-flash role=router
# Written by pdctl, which rewrites or removes this file: change the spec, not this file.
[Unit]
Description=pdctl dsv4-flash router (smg)
PartOf=pdctl-dsv4-flash.target
Wants=network-online.target
Wants=pdctl-dsv4-flash-prefill.service pdctl-dsv4-flash-decode.service
After=network-online.target pdctl-dsv4-flash-prefill.service pdctl-dsv4-flash-decode.service
StartLimitIntervalSec=1525
StartLimitBurst=5

[Service]
Type=exec
ExecStart=/opt/sglang/.venv/bin/smg launch --pd-disaggregation --prefill http://127.0.0.1:30010 8998 \
--decode http://127.0.0.1:30020 --host 0.0.0.0 --port 30001 --policy cache_aware --prometheus-host 127.0.0.1 \
--prometheus-port 29000 --health-check-interval-secs 10 --health-check-timeout-secs 5 --health-failure-threshold 3 \
--health-success-threshold 2 --worker-startup-timeout-secs 3600
ExecStartPost=/opt/sglang/.venv/bin/python -c {GATE} http://127.0.0.1:30001/readiness 300
SyslogIdentifier=pdctl-dsv4-flash-router
Restart=on-failure
RestartSec=1
RestartPreventExitStatus=2
TimeoutStartSec=300
TimeoutStopSec=210
KillMode=control-group
"""

GOLDEN_TARGET = """\
# pdctl-managed: deployment=dsv4-flash role=target
# Written by pdctl, which rewrites or removes this file: change the spec, not this file.
[Unit]
Description=pdctl deployment dsv4-flash
Wants=pdctl-dsv4-flash-prefill.service pdctl-dsv4-flash-decode.service pdctl-dsv4-flash-router.service

[Install]
WantedBy=multi-user.target
"""

GOLDEN = {
    "pdctl-dsv4-flash-prefill.service": GOLDEN_PREFILL,
    "pdctl-dsv4-flash-decode.service": GOLDEN_DECODE,
    "pdctl-dsv4-flash-router.service": GOLDEN_ROUTER,
    "pdctl-dsv4-flash.target": GOLDEN_TARGET,
}


@pytest.fixture(scope="module")
def seed():
    return load_spec(EXAMPLES / "seed.toml")


# -- golden --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(GOLDEN))
def test_seed_unit_is_the_golden_one(seed, name):
    files = unit_files(unit_set_for(seed), scope="system")
    assert list(files) == list(GOLDEN)
    assert files[name] == GOLDEN[name]


def test_write_units_writes_the_golden_files(seed, tmp_path):
    paths = write_units(seed, tmp_path / "out")
    assert [p.name for p in paths] == list(GOLDEN)
    for p in paths:
        assert p.read_text() == GOLDEN[p.name]
        assert stat.S_IMODE(p.stat().st_mode) == 0o644


def test_write_units_refuses_a_foreign_file_and_writes_nothing(seed, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "pdctl-dsv4-flash-router.service").write_text("[Service]\nExecStart=/bin/true\n")
    with pytest.raises(ForeignUnit, match="not written by pdctl"):
        write_units(seed, out)
    assert sorted(p.name for p in out.iterdir()) == ["pdctl-dsv4-flash-router.service"]
    assert (out / "pdctl-dsv4-flash-router.service").read_text() == "[Service]\nExecStart=/bin/true\n"


def test_write_units_rewrites_its_own_files(seed, tmp_path):
    write_units(seed, tmp_path)
    (tmp_path / "pdctl-dsv4-flash.target").write_text(MARKER + " stale\n")
    write_units(seed, tmp_path)
    assert (tmp_path / "pdctl-dsv4-flash.target").read_text() == GOLDEN_TARGET


def test_secrets_go_to_a_0600_environment_file_never_into_the_unit(tmp_path):
    dep = parse_spec({
        "name": "sec", "service_manager": "systemd-system", "model": {"path": "m"},
        "engine": {"env": {"HF_TOKEN": "hf_s3cret", "PLAIN": "1"}},
        "prefill": [{"gpus": [0], "port": 1000}], "decode": [{"gpus": [1], "port": 1010}],
        "router": {"port": 1030, "env": {"SMG_API_KEY": "k3y"}},
    })
    files = {p.name: p for p in write_units(dep, tmp_path)}
    assert set(files) >= {"prefill.env", "decode.env", "router.env"}
    for name, p in files.items():
        text = p.read_text()
        if name.endswith(".env"):
            assert stat.S_IMODE(p.stat().st_mode) == 0o600
        else:
            assert "hf_s3cret" not in text and "k3y" not in text
    assert "EnvironmentFile=/etc/pdctl/sec/prefill.env" in files["pdctl-sec-prefill.service"].read_text()
    assert "Environment=PLAIN=1" in files["pdctl-sec-prefill.service"].read_text()
    assert "HF_TOKEN='hf_s3cret'" in files["prefill.env"].read_text()
    assert "SMG_API_KEY='k3y'" in files["router.env"].read_text()


# -- quoting -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "quoted"), [
    ("--port", "--port"),
    ("http://127.0.0.1:30010/health", "http://127.0.0.1:30010/health"),
    ("", '""'),
    ("a b", '"a b"'),
    ('say "hi"', '"say \\"hi\\""'),
    ("100%", "100%%"),
    ("$HOME", "$$HOME"),
    ("a\\b", '"a\\\\b"'),
    ("two\nlines", '"two\\nlines"'),
    ("tab\there", '"tab\\there"'),
    ("bell\x07", '"bell\\x07"'),
    ("it's", '"it\'s"'),
    (";", '";"'),
    ('{"0":"mlx5_0"}', '"{\\"0\\":\\"mlx5_0\\"}"'),
])
def test_exec_word_quotes_by_systemds_rules(raw, quoted):
    assert exec_word(raw) == quoted


def test_environment_assignment_doubles_percent_but_not_dollar():
    assert env_assignment("A", "1") == "A=1"
    assert env_assignment("A", "50%") == "A=50%%"
    assert env_assignment("A", "$x y") == '"A=$x y"'
    with pytest.raises(ValueError):
        env_assignment("BAD-NAME", "1")
    with pytest.raises(ValueError):
        env_assignment("A", "nul\x00")


def test_env_file_uses_single_quotes_or_escaped_double_quotes():
    text = render_env_file([("A", "plain $x"), ("B", "it's \"q\" $y `z` \\")], deployment="d")
    assert text.splitlines()[0].startswith(MARKER)
    assert "A='plain $x'" in text
    assert 'B="it\'s \\"q\\" \\$y \\`z\\` \\\\"' in text


def test_a_relative_executable_is_refused():
    with pytest.raises(ValueError, match="absolute"):
        ServiceSpec(name="x.service", description="x", argv=("python",), deployment="d", role="r")


def test_marker_identifies_pdctl_files():
    assert is_pdctl_unit(MARKER + " deployment=x role=y\n[Unit]\n")
    assert not is_pdctl_unit("[Unit]\nDescription=someone else's\n")
    assert not is_pdctl_unit(b"")


def test_user_scope_has_no_network_online_and_targets_default():
    dep = load_spec(EXAMPLES / "demo.toml")
    files = unit_files(unit_set_for(dep, scope="user"), scope="user")
    assert "network-online" not in "".join(files.values())
    assert "WantedBy=default.target" in files["pdctl-demo.target"]


def test_log_path_appends_output_to_a_file(tmp_path):
    dep = load_spec(EXAMPLES / "demo.toml")
    svc = services_for(dep, scope="user", log_dir=tmp_path)[0]
    assert f"StandardOutput=append:{tmp_path}/pdctl-demo-prefill.log" in render_service(svc, scope="user")


# -- systemd-analyze verify ----------------------------------------------------------------------

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


def _fake_root(root: Path, files: dict[str, str]) -> Path:
    unit_dir = root / "etc" / "systemd" / "system"
    unit_dir.mkdir(parents=True)
    for name, text in files.items():
        (unit_dir / name).write_text(text)
        for line in text.splitlines():
            if line.startswith(("ExecStart=", "ExecStartPost=")):
                exe = root / line.split("=", 1)[1].split(" ", 1)[0].lstrip("/")
                exe.parent.mkdir(parents=True, exist_ok=True)
                exe.write_text("#!/bin/sh\nexit 0\n")
                exe.chmod(0o755)
    return root


def _verify(root: Path, name: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["systemd-analyze", "verify", "--man=no", "--recursive-errors=no", f"--root={root}", name],
        capture_output=True, text=True, timeout=60, env={**os.environ, "SYSTEMD_LOG_COLOR": "0"},
    )


@needs_analyze
@pytest.mark.parametrize("name", list(GOLDEN))
def test_seed_units_verify_clean_with_no_warning(seed, tmp_path, name):
    root = _fake_root(tmp_path / "root", unit_files(unit_set_for(seed), scope="system"))
    r = _verify(root, name)
    assert (r.returncode, r.stdout.strip(), r.stderr.strip()) == (0, "", "")


@needs_analyze
def test_verify_catches_what_our_check_must_catch(tmp_path):
    """Control: a misspelt key prints a warning (whatever the exit status — with no other fault
    it exits 0) and a missing executable fails: the check above sees both."""
    root = _fake_root(tmp_path / "root", {"x.service": "[Service]\nType=exec\nExecStart=/opt/x/bin/x\nEnviroment=A=1\n"})
    r = _verify(root, "x.service")
    assert "Unknown key 'Enviroment'" in r.stderr
    (root / "opt/x/bin/x").unlink()
    assert _verify(root, "x.service").returncode != 0


@needs_analyze
def test_demo_and_secret_bearing_units_verify_clean(tmp_path):
    dep = parse_spec({
        "name": "sec", "model": {"path": "m", "kv_cache_dtype": "auto"},
        "engine": {"env": {"HF_TOKEN": "x", "WEIRD": "a b $c 50% \"d\" \\e"}},
        "prefill": [{"gpus": [0], "port": 1000, "extra_args": ["--json-model-override-args", '{"a": 1}']}],
        "decode": [{"gpus": [1], "port": 1010}], "router": {"port": 1030},
    })
    files = unit_files(unit_set_for(dep, scope="system"), scope="system")
    root = _fake_root(tmp_path / "root", files)
    (root / "etc/pdctl/sec").mkdir(parents=True)
    for n in ("prefill", "decode"):
        (root / f"etc/pdctl/sec/{n}.env").write_text("HF_TOKEN='x'\n")
    for name in files:
        r = _verify(root, name)
        assert (r.returncode, r.stdout.strip(), r.stderr.strip()) == (0, "", ""), name


def test_secrets_never_print():
    s = ServiceSpec(name="x.service", description="x", argv=("/bin/true",), deployment="d", role="r",
                    secrets={"HF_TOKEN": "hf_s3cret"}, secrets_file="/etc/pdctl/d/r.env")
    assert "hf_s3cret" not in repr(s) and "hf_s3cret" not in str(s.to_json())
    assert s.to_json(reveal_secrets=True)["secrets"] == [["HF_TOKEN", "hf_s3cret"]]


def test_units_imports_nothing_of_pdctl():
    import subprocess
    import sys

    code = ("import sys, pdctl.units, pdctl.units.supervise; "
            "print(sorted(m for m in sys.modules if m.startswith('pdctl.') and not m.startswith('pdctl.units')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_pdctl_units_command_writes_the_golden_files(tmp_path):
    import sys

    out = tmp_path / "units"
    r = subprocess.run([sys.executable, "-m", "pdctl", "units", str(EXAMPLES / "seed.toml"), "-o", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert [Path(line).name for line in r.stdout.split()] == list(GOLDEN)
    assert {p.name: p.read_text() for p in out.iterdir()} == GOLDEN


def test_pdctl_units_command_refuses_a_file_as_the_output_directory(tmp_path):
    # A file (or a device: /dev/null) where the folder should be is a path the units cannot be written to, as `plan -o`
    # calls a folder: exit 1 with the error and hint of any unwritable -o (it was a usage error, exit 64: "dir
    # 'not-a-dir' is a file"; -o /dev/null said "File exists"). A link to a folder is written through, the link kept.
    import os
    import sys

    f = tmp_path / "not-a-dir"
    f.write_text("keep me\n")
    for odd in (f, "/dev/null"):
        r = subprocess.run([sys.executable, "-m", "pdctl", "units", str(EXAMPLES / "seed.toml"), "-o", str(odd)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and r.stdout == "", r.stderr
        assert r.stderr == (f"error: -o {odd}: cannot write the units there: Not a directory; nothing on any host "
                            "changed\n  hint: give -o/--out a path this user can write: a directory path, e.g. -o "
                            "./units\n"), r.stderr
    assert f.read_text() == "keep me\n" and [p.name for p in tmp_path.iterdir()] == ["not-a-dir"]
    (tmp_path / "folder").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "folder")
    r = subprocess.run([sys.executable, "-m", "pdctl", "units", str(EXAMPLES / "seed.toml"), "-o", str(tmp_path / "link")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "link").is_symlink() and sorted(os.listdir(tmp_path / "folder")) == sorted(GOLDEN)


def test_pdctl_units_command_refuses_an_empty_or_a_stdout_output_path(tmp_path):
    # `-o ''` wrote the unit files into the current folder without a word (Path("") is "."): refused, nothing written.
    import sys

    r = subprocess.run([sys.executable, "-m", "pdctl", "units", str(EXAMPLES / "seed.toml"), "-o", ""],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert r.stderr == ("error: -o '': an empty path names no directory to write the units into; nothing was written\n"
                        "  hint: give -o/--out a directory path, e.g. -o ./units (-o . for the current one)\n"), r.stderr
    assert list(tmp_path.iterdir()) == []
    # `-o -` is stdout for `plan`; here it made a folder named "-"
    r = subprocess.run([sys.executable, "-m", "pdctl", "units", str(EXAMPLES / "seed.toml"), "-o", "-"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert r.stderr.startswith("error: -o -: the units are several files, not one stream for stdout; nothing was "
                               "written\n"), r.stderr
    assert list(tmp_path.iterdir()) == []


def test_pdctl_units_interrupted_while_writing_says_so(tmp_path, monkeypatch, capsys):
    # (it said apply's "what already runs stays as it is … converge", and, once `main` took SIGTERM as Ctrl-C while
    # the command line is parsed, "nothing was written" though some files may be)
    from pdctl.console import cli
    from pdctl.statemachine import launch

    def interrupted(dep, out, **kw):  # noqa: ANN001, ANN003, ANN202
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "write_units", interrupted)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["units", str(EXAMPLES / "seed.toml"), "-o", str(tmp_path / "u")])
    assert exit_.value.code == 130
    assert capsys.readouterr().err.strip() == (f"interrupted while the unit files were written: some may be in "
                                               f"{tmp_path / 'u'}, none is installed; run it again")


@needs_analyze
def test_service_user_becomes_each_units_user_and_verifies_clean(seed, tmp_path):
    dep = seed.model_copy(update={"service_user": "sglang"})
    files = unit_files(unit_set_for(dep), scope="system")
    services = [n for n in files if n.endswith(".service")]
    assert services and all("\nUser=sglang\n" in files[n] for n in services), files
    assert "User=" not in files[next(n for n in files if n.endswith(".target"))]
    assert all("User=" not in text for text in unit_files(unit_set_for(seed), scope="system").values())  # unset
    root = _fake_root(tmp_path / "root", files)
    for name in services:
        r = _verify(root, name)
        assert (r.returncode, r.stdout.strip(), r.stderr.strip()) == (0, "", ""), name


def test_a_user_manager_refuses_a_units_user():
    # (a user manager runs every unit as its own user; User= there would fail each start: the rules refuse
    # service_user with systemd-user, and the renderer too)
    dep = load_spec(EXAMPLES / "demo.toml").model_copy(update={"service_user": "sglang"})
    svc = services_for(dep, scope="user")[0]
    with pytest.raises(ValueError, match="User=sglang needs the system manager"):
        render_service(svc, scope="user")
