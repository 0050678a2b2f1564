"""The torchrun agent's signal gate (hpcml.launch.agent.SignalGate) with real signals sent to
this process: the first raises, a duplicate is ignored, a lost first is delivered again, and a
signal while the workers are being stopped for the first is ignored."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from hpcml.launch.agent import DUPLICATE_S, SignalGate


@pytest.fixture
def gate() -> Iterator[SignalGate]:
    g = SignalGate()
    old = signal.signal(signal.SIGUSR2, g.handle)
    try:
        yield g
    finally:
        g.stopping = True  # no re-delivery after the test
        signal.signal(signal.SIGUSR2, old)


def send_and_wait(seconds: float) -> None:
    os.kill(os.getpid(), signal.SIGUSR2)
    time.sleep(seconds)  # a Python handler runs here, in the main thread


def test_first_raises_a_duplicate_is_ignored_and_a_lost_one_comes_again(gate: SignalGate) -> None:
    with pytest.raises(SignalException) as first:
        send_and_wait(0.5)
    assert first.value.sigval == signal.SIGUSR2
    # The same request delivered again at once (process group + hpcml train): ignored.
    send_and_wait(0.1)
    # Nobody started stopping the workers (the exception was lost): it is delivered again.
    with pytest.raises(SignalException):
        time.sleep(DUPLICATE_S + 2.0)


def test_while_stopping_the_workers_further_signals_are_ignored(gate: SignalGate) -> None:
    with pytest.raises(SignalException):
        send_and_wait(0.5)
    gate.stopping = True  # the agent's _shutdown for that signal began
    send_and_wait(DUPLICATE_S + 1.0)  # later, and the retry timer's time: nothing raises
    gate.reset()  # new workers (elastic restart): the next signal counts again
    with pytest.raises(SignalException):
        send_and_wait(0.5)
