"""ElasticDL's custom data reader (:mod:`edl_argo.readers.custom`), with the model file
tests/reader_models/jsonl_reader.py, whose ``custom_data_reader`` reads JSON-lines files.

The reader's shards (both of ElasticDL's forms of ``create_shards()``), ranges read through it as a worker
reads them (from the spec alone), its refusals, and a whole job (master, PS and worker processes) trained
on its records without losing one, then evaluated with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edl_argo import cli, log
from edl_argo.errors import ConfigError
from edl_argo.master.config import TrainConfig
from edl_argo.master.job import TrainingJob
from edl_argo.model.contract import ModelOptions
from edl_argo.readers import ReaderSpec, open_data, range_reader
from edl_argo.readers.custom import CustomTask, custom_options
from tests.engine_helpers import assert_no_record_lost

MODEL = str(Path(__file__).parent / "reader_models" / "jsonl_reader.py")
ROWS = (150, 90)


def row(i: int) -> dict:
    rng = np.random.default_rng(i)
    features = rng.normal(size=4)
    label = int(np.argmax(features[:3] + 0.3 * features[3]))
    return {**{f"f{k}": float(v) for k, v in enumerate(features)}, "label": label}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "jsonl"
    root.mkdir()
    number = 0
    for part, rows in enumerate(ROWS):
        lines = [json.dumps(row(number + i)) for i in range(rows)]
        (root / f"part-{part}.jsonl").write_text("\n".join(lines) + "\n")
        number += rows
    return root


def decoded(records: np.ndarray) -> list[dict]:
    """Each serialized tf.train.Example as a row (the float features rounded to float32, as stored)."""
    import tensorflow as tf

    rows = []
    for record in records:
        feature = tf.train.Example.FromString(record).features.feature
        values = {k: v.float_list.value[0] for k, v in feature.items() if k != "label"}
        rows.append({**values, "label": feature["label"].int64_list.value[0]})
    return rows


def rows(indices: range) -> list[dict]:
    """The rows ``indices`` as :func:`decoded` gives them back."""
    return [{k: float(np.float32(v)) if k != "label" else v for k, v in row(i).items()} for i in indices]


def test_shards_are_create_shards_and_ranges_read_through_read_records(folder: Path) -> None:
    """A worker's reader, made from the spec alone, reads what the planning side's does; the factory gets
    the URL, records_per_task and the data options as ElasticDL passes them."""
    options = custom_options(MODEL, "custom_data_reader", params={"output": ""}, records_per_task=64)
    data = open_data(str(folder), "custom", options)
    assert data.format == "custom" and data.records == {"part-0.jsonl": 150, "part-1.jsonl": 90}
    assert data.schema.columns == ()
    spec = ReaderSpec.from_json(data.spec.to_json())
    records = range_reader(spec).read("part-1.jsonl", 10, 20, hint=data.locate("part-1.jsonl", 10, 20))
    assert decoded(records[0]) == rows(range(160, 170))
    assert decoded(data.read("part-0.jsonl", 0, 3)[0]) == rows(range(3))


def test_a_list_of_ranges_of_one_name_is_one_shard_each(folder: Path) -> None:
    """ElasticDL's older form: (name, start, count) with names repeating; keys get #start, and a range
    of such a shard is read at its absolute indices."""
    data = open_data(
        str(folder), "custom", custom_options(MODEL, "custom_data_reader", params={"split": "64"})
    )
    assert data.records == {
        "part-0.jsonl#0": 64,
        "part-0.jsonl#64": 64,
        "part-0.jsonl#128": 22,
        "part-1.jsonl#0": 64,
        "part-1.jsonl#64": 26,
    }
    records = data.read("part-0.jsonl#64", 5, 8)
    assert decoded(records[0]) == rows(range(69, 72))


def test_the_task_has_elasticdls_fields() -> None:
    from edl_argo.readers.custom import CustomShard

    task = CustomTask(CustomShard("t", 3, 9), "evaluation")
    assert (task.shard.name, task.shard.start, task.shard.end, task.type) == ("t", 3, 9, "evaluation")
    assert (task.shard_name, task.start, task.end) == ("t", 3, 9)


def test_records_that_are_not_strings_are_one_config_error(folder: Path) -> None:
    data = open_data(
        str(folder), "custom", custom_options(MODEL, "custom_data_reader", params={"output": "numbers"})
    )
    with pytest.raises(ConfigError, match=r"read_records gave a list for record 0 of shard part-0\.jsonl"):
        data.read("part-0.jsonl", 0, 4)


def test_output_types_other_than_string_are_refused(folder: Path) -> None:
    with pytest.raises(ConfigError, match=r"records_output_types is .*float32.*serialized records only"):
        open_data(
            str(folder), "custom", custom_options(MODEL, "custom_data_reader", params={"output": "float"})
        )


def test_a_reader_that_raises_is_named(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"custom data reader custom_data_reader of .* raised FileNotFoundError"
    ):
        open_data(str(tmp_path / "nowhere"), "custom", custom_options(MODEL, "custom_data_reader"))
    with pytest.raises(ConfigError, match=r"--data-format custom reads data by a model's custom_data_reader"):
        open_data(str(tmp_path), "custom", {})


def test_a_job_trains_every_record_read_by_the_model_files_reader_then_evaluates_with_it(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model file defines custom_data_reader: the job reads its data with it (the master to list the
    shards, the worker process to read ranges), training every record once per epoch; evaluate too."""
    log.configure("INFO")
    output = tmp_path / "out"
    config = TrainConfig(
        model_def=MODEL,
        training_data=str(folder),
        validation_data=str(folder),
        output=str(output),
        job_name="test-custom-reader",
        num_epochs=2,
        shuffle=False,
        minibatch_size=16,
        num_minibatches_per_task=2,
        num_workers=1,
        num_ps=1,
        data_options="split=100",
        model_options=ModelOptions(custom_data_reader="custom_data_reader"),
    )
    job = TrainingJob.load(config)
    assert job.training_data.format == "custom" and job.training_data.records == {
        "part-0.jsonl#0": 100,
        "part-0.jsonl#100": 50,
        "part-1.jsonl": 90,
    }
    metrics = job.run()
    assert metrics["records_per_epoch"] == sum(ROWS)
    assert_no_record_lost(metrics)
    capsys.readouterr()
    code = cli.main(
        ["evaluate", "--model", str(output / "model"), "--model-def", MODEL, "--data", str(folder)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert json.loads(out.strip().splitlines()[-1])["records"] == sum(ROWS)
