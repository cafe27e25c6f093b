"""Read offline W&B runs (<dir>/wandb/offline-run-*/run-<id>.wandb) back: each run's id, project, name, config
and history, as `wandb sync` would send them.

A .wandb file is wandb's record log: a 7-byte header (b":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of
records, each with a (crc32c, length, type) header; type 1 is a whole record, 2/3/4 the first, middle and last
pieces of one that spans blocks. Each record is a `wandb.proto.wandb_internal_pb2.Record` protobuf.
"""
from __future__ import annotations

import glob
import json
import os
import struct
import time

HEADER = struct.Struct("<4sHB")
RECORD = struct.Struct("<IHB")
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str) -> list[bytes]:
    with open(path, "rb") as f:
        data = f.read()
    ident, magic, version = HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (path, ident, magic, version)
    out, pending, pos = [], b"", HEADER.size
    while pos + RECORD.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < RECORD.size:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = RECORD.unpack_from(data, pos)
        pos += RECORD.size
        if kind == 0 and length == 0:  # zero padding up to the next block
            pos += left - RECORD.size
            continue
        if pos + length > len(data):  # still being written
            break
        chunk, pos = data[pos:pos + length], pos + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            out.append(pending + chunk)
    return out


def read_run(path: str) -> dict:
    """{"id", "project", "name", "start" (ns), "config", "history": [{key: value}, ...], "complete"} of one
    .wandb file; complete once it holds the run's `exit` record."""
    from wandb.proto import wandb_internal_pb2 as pb

    run = {"config": {}, "history": [], "complete": False}
    for raw in records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run.update(id=rec.run.run_id, project=rec.run.project, name=rec.run.display_name,
                       start=rec.run.start_time.ToNanoseconds())
            run["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            run["config"].update({i.key: json.loads(i.value_json) for i in rec.config.update})
        elif kind == "exit":
            run["complete"] = True
        elif kind == "history":
            run["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                   for i in rec.history.item})
    return run


def offline_runs(output_dir: str, timeout: float = 20.0) -> list[dict]:
    """The offline runs under <output_dir>/wandb/, in the order they started (a second run of the same id in
    the same second gets the folder name suffixed `-1`, which sorts before the first's). wandb's service writes
    a run's file after `finish()` returns, so this waits until each holds its closing `exit` record."""
    deadline = time.monotonic() + timeout
    paths = glob.glob(os.path.join(output_dir, "wandb", "offline-run-*", "run-*.wandb"))
    while True:
        runs = [read_run(p) for p in paths]
        if all(run["complete"] for run in runs) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert all(run["complete"] for run in runs), [p for p, run in zip(paths, runs) if not run["complete"]]
    return sorted(runs, key=lambda run: run["start"])


def scalars(run: dict, key: str) -> dict[int, float]:
    """step -> value of `key` in a run's history."""
    return {row["_step"]: row[key] for row in run["history"] if key in row}
