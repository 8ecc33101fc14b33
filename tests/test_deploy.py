"""The deployment files say what the agent needs: each parsed, the fields that matter checked."""

from __future__ import annotations

import configparser
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_daemonset() -> None:
    ds: dict[str, Any] = yaml.safe_load((DEPLOY / "daemonset.yaml").read_text())
    assert ds["kind"] == "DaemonSet"
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    [agent] = pod["containers"]
    assert agent["securityContext"]["privileged"] is True
    assert agent["command"] == ["nodesampler", "agent"]
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in ("/sys", "/lib/modules", "/usr/src"):
        assert mounts[path]["readOnly"] is True
        assert volumes[mounts[path]["name"]]["hostPath"]["path"] == path
    env = {e["name"]: e for e in agent["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "--node=$(NODE_NAME)" in agent["args"]
    token_arg = next(a for a in agent["args"] if a.startswith("--token-file="))
    token_mount = next(m for m in agent["volumeMounts"] if token_arg.split("=", 1)[1].startswith(m["mountPath"]))
    assert "secret" in volumes[token_mount["name"]]


def test_dockerfile() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert text.startswith("#") and "\nFROM debian:" in text
    assert "python3-bpfcc" in text and "--system-site-packages" in text
    assert "COPY bpf bpf" in text


def test_systemd_unit() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(DEPLOY / "nodesampler-agent.service")
    service = unit["Service"]
    assert " agent " in service["ExecStart"] and "--token-file=" in service["ExecStart"]
    assert service["Restart"] == "always" and service["KillSignal"] == "SIGTERM"
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_the_wheel_carries_the_kernel_programs(tmp_path: Path) -> None:
    root = DEPLOY.parent
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(root)], check=True, capture_output=True)  # fmt: skip
    [wheel] = tmp_path.glob("nodesampler-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "bpf/sched_groups.bpf.c" in names and "sampler/bpf_sched.py" in names
