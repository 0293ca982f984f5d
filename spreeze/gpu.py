"""The one NVML wrapper: the profile's GPU inventory and the metrics' utilisation. No NVIDIA driver is normal."""
from __future__ import annotations

import os

_state = {"init": None, "visible": None}


def visible_indices(count: int, uuid_of, visible: str | None) -> list[int]:
    """NVML indices of the GPUs ``CUDA_VISIBLE_DEVICES`` (``visible``; None: unset) leaves this process, in its
    order: NVML lists every GPU of the host, CUDA only these. Entries are indices or (prefixes of) GPU UUIDs; as
    in CUDA an empty value hides every GPU and the list ends at the first entry naming no GPU. An entry of
    another form (a MIG instance) keeps every GPU: this process then sees part of one, which NVML cannot tell.
    ``uuid_of(index)`` is read only for UUID entries. Assumes CUDA's order is the bus order NVML uses
    (``CUDA_DEVICE_ORDER=PCI_BUS_ID``; CUDA's default puts the fastest first)."""
    if visible is None:
        return list(range(count))
    chosen: list[int] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.isdigit():
            index = int(entry)
            if index >= count:
                break
        elif entry.startswith("GPU-"):
            matches = [i for i in range(count) if str(uuid_of(i)).startswith(entry)]
            if len(matches) != 1:
                break
            index = matches[0]
        elif entry.startswith("MIG-"):
            return list(range(count))
        else:  # empty, negative or unreadable: CUDA stops here
            break
        if index not in chosen:
            chosen.append(index)
    return chosen


def gpu_inventory() -> tuple[list[dict], str]:
    """The GPUs this process may use (``CUDA_VISIBLE_DEVICES``, :func:`visible_indices`) as NVML sees them, and a
    one-line status: ``([], reason)`` without a driver or pynvml."""
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
        indices = visible_indices(pynvml.nvmlDeviceGetCount(), lambda i: _uuid(pynvml, i),
                                  os.environ.get("CUDA_VISIBLE_DEVICES"))
        for index in indices:
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


def _uuid(pynvml, index: int) -> str:
    uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
    return uuid.decode() if isinstance(uuid, bytes) else str(uuid)


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
    """Mean utilisation in percent over the GPUs this process may use, or None without any (NVML stays
    initialised: read often)."""
    if not _init():
        return None
    import pynvml

    try:
        if _state.get("visible") is None:  # the environment of a process does not change: read once
            _state["visible"] = visible_indices(pynvml.nvmlDeviceGetCount(), lambda i: _uuid(pynvml, i),
                                                os.environ.get("CUDA_VISIBLE_DEVICES"))
        indices = _state["visible"]
        if not indices:
            return None
        values = [pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByIndex(i)).gpu for i in indices]
        return float(sum(values) / len(indices))
    except pynvml.NVMLError:
        return None
