"""Every count the front page and the operators' guide state about the code comes from the code."""

from __future__ import annotations

import re
from pathlib import Path

from pp1wire.testing.conformance import CASES
from pp1wire.testing.conformance.spark_cases import SPARK_CASES

ROOT = Path(__file__).resolve().parent.parent
# Each count is stated once, in one of these.
TEXT = "\n".join((ROOT / p).read_text() for p in ("README.md", "docs/operators.md"))


def stated(pattern: str) -> int:
    found = re.findall(pattern, TEXT)
    assert len(found) == 1, (pattern, found)
    return int(found[0].replace(",", ""))


def test_the_worker_suite_count_is_the_number_of_cases():
    assert stated(r"runs ([\d,]+) numbered cases against any worker endpoint") == len(CASES)


def test_the_spark_suite_count_is_the_number_of_cases():
    assert stated(r"runs the other half: ([\d,]+) numbered cases") == len(SPARK_CASES)

