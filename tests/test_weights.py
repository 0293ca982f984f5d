import multiprocessing as mp
import time

import numpy as np
import torch

from spreeze.weights import SharedWeights

CTX = mp.get_context("spawn")


def make_module():
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def publish_loop(handle, n_versions: int) -> None:
    torch.set_num_threads(1)
    weights = SharedWeights.attach(handle)
    module = make_module()
    try:
        for version in range(1, n_versions + 1):
            with torch.no_grad():
                for p in module.parameters():
                    p.fill_(float(version))  # every value of version v equals v: a torn read mixes values
            weights.publish(module, version)
    finally:
        weights.close()


def test_reader_never_sees_a_torn_set_and_versions_only_grow():
    module = make_module()
    weights = SharedWeights.create(module, CTX)
    try:
        writer = CTX.Process(target=publish_loop, args=(weights.handle, 3000))
        writer.start()
        reads, last_version = 0, 0
        while writer.is_alive() or reads == 0:
            flat, version = weights.read()
            if version > 0:
                assert np.all(flat == flat[0]), f"torn read at version {version}"
                assert flat[0] == version
                reads += 1
            assert version >= last_version
            last_version = version
        writer.join(timeout=30)
        assert writer.exitcode == 0
        assert reads > 10
        reader = make_module()
        assert weights.pull(reader, have_version=-1) == 3000
        assert all(torch.all(p == 3000.0) for p in reader.parameters())
    finally:
        weights.close()


def test_pull_is_a_no_op_for_the_held_version():
    module = make_module()
    weights = SharedWeights.create(module, CTX)
    try:
        reader = make_module()
        assert weights.pull(reader, -1) == 0
        begun = time.perf_counter()
        for _ in range(1000):
            weights.pull(reader, 0)
        assert time.perf_counter() - begun < 0.5
        for a, b in zip(module.parameters(), reader.parameters()):
            assert torch.equal(a, b)
    finally:
        weights.close()
