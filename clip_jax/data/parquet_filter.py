"""A filter expression (:mod:`clip_jax.data.filters`) on LAION's parquet metadata: count what it would drop, or
write the rows it keeps (an img2dataset input already filtered).

Column names are the parquet's own (LAION's are ``URL``, ``TEXT``, ``WIDTH``, ``HEIGHT``, ``similarity``,
``punsafe``, ``pwatermark``, ...); a column a rule names that a file lacks makes every row of that file fail the
rule as a missing field, counted like one in the shards. Only the columns the rules read are loaded for counting.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator, Sequence

from clip_jax.data import filters
from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.runtime import ownership


@dataclasses.dataclass
class ParquetReport:
    files: int = 0
    rows: int = 0
    kept: int = 0
    dropped: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # first rule failed
    rules_alone: collections.Counter = dataclasses.field(default_factory=collections.Counter)


def _parquet_file(path: str):
    import os

    import pyarrow.parquet as pq

    if not os.path.isfile(path):
        raise MissingInput(f"parquet file {path!r} does not exist")
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
        raise InvalidInput(f"{path} is not a readable parquet file: {e}") from e


def _records(path: str, columns: Sequence[str] | None, batch_rows: int = 65_536) -> Iterator[list[dict]]:
    """Row dicts of ``path`` in batches; ``columns``: those to read (the ones the file has), None: all."""
    file = _parquet_file(path)
    present = None if columns is None else [c for c in dict.fromkeys(columns) if c in file.schema_arrow.names]
    if present == []:  # no column a rule reads: rows with no fields
        for group in range(file.num_row_groups):
            yield [{} for _ in range(file.metadata.row_group(group).num_rows)]
        return
    for batch in file.iter_batches(batch_size=batch_rows, columns=present):
        yield batch.to_pylist()


def _need_expression(sample_filter: filters.SampleFilter) -> tuple[str, ...]:
    if sample_filter.min_image_size or sample_filter.min_caption_chars:
        raise InvalidInput("parquet files are filtered by the expression only: write the size and caption rules "
                           "with the file's columns, e.g. \"WIDTH >= 64 and HEIGHT >= 64\"")
    if not sample_filter.rules:
        raise InvalidInput("give a filter expression (--filter) to apply to the parquet rows")
    return tuple(f for rule in sample_filter.rules for f in rule.term.fields())


def count(paths: Sequence[str], sample_filter: filters.SampleFilter) -> ParquetReport:
    """What ``sample_filter`` keeps and drops of the rows of ``paths``, per rule."""
    columns = _need_expression(sample_filter)
    report = ParquetReport()
    for path in paths:
        report.files += 1
        for rows in _records(path, columns):
            for row in rows:
                report.rows += 1
                reason = sample_filter.check_record(row)
                if reason is None:
                    report.kept += 1
                    continue
                report.dropped[reason] += 1
                report.rules_alone.update(r.text for r in sample_filter.rules if r.check(row) is not None)
    return report


def write_filtered(paths: Sequence[str], sample_filter: filters.SampleFilter, out_path: str) -> ParquetReport:
    """Writes the rows ``sample_filter`` keeps (all columns, the first file's schema) to ``out_path``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    _need_expression(sample_filter)
    ownership.claim_file(out_path, writing="the filtered rows", change="give another --out")
    report, writer = ParquetReport(), None
    try:
        for path in paths:
            report.files += 1
            file = _parquet_file(path)
            for batch in file.iter_batches(batch_size=65_536):
                rows = batch.to_pylist()
                keep = []
                for row in rows:
                    reason = sample_filter.check_record(row)
                    keep.append(reason is None)
                    if reason is not None:
                        report.dropped[reason] += 1
                report.rows += len(rows)
                report.kept += sum(keep)
                table = pa.Table.from_batches([batch]).filter(pa.array(keep, pa.bool_()))
                if writer is None:
                    writer = pq.ParquetWriter(out_path, table.schema)
                writer.write_table(table.cast(writer.schema))
    finally:
        if writer is not None:
            writer.close()
    return report
