"""StopSignals: one line while setting up, recorded while deferred, a request is not a signal."""

from __future__ import annotations

import os
import signal

import pytest

from torchtune_grpo.errors import Interrupted
from torchtune_grpo.training.interrupts import StopSignals, signals_only_logged


def test_setting_up_raises_a_one_line_interruption_and_restore_puts_handlers_back():
    before = signal.getsignal(signal.SIGTERM)
    stop = StopSignals("the run").install()
    try:
        with pytest.raises(Interrupted, match="SIGTERM while setting up the run") as info:
            os.kill(os.getpid(), signal.SIGTERM)
        assert info.value.exit_code == 143
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_deferred_signals_are_recorded_and_a_second_ctrl_c_stops_at_once():
    stop = StopSignals("the run", quiet=True).install()
    try:
        with stop.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested == "SIGTERM" and stop.signalled
            with pytest.raises(Interrupted, match="second Ctrl-C"):
                os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()


def test_a_request_stops_the_loop_but_is_not_a_signal():
    """A time budget (`python -m benchmarks.ablate`) asks the loop to stop; evaluations still
    finish."""
    stop = StopSignals()
    stop.request("budget")
    assert stop.requested == "budget" and not stop.signalled


def test_signals_only_logged_keeps_the_process_going():
    with signals_only_logged("rollout rank 2"):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
