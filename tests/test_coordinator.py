"""The group coordinator: every collective that fails becomes the group's failure.

What can be tested without a GPU about the NCCL device group: it is made in
blocking-wait mode (``pp1wire.tp.coordinator.nccl_group``), and the error its
``wait()`` raises at the timeout in that mode (``DistBackendError``) fails the
group closed. Without that mode a collective a dead rank never joins is found by
NCCL's watchdog thread, which by default ends the process at the timeout
(SIGABRT: no result written, the launcher sees a signal instead of exit 3).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from pp1wire.tp import coordinator  # noqa: E402
from pp1wire.tp.coordinator import GroupCoordinator, GroupFailedError  # noqa: E402


class _Work:
    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    def wait(self) -> bool:
        if self.error is not None:
            raise self.error
        return True


class _DeviceGroup:
    """A device group whose collectives time out the way NCCL's do in blocking-wait mode."""

    def __init__(self) -> None:
        self.calls = 0

    def broadcast(self, tensors, opts) -> _Work:
        self.calls += 1
        return _Work(dist.DistBackendError("Work WorkNCCL(...) timed out in blocking wait."))


def test_the_nccl_group_is_made_in_blocking_wait_mode(monkeypatch):
    seen = {}

    def new_group(**kw):
        seen.update(kw, wait=coordinator.os.environ.get(coordinator.BLOCKING_WAIT))
        return "group"

    monkeypatch.setattr(coordinator.dist, "new_group", new_group)
    monkeypatch.delenv(coordinator.BLOCKING_WAIT, raising=False)
    from datetime import timedelta

    assert coordinator.nccl_group(timedelta(seconds=3)) == "group"
    assert seen == {"backend": "nccl", "timeout": timedelta(seconds=3), "wait": "1"}
    # An operator's own choice stands.
    monkeypatch.setenv(coordinator.BLOCKING_WAIT, "0")
    coordinator.nccl_group(timedelta(seconds=3))
    assert seen["wait"] == "0"


def test_a_device_collective_that_times_out_fails_the_group_closed():
    coord = GroupCoordinator(object(), rank=0, world=2, timeout=1.0, device_group=_DeviceGroup())
    with pytest.raises(GroupFailedError, match="broadcast failed, the process group is unusable"):
        coord.broadcast(torch.zeros(4, dtype=torch.uint8), 0, device=True)
    # The group stays dead: the next collective fails at once, nothing is sent.
    with pytest.raises(GroupFailedError):
        coord.broadcast(torch.zeros(4, dtype=torch.uint8), 0, device=True)
    assert coord.device_group.calls == 1
