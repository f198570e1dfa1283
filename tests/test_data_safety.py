"""Every ``edl-argo data`` command touches only its own outputs and publishes whole datasets.

Each output is surrounded by a user's own files and folders (siblings whose names start like the output's,
a CSV in the output folder itself, a model tree, files inside the dataset folder). Each command runs with
and without ``--overwrite``, succeeding, failing (a storage error part-way) and SIGKILLed part-way (a
test-only hook in a subprocess kills the process before its N-th storage change). Afterwards nothing
outside the command's own outputs has changed, and every reader sees a complete dataset (the new one or
the previous one) or refuses it, naming what is missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from edl_argo.cli import main
from edl_argo.data.examples import decode_example
from edl_argo.errors import ConfigError, DataFormatError, StorageError
from edl_argo.master.job import dataset_shards
from edl_argo.readers import open_data
from edl_argo.recordio import MANIFEST_NAME, Compressor, ShardReader, open_dataset
from edl_argo.storage import LocalStorage

CSV_TEXT = "a,b,label\n" + "".join(f"{i},{i * 0.5},{i % 3}\n" for i in range(60))

#: A user's own files around (and inside) the output folder ``out``; paths relative to its parent.
USER_FILES = {
    "out/notes.txt": b"my notes",
    "out/source.csv": CSV_TEXT.encode(),
    "out/trainer.csv": b"x,y\n1,2\n",
    "out/training_v1/data-00000": b"a user's shard in a folder whose name starts like train",
    "out/training_v1/data-00000.edl-index": b"its sidecar",
    "out/train_backup/data-00001": b"another",
    "out/test-results/data-00000": b"and another",
    "out/train/README.md": b"a user's file inside the dataset folder",
    "out/model/model.keras": b"a model tree",
    "out/model/_COMPLETE": b"",
    "out/v-notes/data-00000": b"a folder named almost like a version folder",
    "out2/data-00000": b"a sibling of the output root with the same prefix",
    "out.csv": b"beside the output",
}

COMMANDS: dict[str, tuple[list[str], list[str]]] = {
    # name: (argv after `edl-argo data`, the datasets it writes, relative to out/)
    "digits": (["digits", "--output", "{out}", "--shards", "3"], ["train", "test"]),
    "ctr": (
        ["ctr", "--output", "{out}", "--records", "300", "--vocabulary", "500", "--shards", "3"],
        ["train", "test"],
    ),
    "convert": (
        ["convert", "--from", "{out}/source.csv", "--label-column", "label", "--output", "{out}",
         "--shards", "3"],
        [""],
    ),
}  # fmt: skip


def argv_of(command: str, root: Path, overwrite: bool) -> list[str]:
    args, _ = COMMANDS[command]
    return ["data", *(a.replace("{out}", str(root / "out")) for a in args)] + (
        ["--overwrite"] if overwrite else []
    )


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def populate(root: Path) -> None:
    for rel, data in USER_FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def own_outputs(root: Path, dataset: str) -> set[str]:
    """The paths (relative to ``root``) of a dataset's manifest, shards and sidecars, if it has a manifest."""
    folder = (root / "out" / dataset) if dataset else root / "out"
    manifest = folder / MANIFEST_NAME
    if not manifest.exists():
        return set()
    base = folder.relative_to(root).as_posix()
    shards = {f"{base}/{s['key']}" for s in json.loads(manifest.read_text())["shards"]}
    return {f"{base}/{MANIFEST_NAME}"} | shards | {s + ".edl-index" for s in shards}


def in_version_folder(path: str) -> bool:
    return any(part.startswith("v-") and part != "v-notes" for part in path.split("/"))


def records_of(root: Path, dataset: str) -> list[dict[str, list]] | None:
    """Every record a reader gets from the dataset, decoded; None if readers refuse it (naming why)."""
    url = str((root / "out" / dataset) if dataset else root / "out")
    try:
        opened = open_dataset(LocalStorage(url))
    except DataFormatError as error:
        assert MANIFEST_NAME in str(error) or "missing" in str(error), error
        # The master refuses it too, naming the flag: for want of a manifest, or (a folder holding a user's
        # CSV files beside what a failed command left) as files of several formats.
        with pytest.raises((DataFormatError, ConfigError), match="--training-data"):
            dataset_shards(url, "--training-data")
        return None
    assert dataset_shards(url, "--training-data") == opened.records
    return [
        decode_example(record)
        for key in opened.records
        for record in ShardReader(opened.storage, key, version=opened.versions[key]).iter_records()
    ]


def check_only_own_outputs_changed(root: Path, before: dict[str, bytes], allowed: set[str]) -> None:
    after = snapshot(root)
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    assert changed <= allowed, sorted(changed - allowed)
    for rel, data in USER_FILES.items():
        assert after.get(rel) == data, rel


@pytest.fixture
def root(tmp_path: Path) -> Path:
    populate(tmp_path)
    return tmp_path


def run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_command_changes_only_its_own_outputs_with_and_without_overwrite(
    command: str, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    datasets = COMMANDS[command][1]
    before = snapshot(root)
    assert run(capsys, argv_of(command, root, overwrite=False))[0] == 0
    first = {d: own_outputs(root, d) for d in datasets}
    check_only_own_outputs_changed(root, before, set().union(*first.values()))
    previous = {d: records_of(root, d) for d in datasets}
    assert all(previous.values())

    before = snapshot(root)
    code, err = run(capsys, argv_of(command, root, overwrite=False))
    assert code == 2 and "--overwrite" in err and "already holds a dataset" in err
    assert snapshot(root) == before

    assert run(capsys, argv_of(command, root, overwrite=True))[0] == 0
    second = {d: own_outputs(root, d) for d in datasets}
    check_only_own_outputs_changed(root, before, set().union(*first.values(), *second.values()))
    for d in datasets:
        assert not first[d] & second[d] - {f"{Path('out', d).as_posix()}/{MANIFEST_NAME}"}
        assert records_of(root, d) == previous[d]  # the same command: the same records, in new shards
    # The first version's files are gone: only the new dataset's files and the user's remain.
    assert set(snapshot(root)) == set(USER_FILES) | set().union(*second.values())


HOOK = textwrap.dedent(
    """
    import os, signal, sys
    from edl_argo.storage.local import LocalStorage

    limit, changes = int(sys.argv[1]), 0

    def counted(method):
        def wrapper(self, *args, **kwargs):
            global changes
            changes += 1
            if changes == limit:
                os.kill(os.getpid(), signal.SIGKILL)
            return method(self, *args, **kwargs)
        return wrapper

    LocalStorage._replace = counted(LocalStorage._replace)  # every write and write_file
    LocalStorage.delete = counted(LocalStorage.delete)
    from edl_argo.cli import main
    code = main(sys.argv[2:])
    print(f"storage changes: {changes}", file=sys.stderr)
    sys.exit(code)
    """
)


def run_killed(argv: list[str], at_change: int) -> subprocess.CompletedProcess[str]:
    """Run ``edl-argo`` in a subprocess that SIGKILLs itself before its ``at_change``-th storage change."""
    return subprocess.run(
        [sys.executable, "-c", HOOK, str(at_change), *argv], capture_output=True, text=True, timeout=120
    )


def storage_changes(argv: list[str]) -> int:
    done = run_killed(argv, 0)
    assert done.returncode == 0, done.stderr
    return int(done.stderr.rsplit("storage changes: ", 1)[1])


@pytest.mark.parametrize(
    "overwrite",
    # make test kills each command over a previous dataset (the case where something can be lost);
    # the fresh case repeats the same kills with nothing to keep.
    [pytest.param(False, marks=pytest.mark.slow), True],
    ids=["fresh", "overwrite"],
)
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_command_killed_part_way_leaves_the_previous_dataset_or_none(
    command: str, overwrite: bool, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    datasets = COMMANDS[command][1]
    if overwrite:
        assert run(capsys, argv_of(command, root, overwrite=False))[0] == 0
    previous_files = {d: own_outputs(root, d) for d in datasets}
    previous = {d: records_of(root, d) for d in datasets}
    argv = argv_of(command, root, overwrite)
    clean = snapshot(root)
    total = storage_changes(argv)
    restore(root, clean)
    for at_change in sorted({1, total // 2, total}):
        before = snapshot(root)
        killed = run_killed(argv, at_change)
        assert killed.returncode == -9, killed.stderr
        now = {d: own_outputs(root, d) for d in datasets}
        allowed = set().union(*previous_files.values(), *now.values()) | {
            p for p in set(snapshot(root)) | set(before) if in_version_folder(p)
        }
        check_only_own_outputs_changed(root, before, allowed)
        for d in datasets:
            seen = records_of(root, d)
            # Readers see the previous dataset, or the new one (identical records), or refuse it.
            assert seen == previous[d] or (
                seen is not None and previous[d] is None and own_outputs(root, d)
            ), (
                at_change,
                d,
            )
        restore(root, clean)

    # Killed after its first shard, then run again: the rerun removes what the killed run left.
    run_killed(argv, 2)
    assert run(capsys, argv_of(command, root, overwrite=True))[0] == 0
    final = set().union(*(own_outputs(root, d) for d in datasets))
    assert {p for p in snapshot(root) if in_version_folder(p)} <= final


def restore(root: Path, files: dict[str, bytes]) -> None:
    """Make ``root`` hold exactly ``files`` again (between kill trials)."""
    for path in sorted(root.rglob("*"), reverse=True):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and rel not in files:
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        if not (root / rel).exists() or (root / rel).read_bytes() != data:
            (root / rel).write_bytes(data)


@pytest.mark.parametrize("overwrite", [False, True], ids=["fresh", "overwrite"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_command_failing_part_way_removes_its_shards_and_keeps_the_previous_dataset(
    command: str,
    overwrite: bool,
    root: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A disk-full error on the second shard: exit 2 naming it, the previous dataset (or none), no orphans."""
    datasets = COMMANDS[command][1]
    if overwrite:
        assert run(capsys, argv_of(command, root, overwrite=False))[0] == 0
    previous = {d: records_of(root, d) for d in datasets}
    before = snapshot(root)
    original: Callable[..., None] = LocalStorage.write_file
    calls = []

    def disk_full(self: LocalStorage, key: str, path: Path) -> None:
        calls.append(key)
        if len(calls) == 2:
            raise StorageError(f"cannot access {self.describe(key)}: No space left on device")
        original(self, key, path)

    monkeypatch.setattr(LocalStorage, "write_file", disk_full)
    code, err = run(capsys, argv_of(command, root, overwrite))
    assert code == 2 and "No space left on device" in err and calls[1].rsplit("/", 1)[1] in err
    assert snapshot(root) == before
    assert {d: records_of(root, d) for d in datasets} == previous


def test_seal_writes_only_a_manifest_and_readers_refuse_shards_without_one(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """RecordIO shards made elsewhere (here: a dataset's shards copied without their manifest) are refused
    with a message naming `edl-argo data seal`; sealing writes the manifest only, after checksumming."""
    assert run(capsys, ["data", "digits", "--output", str(root / "made"), "--shards", "2"])[0] == 0
    elsewhere = root / "elsewhere"
    for shard in (root / "made" / "train").glob("v-*/*"):
        (elsewhere / shard.name).parent.mkdir(parents=True, exist_ok=True)
        (elsewhere / shard.name).write_bytes(shard.read_bytes())
    with pytest.raises(DataFormatError, match=rf"no manifest {MANIFEST_NAME}.*edl-argo data seal"):
        dataset_shards(str(elsewhere), "--training-data")
    before = snapshot(root)
    assert run(capsys, ["data", "seal", str(elsewhere)])[0] == 0
    after = snapshot(root)
    assert {p for p in after if before.get(p) != after[p]} == {f"elsewhere/{MANIFEST_NAME}"}
    assert set(before) <= set(after)
    assert sum(dataset_shards(str(elsewhere), "--training-data").values()) == 1437
    code, err = run(capsys, ["data", "seal", str(elsewhere)])
    assert code == 2 and "manifest already" in err


def test_inspect_lists_and_verifies_shards_without_a_manifest_and_says_they_are_not_sealed(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Inspection is how a user looks at RecordIO made elsewhere before sealing it: the shards are listed
    and verified, and the output says the folder is not sealed and how to seal it; nothing is written."""
    assert run(capsys, ["data", "digits", "--output", str(root / "made"), "--shards", "2"])[0] == 0
    elsewhere = root / "elsewhere"
    for shard in (root / "made" / "train").glob("v-*/*"):
        (elsewhere / shard.name).parent.mkdir(parents=True, exist_ok=True)
        (elsewhere / shard.name).write_bytes(shard.read_bytes())
    before = snapshot(root)
    assert main(["data", "inspect", str(elsewhere)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[1:3]] == ["data-00000", "data-00001"]
    assert out[3].split()[:5] == ["total", "(2", "shards)", "1437", "2"]
    assert out[-1].startswith(f"not sealed: {elsewhere} has no manifest {MANIFEST_NAME}")
    assert f"edl-argo data seal {elsewhere}" in out[-1]
    assert snapshot(root) == before

    data = bytearray((elsewhere / "data-00001").read_bytes())
    data[40] ^= 0xFF
    (elsewhere / "data-00001").write_bytes(bytes(data))
    code, err = run(capsys, ["data", "inspect", str(elsewhere)])
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "data-00001" in line and "chunk 0" in line
    code, err = run(capsys, ["data", "inspect", str(root / "nowhere")])
    assert code == 2 and f"{root / 'nowhere'}: no data there" in err


def test_a_reader_refuses_a_dataset_whose_shard_is_missing_or_changed(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, ["data", "digits", "--output", str(root / "d"), "--shards", "2"])[0] == 0
    (shard,) = [p for p in (root / "d" / "train").glob("v-*/data-00001")]
    shard.write_bytes(shard.read_bytes()[:-10])
    code, err = run(capsys, ["data", "inspect", str(root / "d" / "train")])
    assert code == 2 and "data-00001" in err and "changed after the dataset was written" in err
    shard.unlink()
    with pytest.raises(
        DataFormatError, match=r"--training-data .*data-00001 named by its manifest is missing"
    ):
        dataset_shards(str(root / "d" / "train"), "--training-data")
    manifest = root / "d" / "test" / MANIFEST_NAME
    manifest.write_text(manifest.read_text()[:-20])
    code, err = run(capsys, ["data", "inspect", str(root / "d" / "test")])
    assert code == 2 and "manifest" in err and "invalid" in err


# -- a shard replaced while a job reads it (issue 23 item 5) ------------------------------------------


def test_a_worker_reads_only_the_pinned_version_of_a_shard(tmp_path: Path) -> None:
    """The master pins each shard's version when it opens the dataset and sends it with every task; a
    worker reading a shard rewritten since (same key and size) fails naming the shard."""
    from edl_argo.data.commands import digits_records, write_dataset
    from edl_argo.master.evaluation import EvaluationService
    from edl_argo.master.servicer import MasterServicer
    from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher, TaskType
    from edl_argo.proto import master_pb2
    from edl_argo.recordio import ShardChangedError
    from edl_argo.worker.data import RecordSource

    train, _ = digits_records(0.2, 0)
    storage = LocalStorage(tmp_path / "train")
    write_dataset(storage, "", train[:100], 2, Compressor.NONE, overwrite=False)
    dataset = open_data(str(tmp_path / "train"))
    dispatcher = TaskDispatcher(dataset.records, DispatcherConfig(records_per_task=10, num_epochs=1))
    evaluation = EvaluationService(lambda: {}, {}, 0)
    evaluation.dispatcher = dispatcher
    urls = {TaskType.TRAINING: str(tmp_path / "train"), TaskType.EVALUATION: "", TaskType.PREDICTION: ""}
    servicer = MasterServicer(dispatcher, evaluation, urls, lambda: 0, datasets={TaskType.TRAINING: dataset})
    task = servicer.GetTask(master_pb2.GetTaskRequest(worker_id=0), None).task
    assert task.shard_version == dataset.versions[task.shard] != ""

    def read(task: master_pb2.Task, start: int, end: int, version: str, source: RecordSource) -> int:
        ranged = master_pb2.Task()
        ranged.CopyFrom(task)
        ranged.start, ranged.end, ranged.shard_version = start, end, version
        return len(source.read(ranged)[0])

    source = RecordSource()
    assert read(task, 0, 10, task.shard_version, source) == 10
    shard = storage.read(task.shard)
    storage.write(task.shard, shard)  # rewritten in place: same bytes, a new version
    with pytest.raises(ShardChangedError, match=rf"shard .*{task.shard} changed while this job was reading"):
        read(task, 10, 20, task.shard_version, source)
    with pytest.raises(ShardChangedError, match=task.shard):  # a new reader refuses it as well
        read(task, 0, 10, task.shard_version, RecordSource())
    assert read(task, 0, 10, "", RecordSource()) == 10  # unpinned: reads


def test_a_dataset_overwritten_while_a_job_trains_fails_the_job_naming_the_shard(tmp_path: Path) -> None:
    """`data digits --overwrite` during training: the job does not mix old and new records, it stops with
    exit 1 and a message naming the shard that changed."""
    from edl_argo.data.commands import digits_records, write_dataset
    from edl_argo.errors import JobFailedError
    from edl_argo.master.job import TrainingJob
    from tests.engine_helpers import JobThread, digits_config

    train, test = digits_records(0.2, 0)
    data = LocalStorage(tmp_path / "data")
    write_dataset(data, "train", train, 4, Compressor.NONE, overwrite=False)
    write_dataset(data, "test", test, 1, Compressor.NONE, overwrite=False)
    job = TrainingJob.load(digits_config(tmp_path / "data", tmp_path / "job", num_epochs=30))
    running = JobThread(job).start()
    running.wait_until(lambda: running.progress_fraction() >= 0.1, 240, "10% of the tasks")
    other, _ = digits_records(0.2, 1)
    write_dataset(data, "train", other, 4, Compressor.NONE, overwrite=True)
    with pytest.raises(JobFailedError, match=r"shard .*data-0000\d changed while this job was reading it"):
        running.join(240)
    assert not (tmp_path / "job" / "model").exists()


def test_on_s3_a_command_changes_only_its_own_outputs(
    s3_env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same on an object store, where "folders" are name prefixes: ``out/train`` must not touch
    ``out/training_v1/...`` or ``out2/...``."""
    from edl_argo.storage import open_storage

    bucket = open_storage(s3_env)
    for rel, data in USER_FILES.items():
        bucket.write(rel, data)

    def objects() -> dict[str, bytes]:
        return {info.key: bucket.read(info.key) for info in bucket.list()}

    def own(dataset: str) -> set[str]:
        manifest = json.loads(bucket.read(f"out/{dataset}/{MANIFEST_NAME}"))
        shards = {f"out/{dataset}/{s['key']}" for s in manifest["shards"]}
        return {f"out/{dataset}/{MANIFEST_NAME}"} | shards | {s + ".edl-index" for s in shards}

    argv = ["data", "digits", "--output", f"{s3_env}/out", "--shards", "2"]
    for overwrite in (False, True):
        before = objects()
        previous = set().union(*(own(d) for d in ("train", "test"))) if overwrite else set()
        assert run(capsys, argv + (["--overwrite"] if overwrite else []))[0] == 0
        after = objects()
        changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
        assert changed <= previous | own("train") | own("test"), sorted(changed)
        assert all(after.get(rel) == data for rel, data in USER_FILES.items())
        assert sum(dataset_shards(f"{s3_env}/out/train", "--training-data").values()) == 1437
    assert set(objects()) == set(USER_FILES) | own("train") | own("test")
