"""The data streams of a training run: a fixed number S of streams, chosen when the run starts and kept in its
checkpoint, that every global batch is read from.

- A global batch of G rows takes b = G/S consecutive rows from every stream, stream-major: rows [s*b, (s+1)*b)
  come from stream s.
- Process p of P owns the contiguous block of whole streams [p*S/P, (p+1)*S/P); its data workers share that block
  in contiguous chunks.
- A resume on P' processes of d devices each reads on exactly where the run stopped when P' divides S and P'*d
  divides G.

Pure arithmetic on ints.
"""

from __future__ import annotations

from fractions import Fraction

from clip_jax.errors import InvalidInput

ALLOW_RESEED = ("set --config.resume_data=allow_reseed to restore the train state only and read on with new data "
                "iterators")


def owned(streams: int, processes: int, process: int) -> range:
    """The streams process `process` of `processes` reads: a contiguous block of S/P; P must divide S."""
    if streams % processes:
        raise ValueError(f"{processes} processes cannot own whole blocks of {streams} streams")
    size = streams // processes
    return range(process * size, (process + 1) * size)


def worker_chunks(block: range, workers: int) -> list[range]:
    """`block` split in order into min(max(workers, 1), len(block)) contiguous chunks, sizes differing by at most
    one, the larger first."""
    count = min(max(workers, 1), len(block))
    if not count:
        return []
    size, larger = divmod(len(block), count)
    starts = [block.start + i * size + min(i, larger) for i in range(count + 1)]
    return [range(a, b) for a, b in zip(starts, starts[1:])]


def feasible_process_counts(streams: int, global_batch: int, devices_per_process: int) -> list[int]:
    """Every process count P' (ascending) that can continue S streams: P' divides S and P'*d divides G."""
    return [p for p in range(1, streams + 1)
            if streams % p == 0 and global_batch % (p * devices_per_process) == 0]


def nearest_process_counts(streams: int, global_batch: int, devices_per_process: int,
                           processes: int) -> tuple[int | None, int | None]:
    """The largest feasible process count below `processes` and the smallest above it (None where there is none)."""
    counts = feasible_process_counts(streams, global_batch, devices_per_process)
    return (max((p for p in counts if p < processes), default=None),
            min((p for p in counts if p > processes), default=None))


def _valid_streams(global_batch: int, processes: int, shards: int | None) -> list[int]:
    """Every stream count a run of P processes can start with (ascending): multiples of P that divide G, at most
    `shards` in epoch mode."""
    top = global_batch if shards is None else min(global_batch, shards)
    return [s for s in range(processes, top + 1, processes) if global_batch % s == 0]


def _no_streams(processes: int, shards: int) -> InvalidInput:
    return InvalidInput(f"{shards} shards cannot give each of {processes} processes a data stream of its own in "
                        "epoch mode: set --config.dataset_resampled=True, or run on fewer processes")


def default_streams(global_batch: int, processes: int, devices_per_process: int, workers: int,
                    shards: int | None = None) -> int:
    """The stream count a new run takes: S = P*k with k | G/P, k <= 8 max(workers, 1) and S <= `shards`
    (epoch mode).

    Chosen to (1) let the most process counts in [P/2, P) that can split G continue the run, the larger first;
    (2) split evenly over the workers (least ceil(k/W)/(k/W)); (3) be the fewest streams.
    """
    w = max(workers, 1)
    smaller = [p for p in reversed(range((processes + 1) // 2, processes))  # the nearer first
               if global_batch % (p * devices_per_process) == 0]
    candidates = [s for s in _valid_streams(global_batch, processes, shards) if s // processes <= 8 * w]
    if not candidates:
        raise _no_streams(processes, shards)

    def rank(s):
        covered = tuple(s % p == 0 for p in smaller)
        k = s // processes
        return -sum(covered), tuple(not c for c in covered), Fraction(-(-k // w) * w, k), s
    return min(candidates, key=rank)


def check_streams(streams: int, global_batch: int, processes: int, shards: int | None = None) -> None:
    """Raises InvalidInput unless a run of P processes can start with S streams: S | G, P | S, S <= `shards`."""
    valid = _valid_streams(global_batch, processes, shards)
    if streams in valid:
        return
    if not valid and shards is not None and shards < processes:
        raise _no_streams(processes, shards)
    fits = f", at most the {shards} shards (epoch mode)" if shards is not None else ""
    near = [n for n in (max((s for s in valid if s < streams), default=None),
                        min((s for s in valid if s > streams), default=None)) if n is not None]
    fix = (" or ".join(f"--config.data_streams={n}" for n in near) if near
           else f"a global batch that {processes} processes divide")
    raise InvalidInput(f"{streams} data streams do not fit a global batch of {global_batch} on {processes} "
                       f"processes: the streams must divide the global batch and be a multiple of the process "
                       f"count{fits}; set {fix}")


def continuation_refusal(streams: int, global_batch: int, processes: int, devices_per_process: int,
                         where: str) -> str | None:
    """None when P processes of d devices can read on from checkpoint `where`'s S streams exactly, else one line
    saying why not and the process counts that can."""
    d = devices_per_process
    if streams % processes == 0 and global_batch % (processes * d) == 0:
        return None
    if streams % processes:
        why = (f"checkpoint {where} reads {streams} data streams, each owned whole by one process: {processes} "
               "processes cannot share them")
    else:
        why = (f"checkpoint {where} reads global batches of {global_batch}: {processes} processes of {d} devices "
               f"each ({processes * d} devices) cannot split them")
    near = [p for p in nearest_process_counts(streams, global_batch, d, processes) if p is not None]
    devices = f"{d} device" + ("" if d == 1 else "s")
    rule = f"the counts that divide {streams} and whose devices divide the global batch {global_batch}"
    if near:
        counts = " or ".join(map(str, near)) + (" process" if near == [1] else " processes")
        return f"{why}; relaunch on {counts} (of {devices} each: {rule}), or {ALLOW_RESEED}"
    return f"{why}; no process count of {devices} each can continue it ({rule}): {ALLOW_RESEED}"
