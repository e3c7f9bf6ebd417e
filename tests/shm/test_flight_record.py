"""The flight recorder of a "pycomm" group (See Note [Flight recorder] in
csrc/shm/flight.cpp): every operation recorded with its number, what it was and how far it
got; written by the backend at the group's first failure into $PYCOMM_FLIGHT_RECORD_DIR,
or on demand (a call, or SIGUSR2 while a rank is stuck in a collective); merged by
`python -m pycomm.flight_record`, which names the rank that is behind, or the one that ran
a forward the others did not."""

from __future__ import annotations

import datetime
import glob
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import pycomm
from pycomm import flight_record
from tests.support.ddp_models import tanh_mlp
from tests.support.multirank import run_ranks


def _records(rank, world_size):
    for n in (4, 300_000):
        dist.all_reduce(torch.ones(n))
    dist.broadcast(torch.ones(3), src=0)
    entries = pycomm.shm.flight_record()
    assert [e["op"] for e in entries] == ["all_reduce", "all_reduce", "broadcast"], entries
    assert [e["seq"] for e in entries] == [0, 1, 2], entries
    assert [e["bytes"] for e in entries] == [16, 1_200_000, 12], entries
    assert all(e["state"] == "completed" and e["dtype"] == "float32" for e in entries), entries
    assert all(0 < e["queued_ns"] <= e["started_ns"] <= e["ended_ns"] for e in entries)
    assert all(e["bucket"] == -1 for e in entries)  # not DDP's


def test_every_operation_is_recorded_in_order():
    run_ranks(_records, 2, backend="pycomm")


def _ddp_labels(rank, world_size):
    ddp = pycomm.DistributedDataParallel(tanh_mlp(), bucket_cap_mb=0.001)
    for _ in range(2):
        with ddp.no_sync():
            ddp(torch.randn(4, 24)).sum().backward()
        ddp(torch.randn(4, 24)).sum().backward()
    buckets = [e for e in pycomm.shm.flight_record(ddp.gradient_group) if e["bucket"] >= 0]
    count = len(ddp.reducer.bucket_indices())
    assert [e["bucket"] for e in buckets] == list(range(count)) * 2, buckets
    assert [e["step"] for e in buckets] == [0] * count + [1] * count, buckets
    assert all(e["forwards"] == 2 for e in buckets), buckets  # one no_sync + the synced one


def test_ddp_buckets_carry_their_step_and_forwards():
    run_ranks(_ddp_labels, 2)


def _hung(rank, world_size, directory):
    os.environ["PYCOMM_FLIGHT_RECORD_DIR"] = directory
    for _ in range(3):
        dist.all_reduce(torch.ones(8))
    if rank == 1:  # hangs: never issues the fourth; dumps on demand afterwards
        time.sleep(4)
        pycomm.shm.dump_flight_record(directory)
        return
    with pytest.raises(dist.DistBackendError, match="Timed out"):
        dist.all_reduce(torch.ones(8))  # the group's timeout: 2 s


def test_a_hung_rank_is_named_behind_at_its_operation(tmp_path):
    run_ranks(_hung, 2, backend="pycomm", group_timeout_s=2.0, directory=str(tmp_path))
    groups = flight_record.load(str(tmp_path))
    assert len(groups) == 1, os.listdir(tmp_path)
    said = flight_record.report(next(iter(groups.values())))
    assert ("rank 1 is behind: its last operation is #2 all_reduce of 32 bytes (float32) "
            "(completed), while rank(s) [0] went up to #3") in said, said
    assert "the ranks ahead waited for it at #3 all_reduce" in said, said
    assert "(failed: pycomm all_reduce (operation #3 on rank 0): Timed out" in said, said
    out = subprocess.run([sys.executable, "-m", "pycomm.flight_record", str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    assert "rank 1 is behind" in out and "# group pycomm-" in out, out


def test_torchs_analyzer_reads_the_records_and_names_the_hung_rank(tmp_path):
    run_ranks(_hung, 2, backend="pycomm", group_timeout_s=2.0, directory=str(tmp_path))
    out_dir = tmp_path / "torch"
    out = subprocess.run([sys.executable, "-m", "pycomm.flight_record", str(tmp_path),
                          "--torch-dir", str(out_dir)],
                         capture_output=True, text=True, check=True).stdout
    (group,) = out_dir.iterdir()
    assert f"fr_trace {group} --prefix rank_" in out, out
    analysis = subprocess.run([sys.executable, "-m",
                               "torch.distributed.flight_recorder.fr_trace", str(group),
                               "--prefix", "rank_"], capture_output=True, text=True)
    said = analysis.stdout + analysis.stderr
    assert analysis.returncode == 0, said
    # torch's own words: the fourth all-reduce (pycomm's #3) lacks rank 1
    assert "Not all ranks joining collective, sequence number: 3" in said, said
    assert "missing ranks: {1}" in said and "gloo:all_reduce" in said, said


def _dumped_while_stuck(rank, world_size, directory):
    # Set before the group exists: the first "pycomm" group installs the handler.
    os.environ["PYCOMM_FLIGHT_RECORD_DIR"] = directory
    group = dist.new_group(backend="pycomm")
    pids = [0] * world_size
    dist.all_gather_object(pids, os.getpid())
    dist.all_reduce(torch.ones(8), group=group)
    if rank == 1:
        dist.all_reduce(torch.ones(8), group=group)  # waits, in C++, until rank 0's
        return
    time.sleep(0.5)  # rank 1 is in that wait by now
    for pid in pids:
        os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 20
    while (len(glob.glob(os.path.join(directory, "*_rank*.json"))) < world_size
           and time.monotonic() < deadline):
        time.sleep(0.02)
    time.sleep(0.2)  # the files are written whole before the next one appears
    dist.all_reduce(torch.ones(8), group=group)  # lets rank 1 go


def test_sigusr2_writes_every_ranks_record_while_one_is_stuck(tmp_path):
    run_ranks(_dumped_while_stuck, 2, directory=str(tmp_path))
    groups = flight_record.load(str(tmp_path))
    assert len(groups) == 1, os.listdir(tmp_path)
    records = next(iter(groups.values()))
    assert [r["rank"] for r in records] == [0, 1], records
    said = flight_record.report(records)
    # rank 1 was inside the all-reduce rank 0 had not issued yet
    assert "rank 0 is behind" in said and "rank(s) [1] went up to" in said, said
    stuck = records[1]["entries"][-1]
    assert stuck["op"] == "all_reduce" and stuck["state"] == "started", stuck


def _late(rank, world_size, directory):
    # Set before the group exists: the group's ranks then handle SIGUSR2 (Note [Every rank
    # dumps] in csrc/shm/dump_peers.cpp).
    os.environ["PYCOMM_FLIGHT_RECORD_DIR"] = directory
    group = dist.new_group(backend="pycomm", timeout=datetime.timedelta(seconds=2))
    for _ in range(3):
        dist.all_reduce(torch.ones(8), group=group)
    if rank == 1:  # late, not failing: in Python, no collective running, no call to dump
        time.sleep(5)
        return
    with pytest.raises(dist.DistBackendError, match="Timed out"):
        dist.all_reduce(torch.ones(8), group=group)
    failed = time.monotonic()
    while len(glob.glob(os.path.join(directory, "*_rank*.json"))) < world_size:
        assert time.monotonic() - failed < 1.0, os.listdir(directory)
        time.sleep(0.01)


def test_a_late_rank_writes_its_record_when_the_group_fails_elsewhere(tmp_path):
    """Every rank's record within a second of one rank's failure, without a hand-sent
    signal, and torch's analyzer reads them and names the late rank."""
    run_ranks(_late, 2, directory=str(tmp_path))
    time.sleep(0.2)  # the late rank's file is written whole by now
    groups = flight_record.load(str(tmp_path))
    assert len(groups) == 1, os.listdir(tmp_path)
    said = flight_record.report(next(iter(groups.values())))
    assert "rank 1 is behind" in said, said
    out_dir = tmp_path / "torch"
    subprocess.run([sys.executable, "-m", "pycomm.flight_record", str(tmp_path),
                    "--torch-dir", str(out_dir)], capture_output=True, text=True, check=True)
    (group,) = out_dir.iterdir()
    analysis = subprocess.run([sys.executable, "-m",
                               "torch.distributed.flight_recorder.fr_trace", str(group),
                               "--prefix", "rank_"], capture_output=True, text=True)
    said = analysis.stdout + analysis.stderr
    assert analysis.returncode == 0 and "Missing dump files" not in said, said
    assert "missing ranks: {1}" in said, said


def _skipped(rank, world_size, directory):
    os.environ["PYCOMM_FLIGHT_RECORD_DIR"] = directory
    ddp = pycomm.DistributedDataParallel(tanh_mlp(), bucket_cap_mb=0.001)
    ddp(torch.randn(4, 24)).sum().backward()
    if rank == 1:
        ddp(torch.randn(4, 24))  # a forward without its backward
    with pytest.raises(RuntimeError, match="different collectives"):
        ddp(torch.randn(4, 24)).sum().backward()


def test_a_skipped_backward_names_the_rank_with_the_extra_forward(tmp_path):
    run_ranks(_skipped, 2, directory=str(tmp_path))
    groups = flight_record.load(str(tmp_path))
    said = flight_record.report(next(iter(groups.values())))
    assert "the ranks were in different collectives" in said, said
    assert "rank(s) [1] ran more forwards since the last synchronized backward" in said, said


def test_the_merge_command_says_when_there_is_nothing(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pycomm.flight_record", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "no flight records" in out.stderr, out
