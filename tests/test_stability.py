"""When the trainer calls a run unstable."""

import math

import pytest

from clip_jax.training.stability import InstabilityMonitor


def feed(monitor, steps):
    return [monitor.observe(loss, finite) for loss, finite in steps]


def test_non_finite_steps_in_a_row_reach_the_patience():
    monitor = InstabilityMonitor(nan_patience=3)
    verdicts = feed(monitor, [(2.0, True), (math.nan, False), (math.nan, False), (2.0, True), (math.inf, False),
                              (math.nan, False), (math.nan, False)])
    assert verdicts[:6] == [None] * 6  # the finite step in between resets the count
    assert verdicts[6] == "3 non-finite steps in a row"


def test_a_spike_is_measured_against_the_recent_mean_only_once_there_is_history():
    monitor = InstabilityMonitor(nan_patience=3, spike_factor=1.5, window=4, min_history=3)
    assert feed(monitor, [(10.0, True), (1.0, True)]) == [None, None]  # too little history to judge
    assert feed(monitor, [(1.0, True), (1.0, True), (1.0, True), (1.0, True)]) == [None] * 4  # window forgets 10
    assert monitor.observe(1.49, True) is None  # below 1.5 x 1.0; the window is now 1, 1, 1, 1.49
    assert monitor.observe(1.68, True) is None  # 1.5 x 1.1225 = 1.68375
    assert monitor.observe(2.0, True) == "loss spike 2.0000 > 1.5 x recent mean 1.2925"  # window 1, 1, 1.49, 1.68


def test_spikes_and_non_finite_losses_stay_out_of_the_history():
    monitor = InstabilityMonitor(nan_patience=5, spike_factor=2.0, window=3, min_history=3)
    feed(monitor, [(1.0, True)] * 3)
    assert monitor.observe(5.0, True) is not None
    assert monitor.observe(math.nan, False) is None
    assert list(monitor.history) == [1.0, 1.0, 1.0]
    monitor.reset()
    assert monitor.observe(5.0, True) is None  # after a rollback the old history no longer counts


def test_spike_check_is_off_at_factor_zero():
    monitor = InstabilityMonitor(nan_patience=1, spike_factor=0.0, min_history=1)
    assert feed(monitor, [(1.0, True), (1e6, True)]) == [None, None]
    with pytest.raises(ValueError, match="nan_patience"):
        InstabilityMonitor(nan_patience=0)
