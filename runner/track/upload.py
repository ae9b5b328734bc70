"""`python -m runner.track.upload <run dir>`: send MLflow what a run kept while its tracking
server was lost (issue 16).

A run whose server stopped answering trains on and appends every call it would have made to
`<run dir>/mlflow_pending.jsonl` (runner/track/tracker.py). This replays them, in order, into
the same run: metrics with their original steps and timestamps, params, tags, the run
directory's files as artifacts, and the final status. Each record sent is noted in
`mlflow_pending.sent`, so an upload interrupted in turn resumes without sending twice.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from mlflow.entities import Metric, Param, RunTag

from runner.core.diskfull import disk_full, writing
from runner.core.errors import DiskFull, TrackingError
from runner.track.client import client_for
from runner.track.server import check_reachable
from runner.track.tracker import PENDING


def _send(client, record: dict) -> None:
    run_id = record["run_id"]
    if "metrics" in record:
        client.log_batch(run_id, metrics=[Metric(*m) for m in record["metrics"]])
    elif "params" in record:
        client.log_batch(run_id, params=[Param(k, v) for k, v in record["params"].items()])
    elif "tags" in record:
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in record["tags"].items()])
    elif "artifact" in record:
        client.log_artifact(run_id, record["artifact"], record["artifact_path"])
    elif "text" in record:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / record["name"]
            path.write_text(record["text"])
            client.log_artifact(run_id, str(path))
    elif "status" in record:
        client.set_terminated(run_id, status=record["status"], end_time=record["end_time"])


def upload(run_dir: Path) -> int:
    """Send the pending records of `run_dir`; returns how many were sent now."""
    pending = run_dir / PENDING
    if not pending.exists():
        raise TrackingError(f"{pending}: no such file; this run has nothing left to upload")
    records = [json.loads(line) for line in pending.read_text().splitlines() if line.strip()]
    sent_path = pending.with_suffix(".sent")
    done = int(sent_path.read_text()) if sent_path.exists() else 0
    if done >= len(records):
        return 0
    check_reachable(records[0]["uri"])
    client = client_for(records[0]["uri"])
    for i in range(done, len(records)):
        _send(client, records[i])
        with writing(sent_path):
            sent_path.write_text(str(i + 1))
    return len(records) - done


def command_line() -> argparse.ArgumentParser:
    """The command line of `python -m runner.track.upload`."""
    parser = argparse.ArgumentParser(prog="python -m runner.track.upload", description=__doc__)
    parser.add_argument("run_dir", type=Path, help="the run directory the run printed")
    return parser


def main(argv: list[str]) -> None:
    args = command_line().parse_args(argv)
    try:
        sent = upload(args.run_dir)
    except (TrackingError, DiskFull) as err:
        raise SystemExit(f"error: {err}") from None
    except Exception as err:  # MLflow's copy of an artifact onto a full disk (issue 27)
        full = disk_full(err)
        if full is None:
            raise
        raise SystemExit(f"error: {full}") from None
    records = json.loads((args.run_dir / PENDING).read_text().splitlines()[0])
    print(f"tfmemlab: sent {sent} pending record(s) to run {records['run_id']} at {records['uri']}")


if __name__ == "__main__":
    main(sys.argv[1:])
