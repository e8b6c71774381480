"""``python -m pp1wire.testing.conformance``: the same as ``pp1-conformance``."""

import sys

from pp1wire.testing.conformance.runner import main

sys.exit(main())
