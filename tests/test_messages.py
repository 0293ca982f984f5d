"""Children's messages to the supervisor (spreeze/messages.py): whole, in order per child, and never a blocked
supervisor when a child dies in the middle of one."""
import multiprocessing as mp
import threading
import time

import numpy as np

from spreeze.messages import Event, Evaluation, Inbox, Outbox
from spreeze.proc import start_process, stop_process

CTX = mp.get_context("spawn")
BIG = 1 << 20  # far more than a pipe holds (64 KiB on Linux): its writer blocks until the supervisor reads


def send_then_wait(outbox: Outbox, sizes: list[int], tag: str) -> None:
    for i, size in enumerate(sizes):
        outbox.put(Evaluation({"tag": tag, "i": i, "weights": np.full(size, i % 251, np.uint8)}), timeout=5)
    outbox.close(timeout=30)
    time.sleep(60)  # stopped by the test


def drain_within(inbox: Inbox, seconds: float) -> list | None:
    """``inbox.drain()`` in a thread: None when it is still blocked after ``seconds``."""
    got = []
    reader = threading.Thread(target=lambda: got.append(inbox.drain()), daemon=True)
    reader.start()
    reader.join(seconds)
    return None if reader.is_alive() else got[0]


def collect(inbox: Inbox, count: int, timeout: float = 60.0) -> list:
    messages, deadline = [], time.monotonic() + timeout
    while len(messages) < count and time.monotonic() < deadline:
        messages += inbox.drain()
        time.sleep(0.01)
    return messages


def start_sender(inbox: Inbox, name: str, sizes: list[int], keep: list | None = None):
    """A child sending ``sizes``-byte messages on a new pipe; ``keep`` receives this process's end of the pipe
    instead of closing it."""
    outbox = inbox.open(name)
    try:
        return start_process(send_then_wait, outbox, sizes, name, name=f"spreeze-test-{name}")
    finally:
        if keep is None:
            outbox.release()
        else:
            keep.append(outbox)


def test_messages_arrive_whole_and_in_order_from_each_child():
    """Two children, messages from a few bytes to far more than a pipe holds: each arrives whole, in its
    child's order, while the other child's messages interleave."""
    inbox = Inbox(CTX)
    sizes = [10, BIG, 3, 70_000, BIG // 3, 1]
    processes = [start_sender(inbox, name, sizes) for name in ("a", "b")]
    try:
        inbox.local.put(Event("supervisor", "from this process"))
        messages = collect(inbox, 1 + 2 * len(sizes))
    finally:
        for process in processes:
            stop_process(process, 0)
        inbox.close()
    assert isinstance(messages[0], Event) and messages[0].text == "from this process"
    for tag in ("a", "b"):
        mine = [m.result for m in messages[1:] if m.result["tag"] == tag]
        assert [m["i"] for m in mine] == list(range(len(sizes)))
        assert all(m["weights"].size == size and np.all(m["weights"] == i % 251) for i, (m, size) in
                   enumerate(zip(mine, sizes)))


def test_a_child_killed_in_the_middle_of_a_message_never_blocks_the_supervisor():
    """The evaluator's message carries a tested policy's weights. Killed while writing one (here: blocked on a
    full pipe), it left a shared multiprocessing.Queue with half a message, and the supervisor's next
    ``get_nowait`` waited for the rest for good: the run ignored --minutes and SIGTERM. Each child's own pipe
    keeps the torn tail to itself; a restarted child gets a new pipe."""
    inbox = Inbox(CTX)
    # this process keeps its copy of the pipe's end, as every writer of a shared Queue did: the reader sees no
    # end of file when the child dies, so only not waiting for the rest of a message keeps it from blocking
    kept = []
    torn = start_sender(inbox, "evaluator", [BIG], keep=kept)
    processes = [torn]
    try:
        assert inbox._channels["evaluator"].conn.poll(60)  # it has begun writing; nothing has been read
        time.sleep(0.5)                                      # and is now blocked on the full pipe
        stop_process(torn, 0)                                # SIGKILL with part of the message in the pipe
        assert drain_within(inbox, 10.0) == []               # returns; the torn message is not delivered
        processes.append(start_sender(inbox, "sampler", [5, 6]))
        processes.append(start_sender(inbox, "evaluator", [7]))  # restarted: a new pipe
        messages = collect(inbox, 3)
        assert sorted((m.result["tag"], m.result["weights"].size) for m in messages) == [
            ("evaluator", 7), ("sampler", 5), ("sampler", 6)]
        assert drain_within(inbox, 10.0) == []
    finally:
        for process in processes:
            stop_process(process, 0)
        for outbox in kept:
            outbox.release()
        inbox.close()


def test_a_child_whose_supervisor_is_gone_neither_blocks_nor_raises():
    reader, writer = CTX.Pipe(duplex=False)
    outbox = Outbox(writer)
    outbox.put(Event("x", "read"), timeout=1)
    reader.close()  # the supervisor is gone
    for _ in range(3):
        outbox.put(Evaluation({"weights": np.zeros(BIG, np.uint8)}), timeout=1)
    began = time.monotonic()
    outbox.close(timeout=5)
    assert time.monotonic() - began < 5
    outbox.put(Event("x", "after close"), timeout=1)  # dropped, not raised


def test_one_drain_takes_a_message_larger_than_the_pipe_while_its_writer_writes(monkeypatch):
    """A tested policy's weights (about 300 KiB for the default actor) are more than a pipe holds: the drain
    waits for the rest of a message its writer is writing (a drain every 0.1 s would otherwise take one pipe's
    worth each time, and the last test of a run could miss the end)."""
    import spreeze.messages

    monkeypatch.setattr(spreeze.messages, "MESSAGE_WAIT_S", 10.0)  # what is tested is the wait, not its length
    inbox = Inbox(CTX)
    sender = start_sender(inbox, "evaluator", [300_000])
    try:
        assert inbox._channels["evaluator"].conn.poll(60)  # the first bytes are in
        messages = inbox.drain()
    finally:
        stop_process(sender, 0)
        inbox.close()
    assert [m.result["weights"].size for m in messages] == [300_000]


def test_a_message_that_cannot_be_unpickled_is_skipped_and_the_next_arrives():
    import os
    import pickle

    from spreeze.messages import FRAME

    inbox = Inbox(CTX)
    outbox = inbox.open("learner")
    try:
        os.write(outbox._conn.fileno(), FRAME.pack(5) + b"junk!")
        good = pickle.dumps(Event("learner", "after the bad one"))
        os.write(outbox._conn.fileno(), FRAME.pack(len(good)) + good)
        messages = inbox.drain()
        assert [m.text for m in messages] == ["after the bad one"]
        assert inbox._channels["learner"].unreadable == 1
    finally:
        outbox.release()
        inbox.close()
