"""Without torch the package imports and runs single-rank; every group flag asks for the extra."""

from __future__ import annotations

import sys

import pytest

from . import cli


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--tp", "2"], "--tp above 1"),
        (["--tp", "2", "--vocab-shards", "2"], "--tp above 1"),
    ],
)
def test_without_torch_the_package_runs_and_tp_asks_for_the_extra(argv, flag):
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any 'import torch' now fails
        "import pp1wire.apps.spark, pp1wire.apps.demo, pp1wire.apps.worker, pp1wire.tp.fanout\n"
        f"sys.exit(pp1wire.apps.spark.main({[*argv, '--worker', '127.0.0.1:9']!r}))\n"
    )
    done = cli.run(sys.executable, "-c", code)
    assert done.returncode == 2, done.stderr
    assert f"pp1-spark: {flag} needs torch: pip install 'pp1wire[tp]'" in done.stderr
