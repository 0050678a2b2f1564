"""DynamicBatcher on a small numpy backend: merging, splitting, limits, timeouts, draining."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from hpcml.serve.codec.oip import TensorSpec
from hpcml.serve.runtime.batcher import (
    BackendFailed,
    BatcherClosed,
    DynamicBatcher,
    QueueFull,
    RequestTimeout,
)


class AffineBackend:
    """y = 2x + row index within the batch: a wrong split or order shows in the answer."""

    name = "numpy"
    platform = "numpy"
    input = TensorSpec("input", "FP32", (3,))
    output = TensorSpec("output", "FP32", (3,))

    def __init__(self, gate: threading.Event | None = None, fail: bool = False) -> None:
        self.sizes: list[int] = []
        self.gate = gate
        self.fail = fail

    def load(self) -> None:
        pass

    def close(self) -> None:
        pass

    def infer(self, x: np.ndarray) -> np.ndarray:
        if self.gate is not None:
            self.gate.wait(10)
        self.sizes.append(len(x))
        if self.fail:
            raise ValueError("weights on fire")
        return 2 * x


def _x(value: float, n: int = 1) -> np.ndarray:
    return np.full((n, 3), value, dtype=np.float32)


def test_concurrent_requests_share_one_forward_pass_and_get_their_own_rows() -> None:
    backend = AffineBackend()

    async def main() -> list[np.ndarray]:
        b = DynamicBatcher([backend], max_batch_size=64, max_queue_delay_ms=200)
        await b.start()
        results = await asyncio.gather(*(b.infer(_x(i, n=1 + i % 3), 5.0) for i in range(12)))
        await b.close()
        return [r.output for r in results]

    outputs = asyncio.run(main())
    assert backend.sizes == [sum(1 + i % 3 for i in range(12))]
    for i, out in enumerate(outputs):
        np.testing.assert_array_equal(out, _x(2 * i, n=1 + i % 3))


def test_batches_never_exceed_max_batch_size() -> None:
    backend = AffineBackend()

    async def main() -> None:
        b = DynamicBatcher([backend], max_batch_size=4, max_queue_delay_ms=50)
        await b.start()
        await asyncio.gather(*(b.infer(_x(i), 5.0) for i in range(10)))
        await b.close()

    asyncio.run(main())
    assert sum(backend.sizes) == 10
    assert max(backend.sizes) == 4


def test_preferred_sizes_cut_batches_to_the_largest_that_fits() -> None:
    backend = AffineBackend()

    async def main() -> None:
        b = DynamicBatcher(
            [backend], max_batch_size=16, max_queue_delay_ms=100, preferred_batch_sizes=[4]
        )
        await b.start()
        await asyncio.gather(*(b.infer(_x(i), 5.0) for i in range(10)))
        await b.close()

    asyncio.run(main())
    # 10 queued at once: two preferred batches of 4, then the remaining 2 when the delay ends.
    assert backend.sizes == [4, 4, 2]


def test_full_queue_refuses_at_once_and_recovers() -> None:
    gate = threading.Event()
    backend = AffineBackend(gate)

    async def main() -> tuple[int, int]:
        b = DynamicBatcher([backend], max_batch_size=2, max_queue_delay_ms=0, max_queue_size=4)
        await b.start()
        first = asyncio.create_task(b.infer(_x(0, 2), 10.0))  # taken by the (blocked) worker
        await asyncio.sleep(0.05)
        waiting = [asyncio.create_task(b.infer(_x(1, 2), 10.0)) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert b.queue_depth == 4
        refused = 0
        for _ in range(5):
            try:
                await b.infer(_x(2), 10.0)
            except QueueFull:
                refused += 1
        gate.set()
        await asyncio.gather(first, *waiting)
        after = await b.infer(_x(3), 10.0)
        await b.close()
        return refused, int(after.output[0, 0])

    refused, after = asyncio.run(main())
    assert refused == 5
    assert after == 6


def test_timed_out_request_leaves_the_queue_and_is_never_computed() -> None:
    gate = threading.Event()
    backend = AffineBackend(gate)

    async def main() -> int:
        b = DynamicBatcher([backend], max_batch_size=1, max_queue_delay_ms=0, max_queue_size=8)
        await b.start()
        busy = asyncio.create_task(b.infer(_x(0), 10.0))
        await asyncio.sleep(0.05)
        with pytest.raises(RequestTimeout):
            await b.infer(_x(1), 0.05)
        depth = b.queue_depth
        gate.set()
        await busy
        await b.close()
        return depth

    assert asyncio.run(main()) == 0
    assert backend.sizes == [1]


def test_close_finishes_queued_requests_then_refuses_new_ones() -> None:
    backend = AffineBackend()

    async def main() -> tuple[list[float], bool]:
        b = DynamicBatcher([backend], max_batch_size=8, max_queue_delay_ms=10_000)
        await b.start()
        pending = [asyncio.create_task(b.infer(_x(i), 30.0)) for i in range(5)]
        await asyncio.sleep(0.05)
        await b.close()
        done = [float(t.result().output[0, 0]) for t in pending]
        try:
            await b.infer(_x(9), 1.0)
            refused = False
        except BatcherClosed:
            refused = True
        return done, refused

    done, refused = asyncio.run(main())
    assert done == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert refused


def test_backend_error_fails_its_batch_and_the_worker_keeps_serving() -> None:
    backend = AffineBackend(fail=True)

    async def main() -> float:
        b = DynamicBatcher([backend], max_batch_size=8, max_queue_delay_ms=0)
        await b.start()
        with pytest.raises(BackendFailed, match="weights on fire"):
            await b.infer(_x(1), 5.0)
        backend.fail = False
        ok = await b.infer(_x(2), 5.0)
        await b.close()
        return float(ok.output[0, 0])

    assert asyncio.run(main()) == 4.0


def test_several_instances_compute_batches_concurrently() -> None:
    gate = threading.Event()
    backends = [AffineBackend(gate), AffineBackend(gate)]

    async def main() -> None:
        b = DynamicBatcher(backends, max_batch_size=1, max_queue_delay_ms=0)
        await b.start()
        tasks = [asyncio.create_task(b.infer(_x(i), 10.0)) for i in range(2)]
        await asyncio.sleep(0.1)
        gate.set()
        await asyncio.gather(*tasks)
        await b.close()

    asyncio.run(main())
    # With one instance the second request would have waited behind the gated first one.
    assert backends[0].sizes == [1] and backends[1].sizes == [1]
