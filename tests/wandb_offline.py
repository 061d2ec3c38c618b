"""Reads back what wandb wrote in offline mode (`RUN_DIR/wandb/offline-run-*/run-ID.wandb`), with wandb's own
protobuf messages: the file is a LevelDB-style log (32 KiB blocks of records, each with a 7-byte header: CRC, length,
kind) after a 7-byte file header."""

import glob
import os
import struct

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str) -> list:
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path} is not a wandb log"
    out, pieces, pos = [], [], HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the rest of a block too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            break
        pieces.append(data[pos + HEADER:pos + HEADER + length])
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            out.append(record)
            pieces = []
    return out


def offline_runs(run_dir: str) -> list[dict]:
    """Each offline run under `run_dir` (in start order): its id, project, name, config and history
    {step: {key: value}}."""
    import json

    runs = []
    for folder in sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*"))):
        (path,) = glob.glob(os.path.join(folder, "run-*.wandb"))
        run = {"history": {}, "config": {}}
        for record in records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run.update(id=record.run.run_id, project=record.run.project, name=record.run.display_name)
                run["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "config":
                run["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                run["history"].setdefault(int(items["_step"]), {}).update(items)
        runs.append(run)
    return runs
