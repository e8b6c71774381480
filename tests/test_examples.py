"""Every example runs as documented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pp1wire.apps.launch import worker_process

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run(*cmd: str, env: dict | None = None, timeout: int = 180) -> str:
    done = subprocess.run(
        list(cmd), capture_output=True, text=True, timeout=timeout, check=False, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize(
    ("script", "vocab", "args", "expect"),
    [
        ("async_client.py", 4096, ["--tokens", "12"], ["generated", "0 fallbacks"]),
        ("sync_sampler.py", 256, ["--steps", "2"], ["accepted tokens [batch, k+1]"]),
    ],
)
def test_client_examples(script, vocab, args, expect):
    with worker_process(vocab=vocab) as running:
        out = run(
            sys.executable,
            str(EXAMPLES / script),
            "--worker",
            running.address,
            "--vocab",
            str(vocab),
            *args,
        )
    for text in expect:
        assert text in out


def test_plugins_example():
    out = run(sys.executable, str(EXAMPLES / "plugins.py"))
    assert "acceptance_rate" in out


def test_plugin_factories_give_proper_rows():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import plugins
    finally:
        sys.path.remove(str(EXAMPLES))
    target = plugins.target_factory(vocab_size=50, seed=1)
    drafter = plugins.drafter_factory(vocab_size=50, seed=1)
    p = target([3, 4])
    assert p.shape == (50,)
    assert abs(p.sum() - 1) < 1e-12
    assert drafter([3, 4]).shape == (50,)
    assert (target([3, 4]) == p).all()  # deterministic in the prefix


def test_conformance_example(tmp_path):
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    out = subprocess.run(
        ["bash", str(EXAMPLES / "run_conformance.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:]
    assert " 0 failed" in out.stdout
    report = (tmp_path / "conformance.xml").read_text()
    assert report.count("<testcase") >= 100


def test_scrape_metrics_example():
    out = run(sys.executable, str(EXAMPLES / "scrape_metrics.py"))
    assert "acceptance rate" in out
