"""A command killed before ANY one of its storage steps leaves its previous output intact, or its new output
whole, or (with no previous output) none: never half an output, never no output where there was one.

Every command here runs once to count its storage steps (:mod:`tests.storage_steps`), then once per step k,
"killed" before step k: from step k on, nothing reaches the store, as if the process had been SIGKILLed.
Each runs with its output on a local folder and on the S3 stand-in: `train`'s publish of the model (over no
model, over a published one, over one published by older edl-argo, without a version pointer), a restarted
job publishing the model an earlier run kept, `evaluate`, `predict` and `data seal`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from storage_steps import Killed, restore, snapshot, steps

from edl_argo import cli
from edl_argo.data.commands import write_dataset
from edl_argo.data.examples import encode_example
from edl_argo.master import export
from edl_argo.master.export import KEPT_MODEL_KEY, MODEL_KEY, publish_kept_model, publish_model
from edl_argo.recordio import MANIFEST_NAME, Compressor, open_dataset
from edl_argo.storage import LocalStorage, Storage, open_storage

MODEL_DEF = str(Path(__file__).resolve().parent / "inference_models" / "simple.py") + ":functional"
RECORDS = 23


# -- fixtures ----------------------------------------------------------------------------------------------


@pytest.fixture(params=["local", "s3"])
def root_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty store: a local folder or a fresh bucket of the S3 stand-in."""
    if request.param == "local":
        return str(tmp_path / "store")
    return str(request.getfixturevalue("s3_env"))


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two model trees as `train` writes them (different weights), and a dataset (local, sealed)."""
    import keras
    import numpy as np

    from edl_argo.model import load_model_spec
    from edl_argo.worker.replica import build_model

    root = tmp_path_factory.mktemp("made")
    rng = np.random.default_rng(3)
    x = rng.normal(size=(RECORDS, 4)).astype(np.float32)
    records = [encode_example({"x": x[i], "y": int(i % 3)}) for i in range(RECORDS)]
    write_dataset(LocalStorage(root / "data"), "", records, 3, Compressor.NONE, overwrite=False)
    for name, seed in (("old", 1), ("new", 2)):
        keras.utils.set_random_seed(seed)
        model = build_model(load_model_spec(MODEL_DEF), x[:2])
        (root / name).mkdir()
        export.write_model_tree(root / name, model, {"run": name}, {"model_def": MODEL_DEF})
    return {"old": root / "old", "new": root / "new", "data": root / "data"}


# -- helpers -----------------------------------------------------------------------------------------------


def files_of(folder: Path) -> dict[str, bytes]:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in files}


def published(storage: Storage, key: str) -> dict[str, bytes] | None:
    """The files a reader gets from the tree at ``key`` (both ways readers open one: the tree's parent and
    the tree's own URL, as ``--model`` gives it); None if no complete tree is there."""
    at_url = open_storage(storage.describe(key))
    complete = storage.tree_complete(key)
    assert at_url.tree_complete("") == complete
    if not complete:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        storage.get_tree(key, Path(tmp) / "a")
        at_url.get_tree("", Path(tmp) / "b")
        seen = files_of(Path(tmp) / "a")
        assert files_of(Path(tmp) / "b") == seen
        return seen


def write_legacy_tree(storage: Storage, key: str, folder: Path) -> None:
    """A model tree as edl-argo before version pointers published it: its files, then ``_COMPLETE``."""
    for rel, data in files_of(folder).items():
        storage.write(f"{key}/{rel}", data)
    storage.write(f"{key}/_COMPLETE", b"")


def kill_at_every_step(
    monkeypatch: pytest.MonkeyPatch,
    stores: list[Storage],
    command: Callable[[], Any],
    check: Callable[[int], None],
) -> int:
    """Run ``command`` to completion (counting its steps), then killed before each step k in turn, from the
    same starting state; ``check(k)`` after each kill (k = 0: after the complete run). Returns the count."""
    before = [snapshot(store) for store in stores]
    with steps(monkeypatch) as counted:
        command()
    total = counted.count
    check(0)
    for k in range(1, total + 1):
        for store, objects in zip(stores, before, strict=True):
            restore(store, objects)
        with steps(monkeypatch, kill_at=k) as seen, pytest.raises(Killed):
            command()
        assert seen.count >= k
        check(k)
    return total


@pytest.fixture
def premade_trees(made: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """publish_model writes the "new" tree (made once: a SavedModel export takes seconds) and publishes it
    exactly as `train` does."""

    def write_model_tree(root: Path, model: Any, metrics: Any, flags: Any) -> None:
        shutil.copytree(made["new"], root, dirs_exist_ok=True)

    monkeypatch.setattr(export, "write_model_tree", write_model_tree)
    yield


# -- train: publishing the model -----------------------------------------------------------------------


@pytest.mark.parametrize("previous", ["none", "published", "legacy"])
def test_train_publish_killed_at_any_step_keeps_the_previous_model(
    previous: str,
    root_url: str,
    made: dict[str, Path],
    premade_trees: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    output, state = open_storage(f"{root_url}/job"), open_storage(f"{root_url}/state")
    old, new = files_of(made["old"]), files_of(made["new"])
    if previous == "published":
        output.put_tree(made["old"], MODEL_KEY)
    elif previous == "legacy":
        write_legacy_tree(output, MODEL_KEY, made["old"])
    assert published(output, MODEL_KEY) == (None if previous == "none" else old)
    outcomes = set()

    def check(k: int) -> None:
        seen = published(output, MODEL_KEY)
        if k == 0:
            assert seen == new
        assert seen == new or seen == (None if previous == "none" else old), k
        outcomes.add("new" if seen == new else "previous")

    total = kill_at_every_step(
        monkeypatch,
        [output, state],
        lambda: publish_model(output, object(), {}, {}, keep_in=state),
        check,
    )
    assert total >= len(new) + 1  # every file of the tree and the switch are steps a kill can precede
    assert outcomes == {"new", "previous"}


def test_a_restarted_job_killed_at_any_step_while_publishing_the_kept_model(
    root_url: str, made: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model an earlier run kept (its publish failed) is published by the next run: killed at any step,
    the output holds the previous model and the kept one is still kept, or the output holds the kept one."""
    output, state = open_storage(f"{root_url}/job"), open_storage(f"{root_url}/state")
    old, new = files_of(made["old"]), files_of(made["new"])
    output.put_tree(made["old"], MODEL_KEY)
    state.put_tree(made["new"], KEPT_MODEL_KEY)

    def check(k: int) -> None:
        seen = published(output, MODEL_KEY)
        assert seen in (old, new), k
        if seen == old:
            assert published(state, KEPT_MODEL_KEY) == new, k
        if k == 0:
            assert seen == new and published(state, KEPT_MODEL_KEY) is None
            assert state.list() == []

    kill_at_every_step(monkeypatch, [output, state], lambda: publish_kept_model(output, state), check)


# -- evaluate and predict ------------------------------------------------------------------------------


def run_cli(*argv: str) -> None:
    code = cli.main(list(argv))
    assert code == 0, argv


def test_predict_killed_at_any_step_keeps_the_previous_predictions(
    root_url: str, made: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The previous predictions were made by a model published by older edl-argo (read as it is)."""
    store = open_storage(root_url)
    write_legacy_tree(store, "legacy/model", made["old"])
    store.put_tree(made["new"], "job/model")
    args = ["--model-def", MODEL_DEF, "--data", str(made["data"]), "--output", f"{root_url}/predictions"]
    run_cli("predict", "--model", f"{root_url}/legacy/model", *args)
    old = published(store, "predictions")
    assert old is not None and len(old) == 4  # three shards and the summary
    new: dict[str, bytes] = {}

    def check(k: int) -> None:
        seen = published(store, "predictions")
        if k == 0:
            new.update(seen or {})
            assert seen is not None and seen != old and seen.keys() == old.keys()
        assert seen in (old, new), k

    kill_at_every_step(
        monkeypatch, [store], lambda: run_cli("predict", "--model", f"{root_url}/job/model", *args), check
    )
    capsys.readouterr()


def test_evaluate_killed_at_any_step_keeps_the_previous_metrics(
    root_url: str, made: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store = open_storage(root_url)
    write_legacy_tree(store, "legacy/model", made["old"])
    store.put_tree(made["new"], "job/model")
    args = ["--model-def", MODEL_DEF, "--data", str(made["data"]), "--output", f"{root_url}/evaluation"]
    run_cli("evaluate", "--model", f"{root_url}/legacy/model", *args)
    old = store.read("evaluation/metrics.json")
    assert json.loads(old)["records"] == RECORDS

    def check(k: int) -> None:
        seen = store.read("evaluation/metrics.json")
        if k == 0:
            assert seen != old and json.loads(seen)["records"] == RECORDS
        assert seen == old or json.loads(seen)["records"] == RECORDS

    kill_at_every_step(
        monkeypatch, [store], lambda: run_cli("evaluate", "--model", f"{root_url}/job/model", *args), check
    )
    capsys.readouterr()


# -- data seal ---------------------------------------------------------------------------------------------


def test_data_seal_killed_at_any_step_leaves_the_shards_unsealed_or_sealed_whole(
    root_url: str, made: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store = open_storage(root_url)
    for path in sorted(made["data"].glob("v-*/*")):
        store.write(f"shards/{path.name}", path.read_bytes())
    shards = snapshot(store)

    def check(k: int) -> None:
        if not store.exists(f"shards/{MANIFEST_NAME}"):
            assert k > 0 and snapshot(store) == shards
            return
        assert sum(open_dataset(store, "shards").records.values()) == RECORDS
        sealed = snapshot(store)
        assert sealed.pop(f"shards/{MANIFEST_NAME}") and sealed == shards

    kill_at_every_step(monkeypatch, [store], lambda: run_cli("data", "seal", f"{root_url}/shards"), check)
    capsys.readouterr()
