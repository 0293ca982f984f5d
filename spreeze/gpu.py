"""The one NVML wrapper: the profile's GPU inventory and the metrics' utilisation. No NVIDIA driver is normal."""
from __future__ import annotations

_state = {"init": None}


def gpu_inventory() -> tuple[list[dict], str]:
    """GPUs as NVML sees them, and a one-line status: ``([], reason)`` without a driver or pynvml."""
    try:
        import pynvml
    except ImportError:
        return [], "pynvml is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return [], f"no NVIDIA driver ({err})"
    gpus: list[dict] = []
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                util = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except pynvml.NVMLError:  # some boards do not report it
                util = None
            gpus.append({"index": index, "name": name.decode() if isinstance(name, bytes) else str(name),
                         "memory_total": int(memory.total), "memory_free": int(memory.free), "utilization": util})
        return gpus, "ok"
    except pynvml.NVMLError as err:
        return gpus, f"NVML error: {err}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


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
    """Mean utilisation in percent over all GPUs, or None without GPUs (NVML stays initialised: read often)."""
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
