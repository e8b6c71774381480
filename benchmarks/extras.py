"""A benchmark's optional dependencies: one line naming the extra, and exit 2, when missing.

Some scripts need torch (the ``tp`` extra: every multi-rank group) or ZeroMQ and
gRPC (the ``bench`` extra: ``run.py``'s baselines). Without them a script would
die deep inside on a traceback that names neither the module nor the fix.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

#: The extra that installs each optional module.
EXTRAS = {"torch": "tp", "zmq": "bench", "grpc": "bench"}


def require(*modules: str) -> None:
    """Exit 2 with one line on stderr unless every module imports."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        extras = ",".join(sorted({EXTRAS[m] for m in missing}))
        prog = Path(sys.argv[0]).name or "benchmark"
        print(
            f"{prog}: needs {' and '.join(missing)}: pip install -e '.[{extras}]'",
            file=sys.stderr,
        )
        sys.exit(2)
