"""Shared fixtures."""

from __future__ import annotations

import pytest

from pp1wire.q import dyadic


@pytest.fixture(params=["compiled", "numpy"])
def dyadic_path(request, monkeypatch):
    """Run a test with the compiled fast path (when built) and with plain numpy."""
    if request.param == "numpy":
        monkeypatch.setattr(dyadic, "_fastq", None)
    elif dyadic._fastq is None:
        pytest.skip("compiled fast path not built")
    return request.param
