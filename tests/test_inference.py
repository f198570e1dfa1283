"""``edl-argo evaluate`` and ``edl-argo predict`` for every kind of model that trains.

Each test publishes a model of one of the fixture model files (tests/inference_models/) with the export code
of a real job, then checks the commands against the model's own outputs, computed here from the raw feature
values: one prediction line per record, in record order, and metrics equal to those of all records at once.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edl_argo import cli
from edl_argo.data.commands import write_dataset
from edl_argo.data.examples import encode_example
from edl_argo.master.export import KERAS_FILE, publish_model
from edl_argo.model import Mode, load_model_spec
from edl_argo.recordio import Compressor
from edl_argo.storage import LocalStorage
from edl_argo.storage.trees import POINTER_NAME
from edl_argo.worker.replica import build_model
from tests.engine_helpers import model_dir

MODELS = Path(__file__).resolve().parent / "inference_models"
SIMPLE = str(MODELS / "simple.py")
DICT_INPUT = str(MODELS / "dict_input.py")
MULTI_OUTPUT = str(MODELS / "multi_output.py")

#: model file -> how to build its input from the raw feature matrix
KINDS = {
    "functional": f"{SIMPLE}:functional",
    "sequential": f"{SIMPLE}:sequential",
    "subclassed": f"{SIMPLE}:subclassed",
    "lambda": f"{SIMPLE}:lambda_model",
    "dict_input": DICT_INPUT,
    "list_output": f"{MULTI_OUTPUT}:list_output",
    "dict_output": f"{MULTI_OUTPUT}:dict_output",
}

#: Records per shard: 10, 10 and 11 (write_dataset splits contiguously); no minibatch size divides them all.
NUM_RECORDS = 31
SHARDS = ["data-00000", "data-00001", "data-00002"]
SHARD_STARTS = [0, 10, 20]


class Data:
    """The raw values of the fixture dataset, in record order."""

    def __init__(self, root: Path) -> None:
        rng = np.random.default_rng(7)
        self.root = root
        self.x = rng.normal(size=(NUM_RECORDS, 4)).astype(np.float32)
        self.y = rng.integers(0, 3, size=NUM_RECORDS)
        self.z = rng.normal(size=NUM_RECORDS).astype(np.float32)
        records = [
            encode_example({"x": self.x[i], "y": int(self.y[i]), "z": float(self.z[i])})
            for i in range(NUM_RECORDS)
        ]
        keys = write_dataset(LocalStorage(root), "", records, 3, Compressor.NONE, overwrite=False)
        assert [key.rsplit("/", 1)[1] for key in keys] == SHARDS  # in the dataset's version folder

    def inputs(self, kind: str) -> Any:
        if kind == "dict_input":
            return {"a": self.x[:, :3], "b": self.x[:, 3:]}
        return self.x


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    return Data(tmp_path_factory.mktemp("inference-data"))


def publish(kind: str, root: Path, data: Data) -> tuple[Any, str]:
    """Build ``kind``'s model as a job does, publish it under ``root``; (the model, --model URL)."""
    spec = load_model_spec(KINDS[kind])
    model = build_model(spec, _take(data.inputs(kind), 2))
    publish_model(LocalStorage(root), model, {"final_metrics": {}}, {"model_def": KINDS[kind]})
    return model, str(root / "model")


def publish_with_output_biases(root: Path, data: Data, biases: list[float]) -> None:
    """Publish the functional model with its first output biases set to ``biases`` (NaN, infinity)."""
    model = build_model(load_model_spec(KINDS["functional"]), data.x[:2])
    kernel, bias = model.layers[-1].get_weights()
    bias[: len(biases)] = biases
    model.layers[-1].set_weights([kernel, bias])
    publish_model(LocalStorage(root), model, {}, {})


def functional_with_feed(path: Path, feed_source: str) -> Path:
    """A model file at ``path``: the functional model of tests/inference_models/simple.py (imported as
    ``_simple``) with the ``feed`` that ``feed_source`` defines."""
    path.write_text(
        "from importlib.machinery import SourceFileLoader\n"
        f"_simple = SourceFileLoader('simple_fixture', {SIMPLE!r}).load_module()\n"
        "loss, optimizer, eval_metrics_fn, custom_model = (\n"
        "    _simple.loss, _simple.optimizer, _simple.eval_metrics_fn, _simple.functional)\n" + feed_source
    )
    return path


def _take(inputs: Any, n: int) -> Any:
    return {k: v[:n] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[:n]


def model_outputs(model: Any, kind: str, data: Data) -> dict[str, np.ndarray]:
    """The model's own outputs for every record, by output name ("output" for a single tensor)."""
    outputs = model(data.inputs(kind), training=False)
    if isinstance(outputs, dict):
        return {name: np.asarray(value) for name, value in outputs.items()}
    if isinstance(outputs, list | tuple):
        return {name: np.asarray(value) for name, value in zip(("cls", "reg"), outputs, strict=True)}
    return {"output": np.asarray(outputs)}


def strict_json(text: str) -> Any:
    def refuse(token: str) -> None:
        raise AssertionError(f"not valid JSON: bare {token}")

    return json.loads(text, parse_constant=refuse)


def read_predictions(output: Path) -> dict[str, list[dict[str, Any]]]:
    """The lines of every prediction file of the current version, by file name; asserts the tree is
    complete."""
    assert LocalStorage(output).tree_complete("")
    return {
        f.name: [strict_json(line) for line in f.read_text().splitlines()]
        for f in sorted(model_dir(output.parent, output.name).glob("*.jsonl"))
    }


def error_line(err: str, command: str) -> str:
    """The one line the command printed for an error (log event lines aside); no traceback."""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("edl-argo ")]
    assert len(lines) == 1 and lines[0].startswith(f"edl-argo {command}: error: "), err
    return lines[0]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- predict ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_predict_writes_each_records_model_outputs_one_line_each(
    kind: str, data: Data, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, model_url = publish(kind, tmp_path / "job", data)
    expected = model_outputs(model, kind, data)
    output = tmp_path / "predictions"
    args = [
        "--model",
        model_url,
        "--model-def",
        KINDS[kind],
        "--data",
        str(data.root),
        "--output",
        str(output),
    ]

    code, _, err = run(capsys, "predict", *args, "--minibatch-size", "4")

    assert code == 0, err
    files = read_predictions(output)
    assert list(files) == [f"{shard}.jsonl" for shard in SHARDS]
    for shard, start in zip(SHARDS, SHARD_STARTS, strict=True):
        lines = files[f"{shard}.jsonl"]
        assert [line["shard"] for line in lines] == [shard] * len(lines)
        assert [line["record"] for line in lines] == list(range(len(lines)))
        for line in lines:
            index = start + line["record"]
            if list(expected) == ["output"]:
                np.testing.assert_allclose(line["output"], expected["output"][index], rtol=1e-5, atol=1e-6)
            else:
                assert sorted(line["output"]) == sorted(expected)
                for name, values in expected.items():
                    np.testing.assert_allclose(line["output"][name], values[index], rtol=1e-5, atol=1e-6)
    assert sum(len(lines) for lines in files.values()) == NUM_RECORDS
    summary = model_dir(output.parent, output.name) / "predictions.json"
    assert strict_json(summary.read_text())["records"] == NUM_RECORDS


def test_predict_layout_does_not_depend_on_minibatch_size_and_replaces_the_previous_output(
    data: Data, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, model_url = publish("functional", tmp_path / "job", data)
    output = tmp_path / "predictions"
    args = ["--model", model_url, "--model-def", KINDS["functional"], "--data", str(data.root)]
    args += ["--output", str(output)]
    neighbour = tmp_path / "predictions-old" / "keep.txt"
    neighbour.parent.mkdir()
    neighbour.write_text("mine")

    assert run(capsys, "predict", *args, "--minibatch-size", "7")[0] == 0
    first = read_predictions(output)
    assert run(capsys, "predict", *args, "--minibatch-size", "50")[0] == 0
    second = read_predictions(output)

    current = model_dir(output.parent, output.name)
    assert sorted(p.name for p in current.iterdir()) == sorted([*first, "predictions.json"])
    assert len([p for p in output.iterdir() if p.is_dir()]) == 2  # the previous version is kept
    assert [p.name for p in output.iterdir() if p.is_file()] == [POINTER_NAME]
    assert sum(len(lines) for lines in second.values()) == NUM_RECORDS
    for name, lines in first.items():  # the same records in the same places; values equal to float noise
        assert [(p["shard"], p["record"]) for p in lines] == [(p["shard"], p["record"]) for p in second[name]]
        np.testing.assert_allclose(
            [p["output"] for p in lines], [p["output"] for p in second[name]], atol=1e-6
        )
    assert neighbour.read_text() == "mine"


def test_predict_refuses_an_output_holding_other_files(
    data: Data, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, model_url = publish("functional", tmp_path / "job", data)
    output = tmp_path / "mine"
    (output / "sub").mkdir(parents=True)
    (output / "sub" / "notes.txt").write_text("mine")
    args = ["--model", model_url, "--model-def", KINDS["functional"], "--data", str(data.root)]

    code, _, err = run(capsys, "predict", *args, "--output", str(output))

    assert code == 2
    line = error_line(err, "predict")
    assert f"--output {output}" in line and "sub/notes.txt" in line
    assert (output / "sub" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in output.iterdir()) == ["sub"]


@pytest.mark.parametrize("previous", [False, True])
def test_failed_predict_leaves_the_previous_output_or_nothing(
    previous: bool, data: Data, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, model_url = publish("functional", tmp_path / "job", data)
    broken = tmp_path / "broken"
    shutil.copytree(data.root, broken)
    (third,) = broken.glob(f"v-*/{SHARDS[2]}")
    damaged = bytearray(third.read_bytes())
    damaged[-10] ^= 0xFF  # the last shard's chunk fails its checksum (same size: the manifest still fits)
    third.write_bytes(bytes(damaged))
    output = tmp_path / "predictions"
    args = ["--model", model_url, "--model-def", KINDS["functional"], "--output", str(output)]
    if previous:
        assert run(capsys, "predict", *args, "--data", str(data.root))[0] == 0
    before = read_predictions(output) if previous else None

    code, _, err = run(capsys, "predict", *args, "--data", str(broken), "--minibatch-size", "4")

    assert code == 2
    line = error_line(err, "predict")
    assert SHARDS[2] in line
    if previous:
        assert read_predictions(output) == before
    else:
        assert not output.exists()


def test_predictions_are_strict_json_with_null_for_nan_and_infinity(
    data: Data, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    publish_with_output_biases(tmp_path / "job", data, [np.inf, np.nan])
    output = tmp_path / "predictions"
    args = ["--model", str(tmp_path / "job" / "model"), "--model-def", KINDS["functional"]]

    code, _, err = run(capsys, "predict", *args, "--data", str(data.root), "--output", str(output))

    assert code == 0, err
    lines = [line for lines in read_predictions(output).values() for line in lines]  # strict parse
    assert len(lines) == NUM_RECORDS
    assert all(line["output"][0] is None and line["output"][1] is None for line in lines)
    assert all(isinstance(line["output"][2], float) for line in lines)


# -- evaluate --------------------------------------------------------------------------------------


def expected_metrics(kind: str, outputs: dict[str, np.ndarray], data: Data) -> dict[str, float]:
    if kind in ("list_output", "dict_output"):
        return {
            "cls_accuracy": float(np.mean(np.argmax(outputs["cls"], axis=1) == data.y)),
            "reg_mse": float(np.mean((data.z - outputs["reg"][:, 0]) ** 2)),
        }
    metrics = {"accuracy": float(np.mean(np.argmax(outputs["output"], axis=1) == data.y))}
    if kind != "dict_input":
        metrics["batch_mean_first_logit"] = float(np.mean(outputs["output"][:, 0]))
    return metrics


def summation_tolerance(outputs: dict[str, np.ndarray]) -> float:
    """How far a float32 mean may land from numpy's: rounding scales with the terms, not the result.

    A mean of logits of both signs can be near 0 (CI saw -0.00079 from terms near 0.1), where a
    relative bound alone fails on summation order (8.7e-9 apart on CI's machine). Weighting a minibatch
    wrongly moves the mean by the size of the terms, far beyond this bound.
    """
    return 1e-5 * max(float(np.mean(np.abs(values))) for values in outputs.values())


@pytest.mark.parametrize("kind", list(KINDS))
def test_evaluate_gives_the_metrics_of_all_records_at_any_minibatch_size(
    kind: str, data: Data, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, model_url = publish(kind, tmp_path / "job", data)
    outputs = model_outputs(model, kind, data)
    expected, tolerance = expected_metrics(kind, outputs, data), summation_tolerance(outputs)
    args = ["--model", model_url, "--model-def", KINDS[kind], "--data", str(data.root)]

    for minibatch in ("4", "7", "64"):
        output = tmp_path / f"eval-{minibatch}"
        code, out, err = run(
            capsys, "evaluate", *args, "--minibatch-size", minibatch, "--output", str(output)
        )
        assert code == 0, err
        printed = strict_json(out.strip().splitlines()[-1])
        assert printed["records"] == NUM_RECORDS
        assert {k: v for k, v in printed.items() if k != "records"} == pytest.approx(
            expected, rel=1e-5, abs=tolerance
        )
        assert strict_json((output / "metrics.json").read_text()) == printed


def test_evaluate_refuses_zero_records(
    tmp_path: Path, data: Data, capsys: pytest.CaptureFixture[str]
) -> None:
    _, model_url = publish("functional", tmp_path / "job", data)
    empty = tmp_path / "empty"
    write_dataset(LocalStorage(empty), "", [], 1, Compressor.NONE, overwrite=False)

    code, out, err = run(
        capsys, "evaluate", "--model", model_url, "--model-def", KINDS["functional"], "--data", str(empty)
    )

    assert code == 2 and out == ""
    line = error_line(err, "evaluate")
    assert f"--data {empty}" in line and "0 records" in line


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["evaluate", "predict"])
def test_a_model_file_that_does_not_fit_the_data_is_named_with_the_shard(
    command: str, data: Data, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, model_url = publish("functional", tmp_path / "job", data)
    wrong = functional_with_feed(  # reads 5 floats per record where the data has 4
        tmp_path / "wrong_width.py",
        "import tensorflow as tf\n"
        "from edl_argo.model import Mode\n"
        "def feed(dataset, mode, _metadata):\n"
        "    spec = {'x': tf.io.FixedLenFeature([5], tf.float32),\n"
        "            'y': tf.io.FixedLenFeature([1], tf.int64)}\n"
        "    def parse(record):\n"
        "        parsed = tf.io.parse_single_example(record, spec)\n"
        "        return parsed['x'] if mode == Mode.PREDICTION else (parsed['x'], parsed['y'])\n"
        "    return dataset.map(parse)\n",
    )
    output = tmp_path / "out"

    code, _, err = run(
        capsys,
        command,
        "--model",
        model_url,
        "--model-def",
        str(wrong),
        "--data",
        str(data.root),
        "--output",
        str(output),
    )

    assert code == 2, err
    line = error_line(err, command)
    assert re.search(rf"{re.escape(str(data.root))}/v-[^/]+/{SHARDS[0]}", line) and str(wrong) in line
    assert not output.exists()


@pytest.mark.parametrize("command", ["evaluate", "predict"])
def test_an_error_of_feed_while_it_is_traced_names_the_model_file_function_and_shard(
    command: str, data: Data, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As training reports it: the model file, ``feed``, the error, then where (here: the first shard)."""
    _, model_url = publish("functional", tmp_path / "job", data)
    wrong = functional_with_feed(  # asks for a feature the records do not have
        tmp_path / "missing_feature.py",
        "import tensorflow as tf\n"
        "def feed(dataset, mode, _metadata):\n"
        "    def parse(record):\n"
        "        parsed = tf.io.parse_single_example(record, {'x': tf.io.FixedLenFeature([4], tf.float32)})\n"
        "        return parsed['p0']\n"
        "    return dataset.map(parse)\n",
    )
    args = ["--model", model_url, "--model-def", str(wrong), "--data", str(data.root)]

    code, _, err = run(capsys, command, *args, "--output", str(tmp_path / "out"))

    assert code == 2, err
    line = error_line(err, command)
    assert f": error: model file {wrong}, function feed: KeyError: 'p0' (shard {data.root}/v-" in line, line
    assert line.endswith(f"/{SHARDS[0]}, records 0-9)"), line


def test_a_misspelt_prediction_outputs_processor_is_refused(
    data: Data, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, model_url = publish("functional", tmp_path / "job", data)
    args = ["--model", model_url, "--model-def", KINDS["functional"], "--data", str(data.root)]
    output = tmp_path / "out"

    code, _, err = run(
        capsys, "predict", *args, "--output", str(output), "--prediction-outputs-processor", "Nope"
    )

    assert code == 2
    line = error_line(err, "predict")
    assert "lacks 'Nope' (--prediction-outputs-processor)" in line and SIMPLE in line
    assert not output.exists()


@pytest.mark.parametrize("command", ["evaluate", "predict"])
def test_feed_is_traced_once_for_every_shard_of_the_data(
    command: str, data: Data, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shards go through one input pipeline: ``feed`` is traced once (a pipeline per shard, or per range
    read, traced it again each time: 20-30 ms of CPU each, a minute for a few thousand small shards)."""
    _, model_url = publish("functional", tmp_path / "job", data)
    calls = tmp_path / "feed-calls"
    counting = functional_with_feed(
        tmp_path / "counting_feed.py",
        "def feed(dataset, mode, metadata):\n"
        f"    with open({str(calls)!r}, 'a') as calls:\n"
        "        calls.write(mode + '\\n')\n"
        "    return _simple.feed(dataset, mode, metadata)\n",
    )
    output = tmp_path / "out"

    args = ["--model", model_url, "--model-def", str(counting), "--data", str(data.root)]
    code, _, err = run(capsys, command, *args, "--output", str(output))

    assert code == 0, err
    mode = {"evaluate": Mode.EVALUATION, "predict": Mode.PREDICTION}[command]
    assert calls.read_text().splitlines() == [mode], f"feed called once per mode, for {len(SHARDS)} shards"


@pytest.mark.parametrize("command", ["evaluate", "predict"])
def test_a_truncated_model_keras_is_named(
    command: str, data: Data, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, model_url = publish("functional", tmp_path / "job", data)
    keras_file = model_dir(Path(model_url).parent) / KERAS_FILE
    keras_file.write_bytes(keras_file.read_bytes()[:300])
    args = ["--model", model_url, "--model-def", KINDS["functional"], "--data", str(data.root)]

    code, _, err = run(capsys, command, *args, "--output", str(tmp_path / "out"))

    assert code == 2
    line = error_line(err, command)
    assert str(keras_file) in line and "/tmp/edl-model-" not in line


def test_weights_of_another_model_are_refused(
    data: Data, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, model_url = publish("functional", tmp_path / "job", data)
    args = ["--model", model_url, "--model-def", KINDS["list_output"], "--data", str(data.root)]

    code, _, err = run(capsys, "evaluate", *args)

    assert code == 2
    line = error_line(err, "evaluate")
    assert str(model_dir(Path(model_url).parent) / KERAS_FILE) in line and KINDS["list_output"] in line


def test_weights_of_a_model_with_another_layer_width_say_which_variable_differs(
    data: Data, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Keras's error names the first variable whose shape differs at its end, after its own warnings."""
    _, model_url = publish("functional", tmp_path / "job", data)
    wider = tmp_path / "wider.py"
    wider.write_text(
        "import keras\n"
        "from importlib.machinery import SourceFileLoader\n"
        f"_simple = SourceFileLoader('simple_fixture', {SIMPLE!r}).load_module()\n"
        "loss, optimizer, eval_metrics_fn, feed = (\n"
        "    _simple.loss, _simple.optimizer, _simple.eval_metrics_fn, _simple.feed)\n"
        "def custom_model():\n"
        "    inputs = keras.Input(shape=(4,), name='x')\n"
        "    hidden = keras.layers.Dense(16, activation='tanh')(inputs)\n"
        "    return keras.Model(inputs, keras.layers.Dense(3, name='logits')(hidden))\n"
    )
    args = ["--model", model_url, "--model-def", str(wider), "--data", str(data.root)]

    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        code, _, err = run(capsys, "evaluate", *args)

    assert code == 2
    line = error_line(err, "evaluate")
    assert line.endswith(
        f"do not fit the model of --model-def {wider}: 2 objects could not be loaded (dense, logits); "
        "the first: variable dense/kernel has shape (4, 8) in the file, (4, 16) in the model"
    ), line
    assert not [w for w in warned if "saving" in w.filename], [str(w.message) for w in warned]


def test_nan_metric_is_written_as_null(
    data: Data, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    publish_with_output_biases(tmp_path / "job", data, [np.nan])
    args = ["--model", str(tmp_path / "job" / "model"), "--model-def", KINDS["functional"]]

    code, out, err = run(capsys, "evaluate", *args, "--data", str(data.root), "--output", str(tmp_path / "m"))

    assert code == 0, err
    printed = strict_json(out.strip().splitlines()[-1])
    assert printed["batch_mean_first_logit"] is None and not math.isnan(printed["accuracy"])
    assert strict_json((tmp_path / "m" / "metrics.json").read_text()) == printed


# -- training with validation data -----------------------------------------------------------------


@pytest.mark.parametrize(  # the list variant is slow: the dict one takes the same path with named outputs
    "kind", [pytest.param("list_output", marks=pytest.mark.slow), "dict_output"]
)
def test_a_job_evaluates_a_multi_output_model_as_evaluate_does(
    kind: str, data: Data, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from edl_argo.master.config import TrainConfig
    from edl_argo.master.job import TrainingJob

    monkeypatch.setenv("EDL_RUN_DIR", str(tmp_path / "run"))  # this job's pods only, whatever runs beside
    config = TrainConfig(
        model_def=KINDS[kind],
        training_data=str(data.root),
        validation_data=str(data.root),
        output=str(tmp_path / "job"),
        job_name=f"multi-output-{kind.replace('_', '-')}",
        num_epochs=2,
        minibatch_size=4,
        num_minibatches_per_task=2,
        num_workers=1,
        num_ps=1,
    )
    metrics = TrainingJob.load(config).run()

    assert sorted(metrics["final_metrics"]) == ["cls_accuracy", "reg_mse"]
    assert metrics["evaluations"][-1]["records"] == NUM_RECORDS
    args = ["--model", str(tmp_path / "job" / "model"), "--model-def", KINDS[kind], "--data", str(data.root)]
    code, out, err = run(capsys, "evaluate", *args)
    assert code == 0, err
    evaluated = strict_json(out.strip().splitlines()[-1])
    assert {k: evaluated[k] for k in metrics["final_metrics"]} == pytest.approx(
        metrics["final_metrics"], rel=1e-5
    )
