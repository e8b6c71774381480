"""Engine tensors in, numpy out: a host view of any array-like (numpy, a torch tensor, anything
exporting DLPack), copying only what lives on a device.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt


def host_array(x: Any, dtype: npt.DTypeLike | None = None) -> npt.NDArray[Any]:
    """``x`` as a numpy array: a zero-copy view of CPU memory when the dtype already matches,
    a device tensor copied to the host once."""
    if isinstance(x, np.ndarray):
        return x if dtype is None else np.asarray(x, dtype=dtype)
    if hasattr(x, "__dlpack__"):
        try:
            view = np.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError):
            view = np.from_dlpack(x.cpu()) if hasattr(x, "cpu") else np.asarray(x)
        return view if dtype is None else np.asarray(view, dtype=dtype)
    return np.asarray(x, dtype=dtype)
