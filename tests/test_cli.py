"""The command line, run as an operator runs it: a subprocess, its exit code,
its stdout and its stderr."""

import ctypes.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakeproc import FakeProc

CP = ["controlplane", "--listen", "127.0.0.1:0", "--pages-listen", "127.0.0.1:0"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nodesampler", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        ([], "required"),
        (["frobnicate"], "invalid choice"),
        (["sample", "--hz", "0"], "--hz"),
        (["sample", "--hz", "fast"], "--hz"),
        (["sample", "--hz", "nan"], "--hz"),
        (["sample", "--duration", "-1"], "--duration"),
        (["sample", "--duration", "1e9"], "--duration"),
        (["sample", "--group", "noequals"], "NAME=SELECTOR"),
        (["sample", "--group", "=pgid:1"], "NAME=SELECTOR"),
        (["sample", "--group", "a=pgid:x"], "positive integer"),
        (["sample", "--group", "a=cmdline:("], "regular expression"),
        (["sample", "--group", "a=cgroup:rel"], "must start with"),
        (["sample", "--group", "a=comm:"], "1-15 bytes"),
        (["sample", "--group", "a=comm:sixteen-letters!"], "1-15 bytes"),
        (["sample", "--group", "a=host:1"], "expected one of"),
        (["sample", "--group", "a\x1b[31m=pgid:1"], "printable"),
        (["sample", "--group", "a=pgid:1", "--group", "a=pgid:2"], "once"),
        (["sample", "--backend", "ebpf"], "invalid choice"),
        (["sample", "--proc-root", "/nonexistent/proc"], "not a directory"),
        (["sample", "--bogus"], "unrecognized"),
        (["sample", "--host-root", "/nonexistent/host"], "not a directory"),
        (["sample", "--kubelet-ca-file", "/etc/hostname", "--kubelet-insecure-skip-tls-verify"], "give one"),
        (CP, "--secret-file or --k8s-jwks"),
        ([*CP, "--k8s-jwks", "/etc/hostname"], "--k8s-issuer"),
        ([*CP, "--k8s-jwks", "/nonexistent/jwks.json", "--k8s-issuer", "https://x"], "no such file"),
        ([*CP, "--k8s-jwks", "https://x/jwks", "--k8s-issuer", "https://x", "--k8s-service-account", "nope"],
         "NAMESPACE/NAME"),
        ([*CP, "--secret-file", "/etc/hostname", "--k8s-issuer", "https://x"], "without --k8s-jwks"),
        ([*CP, "--request-deadline", "0"], "--request-deadline"),
        ([*CP, "--idle-timeout", "inf"], "--idle-timeout"),
        ([*CP, "--max-connections-per-peer", "-1"], "--max-connections-per-peer"),
        ([*CP, "--max-connections-per-peer", "2.5"], "--max-connections-per-peer"),
        ([*CP, "--max-shards-per-node", "0"], "--max-shards-per-node"),
        ([*CP, "--max-shards-per-node", "257"], "--max-shards-per-node"),
        ([*CP, "--max-live-nodes", "1001"], "--max-live-nodes"),
        ([*CP, "--max-live-nodes", "-1"], "--max-live-nodes"),
        ([*CP, "--live-linger", "0"], "--live-linger"),
        ([*CP, "--live-linger", "nan"], "--live-linger"),
        ([*CP, "--k8s-jwks", "https://x/jwks", "--k8s-issuer", "https://x", "--tls-cert", "/etc/hostname"],
         "go together"),
        ([*CP, "--k8s-jwks", "https://x/jwks", "--k8s-issuer", "https://x", "--tls-cert", "/etc/hostname",
          "--tls-key", "/etc/hostname"], "--tls-cert/--tls-key"),
        (["agent", "--control-plane", "http://cp:8081", "--token-file", "/etc/hostname", "--ca-file", "/etc/hostname"],
         "https://"),
        (["agent", "--control-plane", "https://cp:8081", "--token-file", "/etc/hostname", "--ca-file",
          "/nonexistent/ca.crt"], "--ca-file"),
    ],
)
def test_misuse_is_one_line_and_exit_2(args: list[str], reason: str) -> None:
    r = run(*args)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert reason in lines[0]


def test_backend_asked_for_and_unavailable_is_exit_3(tmp_path: Path) -> None:
    r = run("sample", "--backend", "bpf", "--duration", "0.1", "--kernel-headers", str(tmp_path))
    assert r.returncode == 3
    assert r.stdout == ""
    [line] = r.stderr.splitlines()
    assert "backend bpf unavailable" in line and f"no kernel headers in {tmp_path}" in line


def test_print_bpf_shows_the_program_and_its_flags() -> None:
    r = run("sample", "--print-bpf")
    assert r.returncode == 0, r.stderr
    assert "-DTASK_PID_OFF=" in r.stdout and "int on_switch(" in r.stdout


def fake_tree(tmp_path: Path) -> FakeProc:
    proc = FakeProc(tmp_path / "proc")
    proc.add(100, comm="vllm", cmdline="vllm serve llama", rss=10)
    return proc


def test_hz_above_what_the_proc_counters_resolve(tmp_path: Path) -> None:
    """/proc's counters move in ticks of up to 10 ms: finer than 10 samples
    a second is refused when /proc was asked for, and capped (said once)
    when it is the fallback."""
    fake_tree(tmp_path)
    asked = run("sample", "--backend", "proc", "--duration", "0.2", "--hz", "20", "--proc-root",
                str(tmp_path / "proc"))  # fmt: skip
    assert asked.returncode == 2 and asked.stdout == ""
    assert asked.stderr.count("\n") == 1 and "--hz 20: the proc backend's counters move in ticks" in asked.stderr
    fallback = run("sample", "--json", "--duration", "0.4", "--hz", "20", "--proc-root", str(tmp_path / "proc"))
    assert fallback.returncode == 0, fallback.stderr
    assert json.loads(fallback.stdout)["window"]["samples"] == 4  # 0.4 s at 10 a second
    assert fallback.stderr.count("--hz 20 capped at 10") == 1


def test_sample_json_on_a_fake_tree(tmp_path: Path) -> None:
    fake_tree(tmp_path)
    r = run("sample", "--json", "--duration", "0.4", "--hz", "10", "--proc-root", str(tmp_path / "proc"),
            "--group", "engine=cmdline:vllm serve", "--group", "none=pgid:4242")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    # The kernel backend checks this process's capabilities in the procfs it
    # was given; a fake tree has none to show, so /proc it is, saying why.
    assert summary["backend"] == "proc"
    assert "capabilities" in summary["backend_reason"]
    assert summary["window"]["samples"] == 4
    # The fake machine's counters do not move: no tick elapsed, nothing measured.
    assert summary["machine"]["cpu_percent"] is None
    assert summary["machine"]["cpus"] == 2
    engine, none = summary["shards"]
    assert (engine["id"], engine["pgid"], engine["command"]) == ("engine", 100, "vllm")
    assert engine["cpu_cores"] == {"mean": 0.0, "p95": 0.0, "max": 0.0}
    assert none["cpu_cores"] is None and none["memory_bytes"] is None


def test_sample_text_shows_absent_as_a_dash(tmp_path: Path) -> None:
    proc = fake_tree(tmp_path)
    (proc.root / "loadavg").unlink()
    r = run("sample", "--duration", "0.1", "--proc-root", str(proc.root), "--group", "gone=pgid:4242")
    assert r.returncode == 0, r.stderr
    assert "load     —" in r.stdout
    assert re.search(r"^cpu\s+— mean", r.stdout, re.M)
    gone = [line for line in r.stdout.splitlines() if line.startswith("gone")]
    assert gone and "0.00" not in gone[0] and "—" in gone[0]


def test_sample_of_an_empty_proc_reports_nothing_and_does_not_fail(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    r = run("sample", "--json", "--duration", "0.1", "--proc-root", str(tmp_path / "empty"))
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["machine"] == {"cpu_percent": None}
    assert summary["shards"] == []


def test_sample_on_a_node_without_nvml_does_not_say_no_gpus() -> None:
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has an NVML library")
    r = run("sample", "--json", "--duration", "0.2", "--backend", "proc")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert "gpus" not in summary and "NVML not loaded" in summary["gpu_error"]  # not measured, not "none"
    text = run("sample", "--duration", "0.2", "--backend", "proc").stdout
    assert "GPU      — (NVML not loaded yet" in text


def test_a_listener_off_loopback_without_tls_warns_once(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("a cluster secret of some length")
    cp = subprocess.Popen([sys.executable, "-m", "nodesampler", "controlplane", "--listen", "0.0.0.0:0",
                           "--pages-listen", "127.0.0.1:0", "--secret-file", str(secret)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert cp.stdout is not None and "control plane" in cp.stdout.readline()  # up: the warning came before
    finally:
        cp.terminate()
        _, err = cp.communicate(timeout=30)
    warnings = [line for line in err.splitlines() if "clear text" in line]
    assert len(warnings) == 1 and "0.0.0.0:0" in warnings[0] and "--tls-cert" in warnings[0]


@pytest.mark.parametrize(("pages", "users", "warned"), [("0.0.0.0:0", False, True), ("127.0.0.1:0", False, False),
                                                         ("0.0.0.0:0", True, False)])  # fmt: skip
def test_a_pages_listener_off_loopback_without_users_warns_once(tmp_path: Path, pages: str, users: bool,
                                                                 warned: bool) -> None:  # fmt: skip
    secret = tmp_path / "secret"
    secret.write_text("a cluster secret of some length")
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  ops: {'$2b$04$' + 'a' * 53}\n" if users else "")
    cp = subprocess.Popen([sys.executable, "-m", "nodesampler", "controlplane", "--listen", "127.0.0.1:0",
                           "--pages-listen", pages, "--secret-file", str(secret), "--web-config-file", str(config)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert cp.stdout is not None and "control plane" in cp.stdout.readline()
    finally:
        cp.terminate()
        _, err = cp.communicate(timeout=30)
    warnings = [line for line in err.splitlines() if "has no users" in line]
    assert len(warnings) == (1 if warned else 0), err
    assert not warned or ("basic_auth_users" in warnings[0] and pages in warnings[0])


@pytest.mark.parametrize(("argv", "says"), [
    (["--tls-cert", "c", "--tls-key", "k", "--web-config-file", "w"], "give one"),
    (["--web-config-file", "/nonexistent/web.yml"], "--web-config-file /nonexistent/web.yml"),
    (["--pages-host", "https://x"], "--pages-host"),
    (["--admin-socket", "/nonexistent/dir/admin.sock"], "is not a directory"),
])  # fmt: skip
def test_web_config_misuse_is_one_line_and_exit_2(tmp_path: Path, argv: list[str], says: str) -> None:
    secret = tmp_path / "secret"
    secret.write_text("a cluster secret of some length")
    r = subprocess.run([sys.executable, "-m", "nodesampler", "controlplane", "--listen", "127.0.0.1:0",
                        "--pages-listen", "127.0.0.1:0", "--secret-file", str(secret), *argv],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, r.stderr


def _line_shapes(text: str) -> list[str]:
    """Each line as its words with the figures, units and names a machine
    changes taken out; runs of one shape (disks, cards, engines) as one."""
    shapes: list[str] = []
    headers = 0
    for line in text.splitlines():
        words = ["N" if re.search(r"\d|—", w) or w in ("B", "KiB", "MiB", "GiB", "TiB") else w
                 for w in line.split()]  # fmt: skip
        if not words:
            shape = ""
        elif words[0] == "ENGINE":
            headers += 1
            shape = line if headers == 1 else "ENGINE ..."  # the second's columns are what some engine has
        elif words[0] == "engine":
            shape = "ROW"
        elif words[0] in ("node", "disk"):
            shape = " ".join([words[0], "X", *words[2:]])  # the machine's name; a mount
        else:
            shape = " ".join(words)
        if not shapes or shapes[-1] != shape:
            shapes.append(shape)
    return shapes


def test_the_readme_s_sample_output_is_what_the_command_prints(tmp_path: Path) -> None:
    """The README's example, run here: one H200 (the fake NVML) and an
    engine matching `cmdline:vllm serve`; every line in the README's order
    and words, figures aside."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    example = re.search(r"\$ \.venv/bin/nodesampler sample ([^\n]*)\n(.*?)\n```", readme, re.S)
    assert example is not None
    flags, shown = example.group(1), example.group(2)
    assert flags == "--group engine=cmdline:'vllm serve'"
    engine = tmp_path / "vllm"
    engine.write_text("#!/bin/sh\nwhile :; do sleep 1; done\n")
    engine.chmod(0o755)
    p = subprocess.Popen([str(engine), "serve"], start_new_session=True)
    code = (
        "import functools, sys\n"
        "import pynvml\n"
        "import sampler.open_sampler as o\n"
        "from tests.fakenvml import h200_node\n"
        "node = h200_node(1)\n"
        "node.cards[0].clock_events = pynvml.nvmlClocksEventReasonSwPowerCap  # the README's card is capped\n"
        "o.GpuReader = functools.partial(o.GpuReader, node)\n"
        "from nodesampler.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    try:
        # Two seconds: GPM's first interval ends 0.2 s after the reader starts, well before the window's reading.
        r = subprocess.run([sys.executable, "-c", code, "sample", "--duration", "2", "--group",
                            "engine=cmdline:vllm serve"], cwd=Path(__file__).resolve().parent.parent,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    finally:
        p.kill()
        p.wait()
    assert r.returncode == 0, r.stderr
    printed = re.sub(r"^(node \S+  backend )\w+( \(.*\))?", r"\1bpf", r.stdout, flags=re.M)  # auto's choice here
    assert _line_shapes(printed) == _line_shapes(shown)
