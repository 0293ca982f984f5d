"""GPU utilisation through NVML; a machine without an NVIDIA driver is normal and reports None."""
from __future__ import annotations

_state = {"init": None}


def _init() -> bool:
    if _state["init"] is None:
        try:
            import pynvml

            pynvml.nvmlInit()
            _state["init"] = True
        except Exception:  # pynvml.NVMLError (no driver: NVMLError_LibraryNotFound) or no pynvml at all
            _state["init"] = False
    return _state["init"]


def gpu_utilization() -> float | None:
    """Mean utilisation in percent over all GPUs, or None without GPUs."""
    if not _init():
        return None
    import pynvml

    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return None
        values = [pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByIndex(i)).gpu for i in range(count)]
        return float(sum(values) / count)
    except pynvml.NVMLError:
        return None
