"""Checkpoint series (shared by parameter servers and the AllreduceStrategy group) and the group's format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edl_argo.checkpoint import Checkpointer, CheckpointSeries, open_checkpoint_storage
from edl_argo.collective.checkpoint import decode_state, group_checkpointer, group_checkpoints
from edl_argo.collective.state import GroupState, Lineage
from edl_argo.collective.transport import encode_state
from edl_argo.errors import ConfigError, DataFormatError
from edl_argo.proto import collective_pb2
from edl_argo.rpc.tensors import to_tensor
from edl_argo.storage import LocalStorage


def snapshot(version: int) -> GroupState:
    values = [np.full((2, 3), version, np.float32), np.arange(4, dtype=np.int64)]
    return GroupState(7, version, values, Lineage(((6, 0), (7, version - 1))))


def test_a_group_snapshot_round_trips_and_garbage_is_a_format_error_naming_the_source() -> None:
    state = decode_state(encode_state(snapshot(12)), "s3://b/ckpt")
    assert (state.version, state.round_id, state.lineage.spans) == (12, 7, ((6, 0), (7, 11)))
    values = state.values
    assert values[0].dtype == np.float32 and np.all(values[0] == 12) and values[1].tolist() == [0, 1, 2, 3]
    whole = encode_state(snapshot(12))
    for garbage in (b"\xff\xfe not a message", b"", whole[:-3], whole + b"x"):
        with pytest.raises(DataFormatError, match="s3://b/ckpt"):
            decode_state(garbage, "s3://b/ckpt")


def test_a_checkpoint_of_an_earlier_version_is_read_with_the_lineage_of_its_last_step() -> None:
    earlier = collective_pb2.ModelState(
        round_id=7, version=12, variables=[to_tensor(np.ones(3, np.float32), "0")], recent_step_rounds=[6, 7]
    )
    state = decode_state(earlier.SerializeToString(), "s3://b/ckpt")
    assert state.version == 12 and state.values[0].tolist() == [1.0, 1.0, 1.0]
    assert state.lineage.round_of(12) == 7 and state.lineage.round_of(11) is None


def test_the_series_keeps_the_newest_three_and_newest_skips_an_unreadable_one(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    series = group_checkpoints(storage)
    for version in (5, 10, 15, 20):
        series.save(version, encode_state(snapshot(version)))
    storage.write("allreduce/notes.txt", b"not a checkpoint name: ignored")
    assert [v for v, _ in series.list()] == [10, 15, 20]
    assert series.newest(decode_state).version == 20  # type: ignore[union-attr]
    storage.write(series.key(25), b"truncated")
    assert series.newest(decode_state).version == 20  # type: ignore[union-attr]
    assert CheckpointSeries(storage, "ps-0").newest(decode_state) is None


def test_a_checkpointer_is_due_once_per_interval_and_saves_in_the_background(tmp_path: Path) -> None:
    checkpointer: Checkpointer[GroupState] = group_checkpointer(LocalStorage(tmp_path), every=10)
    checkpointer.mark(10)  # restored at version 10
    assert [v for v in (11, 19) if checkpointer.due(v)] == []
    assert checkpointer.due(20)
    checkpointer.submit(snapshot(21))
    assert checkpointer.wait(30) and not checkpointer.due(29) and checkpointer.due(30)
    assert [v for v, _ in checkpointer.series.list()] == [21] and checkpointer.saved_version == 21


def test_checkpoint_steps_without_a_checkpoint_dir_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--checkpoint-steps needs --checkpoint-dir"):
        open_checkpoint_storage(None, 5)
    assert open_checkpoint_storage(None, 0) is None
    assert open_checkpoint_storage(str(tmp_path), 5) is not None


@pytest.mark.parametrize("strategy", ["ParameterServerStrategy", "AllreduceStrategy"])
def test_a_fresh_job_removes_only_its_own_checkpoints_by_name(tmp_path: Path, strategy: str) -> None:
    """A shared --checkpoint-dir keeps other series, unrelated files and foreign names inside the job's
    own series folders: only the checkpoints this job's holders would restore are removed."""
    from edl_argo.master.config import TrainConfig
    from edl_argo.master.failover import remove_stale_checkpoints

    shared = tmp_path / "shared"
    storage = LocalStorage(shared)
    own = ["allreduce"] if strategy == "AllreduceStrategy" else ["ps-0", "ps-1"]
    for series in ("ps-0", "ps-1", "ps-7", "allreduce", "other-job"):
        CheckpointSeries(storage, series).save(3, b"state")
    keep = {
        "notes.txt": b"a user's file",
        "ps-0/README": b"a user's file in a series folder",
        "ps-0/version-1.ckpt.bak": b"not a checkpoint name",
        "datasets/train/data-00000": b"someone's shard",
    }
    for key, data in keep.items():
        storage.write(key, data)
    config = TrainConfig(
        model_def="m.py",
        training_data="d",
        output=str(tmp_path / "out"),
        checkpoint_dir=str(shared),
        checkpoint_steps=5,
        num_ps=2,
        distribution_strategy=strategy,
    )
    remove_stale_checkpoints(config)

    remaining = {info.key for info in storage.list()}
    assert set(keep) <= remaining
    for series in ("ps-0", "ps-1", "ps-7", "allreduce", "other-job"):
        assert (CheckpointSeries(storage, series).key(3) in remaining) == (series not in own), series


def test_writes_a_killed_writer_abandoned_are_removed_and_nothing_else(tmp_path: Path) -> None:
    """A writer SIGKILLed mid-write leaves its temporary file; the series removes it (once no writer is
    left), and leaves its checkpoints and other files alone."""
    storage = LocalStorage(tmp_path)
    series = group_checkpoints(storage)
    series.save(10, b"state")
    abandoned = tmp_path / "allreduce" / ".edl-tmp-version-0000000020.ckpt-0123456789ab"
    abandoned.write_bytes(b"half a check")
    storage.write("allreduce/notes.txt", b"a user's file")
    other = tmp_path / "ps-0" / ".edl-tmp-version-0000000020.ckpt-0123456789ab"
    other.parent.mkdir()
    other.write_bytes(b"another series: not ours")

    assert series.remove_abandoned_writes() == 1
    assert not abandoned.exists() and other.exists()
    assert sorted(p.name for p in (tmp_path / "allreduce").iterdir()) == [
        "notes.txt",
        "version-0000000010.ckpt",
    ]
    assert series.remove_abandoned_writes() == 0
