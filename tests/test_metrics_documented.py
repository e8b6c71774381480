"""docs/operators.md's metrics table lists every metric the daemons export, by its exported name."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

OPERATORS = (Path(__file__).resolve().parents[1] / "docs" / "operators.md").read_text()


def _worker() -> CollectorRegistry:
    from pp1wire.aio.worker_metrics import WorkerMetrics

    return WorkerMetrics().registry


def _spark() -> CollectorRegistry:
    from pp1wire.apps.spark import SparkMetrics

    return SparkMetrics(max_depth=5).registry


def exported(registry: CollectorRegistry) -> list[str]:
    """Each family's name as a scrape shows it (counters with ``_total``)."""
    return [
        f"{family.name}_total" if family.type == "counter" else family.name
        for family in registry.collect()
    ]


@pytest.mark.parametrize(
    "registry",
    [
        pytest.param(_worker, id="pp1-worker"),
        pytest.param(_spark, id="pp1-spark"),
    ],
)
def test_every_exported_metric_is_in_the_operators_table(registry):
    table = OPERATORS[OPERATORS.index("## 4. Metrics") : OPERATORS.index("## 5. Failure semantics")]
    missing = [name for name in exported(registry()) if f"`{name}`" not in table]
    assert not missing, missing
