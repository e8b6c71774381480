"""Deployment files, checked by what they do.

No Docker engine runs here (.ci/run lints the Dockerfile with hadolint). The
exact commands the Dockerfile and compose.yaml give run against each other on
loopback, with only addresses, ports, the secret's path and the size of the
workload changed. What only an engine would exercise (start order, the shared
network, published ports, secret mounts) is checked as agreement between the
parts of the files that must name the same thing, never as their text.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from pp1wire.apps.launch import worker_process

from .waiting import scrape

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()
COMPOSE = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
BINDIR = Path(sys.executable).parent


def dockerfile_env() -> dict[str, str]:
    block = re.search(r"^ENV (.+?)(?=^\S)", DOCKERFILE, re.M | re.S).group(1)
    pairs = shlex.split(block.replace("\\\n", " "))
    return dict(p.split("=", 1) for p in pairs)


def exec_form(instruction: str) -> list[str]:
    """The JSON array of the Dockerfile's ``instruction`` (for HEALTHCHECK, of its CMD)."""
    if instruction == "HEALTHCHECK":  # its CMD is on a continuation line
        match = re.search(r"^\s+CMD (\[.*\])\s*$", DOCKERFILE.split("HEALTHCHECK", 1)[1], re.M)
    else:
        match = re.search(rf"^{instruction} (\[.*\])\s*$", DOCKERFILE, re.M)
    assert match, f"{instruction} is not in exec form"
    return list(json.loads(match.group(1)))


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def run(cmd: list[str], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BINDIR / cmd[0]), *cmd[1:]],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_runtime_image_has_no_build_tools_and_runs_as_a_numeric_non_root_user():
    # Not restated by hadolint: the image the daemons run in is the second stage,
    # built on a slim base with no compiler, and never runs as root.
    stages = re.findall(r"^FROM (\S+)(?: AS (\w+))?", DOCKERFILE, re.M)
    assert len(stages) == 2, "multi-stage: build, then runtime"
    assert "slim" in stages[1][0]
    runtime = DOCKERFILE.split("\nFROM ", 2)[2]
    assert not re.search(r"gcc|build-essential|apt-get install", runtime)
    user = re.findall(r"^USER (\S+)$", runtime, re.M)
    assert user, "no USER in the runtime stage"
    assert re.fullmatch(r"[1-9]\d*:\d+", user[-1]), "a numeric user that is not root"


@pytest.mark.skipif(
    shutil.which("hadolint") is None and not (BINDIR / "hadolint").exists(),
    reason="hadolint not installed",
)
def test_hadolint_warning_level():
    exe = shutil.which("hadolint") or str(BINDIR / "hadolint")
    done = subprocess.run(
        [exe, "--failure-threshold", "warning", str(ROOT / "docker" / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout


def test_compose_parts_that_name_the_same_thing_agree():
    services: dict[str, Any] = COMPOSE["services"]
    worker, spark = services["pp1-worker"], services["pp1-spark"]
    spark_args = [*spark["entrypoint"], *spark["command"]]
    port = flag(worker["command"], "--port")
    # pp1-spark reaches the worker by its service name on the port it listens
    # on, over a network both join, once the health check, a HELLO on that same
    # port, has passed.
    assert flag(spark_args, "--worker") == f"pp1-worker:{port}"
    assert set(worker["networks"]) & set(spark["networks"])
    assert spark["depends_on"]["pp1-worker"]["condition"] == "service_healthy"
    assert worker["healthcheck"]["test"][0] == "CMD"
    assert flag(worker["healthcheck"]["test"], "--check") == f"127.0.0.1:{port}"
    # The Dockerfile's own HEALTHCHECK probes the port its environment listens on.
    assert flag(exec_form("HEALTHCHECK"), "--check") == f"127.0.0.1:{dockerfile_env()['PP1_PORT']}"
    for name, svc in services.items():
        args = svc["command"] if "entrypoint" not in svc else [*svc["entrypoint"], *svc["command"]]
        # Each published port is that container's metrics port.
        published = [p.rsplit(":", 1)[1] for p in svc["ports"]]
        assert published == [flag(args, "--metrics-port")], name
        # The key reaches each daemon as the file its declared secret is mounted
        # at, never as an environment literal.
        (secret,) = svc["secrets"]
        assert secret in COMPOSE["secrets"]
        assert flag(args, "--psk-file") == f"/run/secrets/{secret}", name
        env = svc.get("environment", {})
        assert not any("PSK" in k and not k.endswith("_FILE") for k in env), name


def test_the_image_default_command_serves_and_its_health_check_tells(tmp_path):
    # `docker run pp1wire`: ENTRYPOINT + CMD with the image's environment, the
    # listen addresses on loopback and free ports.
    env = {**dockerfile_env(), "PATH": str(BINDIR)}
    env.update(PP1_HOST="127.0.0.1", PP1_PORT="0", PP1_METRICS_HOST="127.0.0.1")
    env["PP1_METRICS_PORT"] = "0"
    command = [str(BINDIR / exec_form("ENTRYPOINT")[0]), *exec_form("CMD")]
    with worker_process(command=command, env=env) as running:
        assert running.metrics is not None  # the image's environment turns metrics on
        health = exec_form("HEALTHCHECK")
        health[health.index("--check") + 1] = running.address
        done = run(health, env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("healthy")
    # The same check against a port nobody listens on any more: it tells.
    done = run(health, env)
    assert done.returncode == 1
    assert done.stderr.startswith("unhealthy")
    assert running.returncode == 0


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

    worker_svc = COMPOSE["services"]["pp1-worker"]
    env = {**dockerfile_env(), **worker_svc.get("environment", {})}
    env = {k: local([v])[0] for k, v in env.items()}
    env["PP1_PORT"] = "0"
    env["PP1_METRICS_PORT"] = "0"
    env["PATH"] = str(BINDIR)
    worker_cmd = local(["pp1-worker", *worker_svc["command"]])
    worker_cmd[worker_cmd.index("--port") + 1] = "0"
    worker_cmd[worker_cmd.index("--metrics-port") + 1] = "0"
    worker_cmd[0] = str(BINDIR / worker_cmd[0])
    with worker_process(command=worker_cmd, env=env) as running:
        assert running.metrics is not None
        done = run(local(worker_svc["healthcheck"]["test"][1:], running.port), env)
        assert done.returncode == 0, done.stderr
        spark_svc = COMPOSE["services"]["pp1-spark"]
        spark_cmd = local([*spark_svc["entrypoint"], *spark_svc["command"]], running.port)
        spark_cmd[spark_cmd.index("--metrics-port") + 1] = "0"
        # The compose workload is 16 requests x 64 tokens at the full vocabulary;
        # two requests of eight tokens exercise every flag as well (a later flag
        # wins), in a tenth of the time.
        done = run([*spark_cmd, "--requests", "2", "--max-tokens", "8"], {"PATH": str(BINDIR)})
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        assert summary["requests"] == 2
        assert summary["draft_tokens"] > 0
        assert summary["fallbacks"] == 0
        assert scrape(running.metrics, "pp1_worker_steps_total") >= summary["rounds"]
        # The secret is what admits the Spark side: another key is refused.
        key.write_text("another-key-of-enough-bytes-for-it")
        done = run([*spark_cmd, "--requests", "1", "--max-tokens", "1"], {"PATH": str(BINDIR)})
        assert done.returncode == 1
        assert "AUTH_FAILED" in done.stderr
    assert running.returncode == 0
