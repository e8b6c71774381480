"""``python -m pp1wire.testing.golden [--check] [FILE]``."""

import sys

from pp1wire.testing.golden import main

sys.exit(main())
