"""The data-streams layout as arithmetic: which streams a process and its workers read, which process counts can
resume a run, the stream count a new run takes (the reference run's numbers, and a brute force over every divisor
of the global batch), and the one-line refusals."""

import functools
from fractions import Fraction

import numpy as np
import pytest

from clip_jax.data import streams
from clip_jax.errors import InvalidInput

G = 86016  # 2^12 * 3 * 7: the reference run's global batch
WHERE = "logs/x/checkpoints/8"


@functools.cache
def divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


# -- who reads what ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_streams, processes", [(1, 1), (8, 2), (12, 3), (10752, 384)])
def test_processes_own_contiguous_blocks_that_cover_every_stream_once(n_streams, processes):
    blocks = [streams.owned(n_streams, processes, p) for p in range(processes)]
    assert [s for block in blocks for s in block] == list(range(n_streams))
    assert {len(block) for block in blocks} == {n_streams // processes}


def test_a_process_count_that_does_not_divide_the_streams_is_an_error():
    with pytest.raises(ValueError):
        streams.owned(8, 3, 0)


@pytest.mark.parametrize("processes, devices", [(1, 8), (2, 4), (4, 2), (8, 1), (4, 1)])
def test_a_processs_streams_are_its_devices_rows_of_the_global_batch(processes, devices):
    """Stream-major rows (stream s gives rows [s*b, (s+1)*b)): the rows of a process's devices, process-major,
    come from exactly the streams it owns."""
    n_streams, global_batch = 8, 32
    stream_of_row = np.repeat(np.arange(n_streams), global_batch // n_streams)
    per_process = np.split(stream_of_row, processes)  # the devices of process p hold the p-th contiguous share
    for p in range(processes):
        assert sorted(set(per_process[p].tolist())) == list(streams.owned(n_streams, processes, p))


@pytest.mark.parametrize("size", [0, 1, 5, 7, 12, 28])
@pytest.mark.parametrize("workers", [0, 1, 2, 3, 6, 40])
def test_worker_chunks_split_a_block_as_array_split_does(size, workers):
    block = range(100, 100 + size)
    chunks = streams.worker_chunks(block, workers)
    count = min(max(workers, 1), size)
    expected = [c.tolist() for c in np.array_split(np.arange(100, 100 + size), count)] if count else []
    assert [list(c) for c in chunks] == expected


# -- which process counts can resume --------------------------------------------------------------------------------

@pytest.mark.parametrize("n_streams, global_batch, devices", [(8, 32, 1), (8, 32, 4), (10752, G, 1), (12, 96, 8)])
def test_feasible_process_counts_are_the_divisors_whose_devices_divide_the_batch(n_streams, global_batch, devices):
    expected = [p for p in divisors(n_streams) if (global_batch / (p * devices)).is_integer()]
    assert streams.feasible_process_counts(n_streams, global_batch, devices) == expected


def test_nearest_process_counts_on_either_side():
    assert streams.nearest_process_counts(8, 32, 1, 3) == (2, 4)
    assert streams.nearest_process_counts(8, 32, 1, 16) == (8, None)
    assert streams.nearest_process_counts(8, 32, 16, 4) == (2, None)
    assert streams.nearest_process_counts(12, 96, 1, 1) == (None, 2)
    assert streams.nearest_process_counts(10752, G, 1, 383) == (336, 384)


# -- the stream count of a new run ------------------------------------------------------------------------------------

def brute_force_streams(global_batch, processes, devices, workers, shards=None):
    """Every S = P*k dividing G with k <= 8 workers (and S <= shards), narrowed in stages: most smaller process
    counts covered; of those, the set holding the larger counts; the least uneven worker split (the busiest worker's
    streams over the mean); the fewest streams."""
    w = max(workers, 1)
    smaller = [p for p in divisors(global_batch) if processes / 2 <= p < processes
               and global_batch % (p * devices) == 0]
    candidates = [s for s in divisors(global_batch) if s % processes == 0 and s <= 8 * w * processes
                  and (shards is None or s <= shards)]

    def covered(s):
        return sorted((p for p in smaller if s % p == 0), reverse=True)

    def unevenness(s):
        k = s // processes
        busiest = max(len(c) for c in np.array_split(np.arange(k), w))
        return Fraction(busiest * w, k)

    most = max(len(covered(s)) for s in candidates)
    candidates = [s for s in candidates if len(covered(s)) == most]
    best_set = max(covered(s) for s in candidates)
    candidates = [s for s in candidates if covered(s) == best_set]
    least = min(unevenness(s) for s in candidates)
    return min(s for s in candidates if unevenness(s) == least), smaller


@pytest.mark.parametrize("processes, devices, workers, smaller", [
    (384, 1, 6, [192, 224, 256, 336]),
    (96, 4, 24, [48, 56, 64, 84]),
])
def test_the_reference_run_takes_10752_streams_that_every_smaller_count_can_resume(processes, devices, workers,
                                                                                   smaller):
    chosen = streams.default_streams(G, processes, devices, workers)
    assert chosen == 10752
    assert brute_force_streams(G, processes, devices, workers) == (10752, smaller)
    assert all(p in streams.feasible_process_counts(chosen, G, devices) for p in smaller)


@pytest.mark.parametrize("global_batch", [7, 32, 96, G])
def test_a_demo_run_takes_one_stream(global_batch):
    assert streams.default_streams(global_batch, 1, 1, 1) == 1


@pytest.mark.parametrize("processes", [1, 2])
def test_a_tiny_run_without_workers_takes_one_stream_per_process(processes):
    assert streams.default_streams(32, processes, 4, 0) == processes


CASES = [(gb, p, d, w, shards)
         for gb in (96, 720, 1536, 4608)
         for p in (1, 2, 3, 4, 6, 8, 12)
         for d in (1, 2, 4)
         for w in (0, 1, 3, 4)
         for shards in (None, p, 4 * p + 1)
         if gb % (p * d) == 0]


def test_default_streams_agrees_with_a_brute_force_over_every_divisor():
    for case in CASES:
        assert streams.default_streams(*case) == brute_force_streams(*case)[0], case


def test_epoch_mode_with_fewer_shards_than_processes_is_refused_in_one_line():
    with pytest.raises(InvalidInput) as refused:
        streams.default_streams(64, 8, 1, 2, shards=5)
    message = str(refused.value)
    assert "\n" not in message and "5 shards" in message and "8 processes" in message
    assert "--config.dataset_resampled=True" in message and "fewer processes" in message


# -- an explicit stream count -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_streams, global_batch, processes, shards, below, above", [
    (12, 64, 2, None, 8, 16),  # does not divide the batch
    (6, 96, 4, None, 4, 8),  # not a multiple of the processes
    (32, 96, 4, 20, 16, None),  # more streams than shards: 16 is the largest that fits
    (2, 96, 4, None, None, 4),
])
def test_a_stream_count_that_does_not_fit_names_the_nearest_that_do(n_streams, global_batch, processes, shards,
                                                                   below, above):
    valid = [s for s in divisors(global_batch) if s % processes == 0 and (shards is None or s <= shards)]
    assert below == max((s for s in valid if s < n_streams), default=None)
    assert above == min((s for s in valid if s > n_streams), default=None)
    with pytest.raises(InvalidInput) as refused:
        streams.check_streams(n_streams, global_batch, processes, shards)
    message = str(refused.value)
    assert "\n" not in message and f"{n_streams} data streams" in message
    named = [f"--config.data_streams={n}" for n in (below, above) if n is not None]
    assert all(n in message for n in named) and message.count("--config.data_streams=") == len(named)


def test_a_stream_count_that_fits_passes():
    for n_streams in (2, 4, 8, 16, 32):
        streams.check_streams(n_streams, 32, 2, shards=32)
    with pytest.raises(InvalidInput, match="--config.dataset_resampled=True"):
        streams.check_streams(4, 32, 4, shards=3)


# -- resuming on another process count --------------------------------------------------------------------------------

def test_a_count_that_cannot_share_the_streams_is_refused_naming_both_neighbours():
    assert streams.continuation_refusal(8, 32, 3, 1, WHERE) == (
        "checkpoint logs/x/checkpoints/8 reads 8 data streams, each owned whole by one process: 3 processes cannot "
        "share them; relaunch on 2 or 4 processes (of 1 device each: the counts that divide 8 and whose devices "
        "divide the global batch 32), or set --config.resume_data=allow_reseed to restore the train state only and "
        "read on with new data iterators")


def test_a_count_whose_devices_do_not_divide_the_batch_is_refused_naming_it():
    message = streams.continuation_refusal(8, 32, 4, 16, WHERE)
    assert "4 processes of 16 devices each (64 devices)" in message and "global batches of 32" in message
    assert "relaunch on 2 processes (of 16 devices each" in message and "allow_reseed" in message


def test_one_sided_and_impossible_continuations_name_what_there_is():
    """No count above 8 divides 8; no count of 3 devices divides 32 (1 is feasible whenever d divides G, so the
    side below is never the empty one alone)."""
    assert "relaunch on 8 processes (of 1 device" in streams.continuation_refusal(8, 32, 16, 1, WHERE)
    none = streams.continuation_refusal(8, 32, 2, 3, WHERE)
    assert "relaunch" not in none and "no process count of 3 devices each" in none and "allow_reseed" in none


@pytest.mark.parametrize("processes, devices", [(1, 1), (2, 1), (4, 2), (8, 4), (1, 32)])
def test_every_feasible_count_continues(processes, devices):
    assert streams.continuation_refusal(8, 32, processes, devices, WHERE) is None
    assert processes in streams.feasible_process_counts(8, 32, devices)
