"""``python -m pp1wire.spark``: the ``pp1-spark`` command, for launchers such as torchrun."""

import sys

from pp1wire.apps.spark import main

if __name__ == "__main__":
    sys.exit(main())
