"""Files that are complete or absent: written under a temporary name, fsynced, then renamed over the target,
so a process killed mid-write (or a full disk) never leaves a truncated checkpoint or replay behind; and the
lock that keeps a run directory to one process at a time."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import BinaryIO, Callable


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Create ``path``'s folder, call ``write`` on a temporary file beside it, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """Remove the temporary files of :func:`atomic_write` (``.NAME.PID.tmp``) under ``run_dir`` whose writer is no
    longer alive: a learner killed in the middle of its final checkpoint or ``--save-replay`` left hundreds of MB
    that nothing else would remove. Returns what was removed."""
    import psutil

    removed = []
    for path in Path(run_dir).rglob(".*.tmp"):
        pid = path.name[:-len(".tmp")].rsplit(".", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not psutil.pid_exists(int(pid)):
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed


LOCK_NAME = ".spreeze.lock"
# held by the learner process for its life: the run directory's lock is its supervisor's alone (spawned children
# do not inherit it), so a SIGKILLed supervisor freed the directory while its learner went on writing its final
# checkpoint, and a resume started then read one checkpoint in its supervisor and the next in its learner
LEARNER_LOCK_NAME = ".spreeze-learner.lock"


class RunDirBusy(RuntimeError):
    """Another live process works in this run directory."""


@contextlib.contextmanager
def hold_run_dir(run_dir: Path):
    """Held while a run (or a resume of it) works in ``run_dir``: a second one there would append to the same CSV
    files and replace the same checkpoints (a resume of a run still going in another terminal). An advisory lock
    (``flock``) the OS drops when its process dies, so a killed run never leaves it held; where ``fcntl`` is
    missing (Windows) nothing is locked. Raises :class:`RunDirBusy`, naming the holder's pid."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(Path(run_dir) / LOCK_NAME, "a+") as f:
        holder = _lock_or_holder(f, fcntl)
        if holder:
            raise RunDirBusy(f"{run_dir} is in use by another spreeze process (pid {holder}): let it end, or stop it, "
                             "first")
        try:
            learner = _learner_still_writing(Path(run_dir), fcntl)
            if learner:
                raise RunDirBusy(f"{run_dir} is still written by the learner of an earlier session ({learner}), which "
                                 "ends after its final checkpoint (within about 30 s of its supervisor's death): wait "
                                 "for it first")
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _lock_or_holder(f, fcntl) -> str | None:
    """Take ``f``'s exclusive lock without waiting and write this process's pid into it: None; or, held by another
    process, the pid that one wrote ("unknown" if none yet)."""
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        return f.read().strip() or "unknown"
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return None


def _learner_still_writing(run_dir: Path, fcntl) -> str | None:
    """``pid N`` of a learner process that holds ``run_dir``'s learner lock (:func:`hold_learner_lock`), or None."""
    path = run_dir / LEARNER_LOCK_NAME
    if not path.exists():
        return None
    with open(path, "a+") as f:  # closing it releases the lock, if this call took it
        holder = _lock_or_holder(f, fcntl)
        return f"pid {holder}" if holder else None


def hold_learner_lock(run_dir: Path):
    """Taken by the learner process for its life (the OS drops it when the process ends): the open file, which
    releases it when closed, or None where ``fcntl`` is missing. Raises :class:`RunDirBusy` when another learner
    still holds it."""
    try:
        import fcntl
    except ImportError:
        return None
    f = open(Path(run_dir) / LEARNER_LOCK_NAME, "a+")
    holder = _lock_or_holder(f, fcntl)
    if holder:
        f.close()
        raise RunDirBusy(f"{run_dir} is still written by another learner (pid {holder})")
    return f


def run_dir_busy(run_dir: Path) -> str | None:
    """Why ``run_dir`` cannot be used now (another process holds it: :func:`hold_run_dir`), or None."""
    if not any((Path(run_dir) / name).exists() for name in (LOCK_NAME, LEARNER_LOCK_NAME)):
        return None
    try:
        with hold_run_dir(run_dir):
            return None
    except RunDirBusy as err:
        return str(err)
