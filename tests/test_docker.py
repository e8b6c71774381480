"""Deployment files: compose.yaml parses and is wired right, and the exact commands it and
the Dockerfile's HEALTHCHECK give work against each other on loopback (no Docker engine
runs here; .ci/run lints the Dockerfile with hadolint)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pp1wire.apps.launch import worker_process

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()
COMPOSE = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())


def test_dockerfile_shape():
    stages = re.findall(r"^FROM (\S+)(?: AS (\w+))?", DOCKERFILE, re.M)
    assert len(stages) == 2, "multi-stage: build, then runtime"
    assert "slim" in stages[1][0]
    runtime = DOCKERFILE.split("\nFROM ", 2)[2]
    assert not re.search(r"gcc|build-essential|apt-get install", runtime)
    assert re.search(r"^USER \d+:\d+$", DOCKERFILE, re.M), "numeric non-root user"
    assert re.search(r'^ENTRYPOINT \[".*"\]$', DOCKERFILE, re.M), "exec form"
    assert re.search(r"^CMD \[.*\]$", DOCKERFILE, re.M), "exec form"
    assert "STOPSIGNAL SIGTERM" in DOCKERFILE
    assert "HEALTHCHECK" in DOCKERFILE


@pytest.mark.skipif(
    shutil.which("hadolint") is None and not (Path(sys.executable).parent / "hadolint").exists(),
    reason="hadolint not installed",
)
def test_hadolint_warning_level():
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    done = subprocess.run(
        [exe, "--failure-threshold", "warning", str(ROOT / "docker" / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout


def test_compose_wiring():
    services = COMPOSE["services"]
    assert set(services) == {"pp1-worker", "pp1-spark"}
    worker, spark = services["pp1-worker"], services["pp1-spark"]
    assert worker["networks"] == spark["networks"] == ["pp1"]
    check = worker["healthcheck"]
    assert check["test"][:2] == ["CMD", "pp1-worker"]
    assert "--check" in check["test"]
    assert check["interval"] == "10s"
    assert spark["depends_on"]["pp1-worker"]["condition"] == "service_healthy"
    assert worker["ports"]
    assert spark["ports"]
    for svc in services.values():
        assert svc["secrets"] == ["pp1_psk"]
        env = svc.get("environment", {})
        assert not any("PSK" in k and not k.endswith("_FILE") for k in env), "no key literal"
        assert "--psk-file" in svc["command"]
    assert COMPOSE["secrets"]["pp1_psk"] == {"file": "./pp1_psk.txt"}


def _dockerfile_env() -> dict[str, str]:
    block = re.search(r"^ENV (.+?)(?=^\S)", DOCKERFILE, re.M | re.S).group(1)
    pairs = shlex.split(block.replace("\\\n", " "))
    return dict(p.split("=", 1) for p in pairs)


def _healthcheck() -> list[str]:
    match = re.search(r"CMD (\[.*\])\s*$", DOCKERFILE.split("HEALTHCHECK", 1)[1], re.M)
    return json.loads(match.group(1))


def test_the_exact_commands_work_together(tmp_path):
    key = tmp_path / "pp1_psk"
    key.write_text("a-compose-test-key-of-enough-bytes")

    def local(args: list[str], port: int | None = None) -> list[str]:
        # Only addresses change: service names and 0.0.0.0 become loopback, the
        # container ports free ones (the worker binds port 0 and reports it), the
        # secret path a temporary file.
        out = []
        for arg in args:
            new = arg.replace("/run/secrets/pp1_psk", str(key)).replace("0.0.0.0", "127.0.0.1")
            if port is not None:
                new = new.replace("pp1-worker:7070", f"127.0.0.1:{port}").replace(
                    "127.0.0.1:7070", f"127.0.0.1:{port}"
                )
            out.append(new)
        return out

    bindir = Path(sys.executable).parent
    worker_svc = COMPOSE["services"]["pp1-worker"]
    env = {**_dockerfile_env(), **worker_svc.get("environment", {})}
    env = {k: local([v])[0] for k, v in env.items()}
    env["PP1_PORT"] = "0"
    env["PP1_METRICS_PORT"] = "0"
    env["PATH"] = str(bindir)
    worker_cmd = local(["pp1-worker", *worker_svc["command"]])
    worker_cmd[worker_cmd.index("--port") + 1] = "0"
    worker_cmd[worker_cmd.index("--metrics-port") + 1] = "0"
    worker_cmd[0] = str(bindir / worker_cmd[0])
    with worker_process(command=worker_cmd, env=env) as running:
        health = local(_healthcheck(), running.port)
        done = subprocess.run(
            [str(bindir / health[0]), *health[1:]],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        spark_svc = COMPOSE["services"]["pp1-spark"]
        spark_cmd = local([*spark_svc["entrypoint"], *spark_svc["command"]], running.port)
        spark_cmd[spark_cmd.index("--metrics-port") + 1] = "0"
        done = subprocess.run(
            [str(bindir / spark_cmd[0]), *spark_cmd[1:]],
            env={"PATH": str(bindir)},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        assert summary["requests"] == 16
        assert summary["fallbacks"] == 0
    assert running.returncode == 0
