"""What children tell the supervisor, one small dataclass per kind, routed by the supervisor's handler table,
and the way it travels: each child writes into a pipe of its own (:class:`Outbox`), which the supervisor reads
without ever blocking on a child that died mid-message (:class:`Inbox`). Experience and weights for training
never travel this way (shared memory does); these messages are rare, and small but for the weights of a tested
policy."""
from __future__ import annotations

import collections
import os
import pickle
import queue
import struct
import threading
import time
from dataclasses import dataclass

FRAME = struct.Struct("!Q")   # the length of the pickled message that follows it in a pipe
MAX_PENDING = 1000            # messages an Outbox holds for its writer thread (as the Queue it replaces)
READS_PER_DRAIN = 256         # 64 KiB reads of one pipe per drain at most: a flooding child cannot hold it
MESSAGE_WAIT_S = 0.5          # per drain, how long the rest of a message begun in a pipe is waited for


@dataclass(frozen=True)
class Evaluation:
    """A test result (the tested weights ride along as ``actor_flat``, for the best policy)."""
    result: dict


@dataclass(frozen=True)
class _Said:
    source: str   # "learner" or the child's process title
    text: str


class Error(_Said):
    """The child is failing; the run ends with this text."""


class Warn(_Said):
    """Something went wrong that training survives (a checkpoint not written): events.log."""


class Event(_Said):
    """A decision worth a line in events.log (the learner's new batch)."""


class Info(_Said):
    """A line for the console only."""


class GaveUp(_Said):
    """A sampler stopped for good (its env keeps failing): it is not restarted."""


class Checkpointed(_Said):
    """The learner wrote a checkpoint (``text`` is its path), for the observers."""


class Outbox:
    """A child's end of its own pipe to the supervisor. ``put`` does not wait on the pipe: a thread writes each
    message whole and in order, as multiprocessing.Queue's feeder thread does.

    Why not one Queue shared by every child: a child killed in the middle of a message (the evaluator sends a
    tested policy's weights, hundreds of KiB) left the supervisor blocked for good in ``get_nowait`` reading the
    rest of that message, and every other writer waiting for the write lock the dead one held. Here the torn
    stream is the dead child's alone, and the supervisor drops it with the child (docs/pitfalls.md)."""

    def __init__(self, conn):
        self._conn = conn
        self._local()

    def _local(self) -> None:
        self._pending: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = self._broken = False

    def __getstate__(self):  # what a spawned child receives: the pipe's end, not this process's thread
        return {"conn": self._conn}

    def __setstate__(self, state) -> None:
        self._conn = state["conn"]
        self._local()

    def put(self, message, timeout: float | None = None) -> None:
        """Queue ``message`` for the supervisor; ``queue.Full`` after ``timeout`` s with MAX_PENDING unsent. After
        :meth:`close`, or once the supervisor has closed its end, messages are dropped: nobody reads them."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._pending) >= MAX_PENDING and not (self._closed or self._broken):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise queue.Full
                self._cond.wait(remaining)
            if self._closed or self._broken:
                return
            self._pending.append(FRAME.pack(len(data)) + data)
            if self._thread is None:
                self._thread = threading.Thread(target=self._write, name="spreeze-outbox", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _write(self) -> None:
        fd = self._conn.fileno()
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                frame = self._pending[0]
            try:
                view = memoryview(frame)
                while view:
                    view = view[os.write(fd, view):]
            except OSError:  # the supervisor's end is closed: it is gone or done
                with self._cond:
                    self._broken = True
                    self._pending.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                if self._pending and self._pending[0] is frame:  # close(0) may have dropped it meanwhile
                    self._pending.popleft()
                self._cond.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, waiting up to ``timeout`` s (0: drop it: the supervisor is gone), then close."""
        with self._cond:
            self._closed = True
            if timeout <= 0:
                self._pending.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        if thread is None or not thread.is_alive():  # a writer stuck on a full pipe keeps its end: exit frees it
            self._conn.close()

    def release(self) -> None:
        """The supervisor's copy of a child's end, once the child has its own: closed, never written."""
        self._conn.close()


class LocalOutbox:
    """An Outbox for senders in the supervisor's own process (``--serial``, the serial lock-step learner)."""

    def __init__(self):
        self._items: collections.deque = collections.deque()

    def put(self, message, timeout: float | None = None) -> None:
        self._items.append(message)

    def take(self) -> list:
        items = []
        while self._items:
            items.append(self._items.popleft())
        return items


class _Channel:
    def __init__(self, conn):
        self.conn = conn
        self.buffer = bytearray()
        self.ended = False
        self.unreadable = 0

    def read(self, into: collections.deque, wait_s: float | None = None) -> None:
        """Every whole message that arrived, appended to ``into``. A message begun in the pipe is waited for
        up to ``wait_s`` (its writer is writing the rest: a pipe holds less than a tested policy's weights); one
        whose writer died stays buffered, and is dropped with the channel. Never waits longer."""
        give_up = time.monotonic() + (MESSAGE_WAIT_S if wait_s is None else wait_s)
        for _ in range(READS_PER_DRAIN):
            if self.ended:
                return
            if not self.conn.poll(0):
                left = give_up - time.monotonic()
                if not self.buffer or left <= 0 or not self.conn.poll(min(left, 0.05)):
                    if self.buffer and left > 0:
                        continue
                    return
            data = os.read(self.conn.fileno(), 1 << 16)
            if not data:  # every writer closed its end
                self.ended = True
                return
            self.buffer += data
            while len(self.buffer) >= FRAME.size:
                (size,) = FRAME.unpack_from(self.buffer)
                if len(self.buffer) < FRAME.size + size:
                    break
                payload = bytes(self.buffer[FRAME.size:FRAME.size + size])
                del self.buffer[:FRAME.size + size]
                try:
                    into.append(pickle.loads(payload))
                except Exception:  # a whole frame that cannot be read: skip it, the stream stays in step
                    self.unreadable += 1


class Inbox:
    """The supervisor's end: one pipe per child name (:meth:`open`, again for a restarted child) and a
    :class:`LocalOutbox` for senders in its own process. :meth:`drain` returns what has arrived; it waits only
    for the rest of a message being written, MESSAGE_WAIT_S at most per pipe.
    A child's channel is read one last time when it is replaced or closed; a message its writer died in the
    middle of is dropped then."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.local = LocalOutbox()
        self._channels: dict[str, _Channel] = {}
        self._ready: collections.deque = collections.deque()

    def open(self, name: str) -> Outbox:
        """A new pipe for child ``name``, which gets the returned end (:meth:`Outbox.release` this process's copy
        once the child is started)."""
        old = self._channels.pop(name, None)
        if old is not None:
            self._retire(old)
        reader, writer = self.ctx.Pipe(duplex=False)
        self._channels[name] = _Channel(reader)
        return Outbox(writer)

    def collect(self) -> None:
        """Read what has arrived from every child (and this process) into the queue :meth:`take` empties."""
        self._ready.extend(self.local.take())
        for channel in self._channels.values():
            try:
                channel.read(self._ready)
            except (OSError, ValueError):  # the pipe is gone: nothing more will come
                channel.ended = True

    def take(self):
        """The next collected message, or None. One at a time: an interrupt while one is handled loses no other."""
        return self._ready.popleft() if self._ready else None

    def drain(self) -> list:
        """Collect, then every collected message."""
        self.collect()
        taken = []
        while (message := self.take()) is not None:
            taken.append(message)
        return taken

    def _retire(self, channel: _Channel) -> None:
        try:
            channel.read(self._ready, wait_s=0.0)  # its writer is dead: what is whole, nothing more
        except (OSError, ValueError):
            pass
        channel.conn.close()

    def close(self) -> None:
        for channel in self._channels.values():
            self._retire(channel)
        self._channels.clear()
