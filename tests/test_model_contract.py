"""The model contract as ElasticDL writes it: its model-zoo files, its command line, its renaming flags."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edl_argo import cli, log
from edl_argo.errors import ConfigError
from edl_argo.master.config import TrainConfig
from edl_argo.master.job import TrainingJob
from edl_argo.model import load_model_spec
from edl_argo.model.contract import ModelOptions, model_options_from_args, parse_model_params
from tests.engine_helpers import DIGITS_MODEL, assert_no_record_lost, model_dir, read_metrics
from tests.test_cli import error_lines, run_cli
from tests.test_ps_service import connect  # noqa: F401  (a fixture)

ZOO = Path(__file__).parent / "fixtures" / "elasticdl_zoo"
ZOO_MODEL = "digits.digits_functional_api.custom_model"


def dense_units(model) -> list[int]:
    return [layer.units for layer in model.layers if hasattr(layer, "units")]


@pytest.fixture(autouse=True)
def master_logs_to_stderr() -> None:
    log.configure("INFO")


def test_elasticdl_command_line_trains_a_zoo_model(digits_data: Path, tmp_path: Path, capsys) -> None:
    """ElasticDL's command line as its documentation writes it, with a model file in its current style."""
    output = tmp_path / "job"
    argv = [
        "train",
        "--model_zoo", str(ZOO),
        "--model_def", ZOO_MODEL,
        "--dataset_fn", "feed",
        "--optimizer", "digits.optimizers.momentum_sgd",
        "--model_params", "hidden_units=32; num_classes=10",
        "--training_data", str(digits_data / "train"),
        "--validation_data", str(digits_data / "test"),
        "--output", str(output),
        "--num_epochs", "6",
        "--minibatch_size", "32",
        "--num_minibatches_per_task", "4",
        "--num_workers", "2",
        "--num_ps_pods", "2",
        "--job_name", "zoo-job",
    ]  # fmt: skip
    code, _, err = run_cli(capsys, *argv)
    assert code == 0, err[-3000:]
    metrics = read_metrics(output)
    assert metrics["final_metrics"]["accuracy"] >= 0.9
    assert_no_record_lost(metrics)
    flags = json.loads((model_dir(output) / "flags.json").read_text())
    assert flags["num_ps"] == 2
    assert flags["model_options"]["model_params"] == "hidden_units=32; num_classes=10"
    # The published model has the layer --model-params asked for (32 hidden units, not the default 64).
    import keras

    assert dense_units(keras.models.load_model(model_dir(output) / "model.keras", compile=False)) == [32, 10]
    # evaluate takes the same model flags (it builds the model from the model file).
    capsys.readouterr()
    evaluate = ["evaluate", "--model", str(output / "model"), "--data", str(digits_data / "test")]
    zoo_flags = ["--model_zoo", str(ZOO), "--model_def", ZOO_MODEL, "--model_params", "hidden_units=32"]
    code, out, err = run_cli(capsys, *evaluate, *zoo_flags)
    assert code == 0, err[-3000:]
    evaluated = json.loads(out.strip().splitlines()[-1])
    assert evaluated["accuracy"] == pytest.approx(metrics["final_metrics"]["accuracy"], abs=1e-6)


def _job(tmp_path: Path, digits_data: Path, options: ModelOptions) -> TrainingJob:
    config = TrainConfig(
        model_def=ZOO_MODEL,
        model_options=options,
        training_data=str(digits_data / "train"),
        output=str(tmp_path / "out"),
        job_name="pods",
    )
    return TrainingJob.load(config)


def test_model_options_reach_worker_and_ps_pods(digits_data: Path, tmp_path: Path) -> None:
    """The pods' command lines carry the options, and their own parsers read back the same options."""
    options = ModelOptions(
        model_zoo=str(ZOO),
        model_params="hidden_units=16",
        feed="feed",
        optimizer="digits.optimizers.momentum_sgd",
        eval_metrics_fn="eval_metrics_fn",
    )
    job = _job(tmp_path, digits_data, options)
    job._master_address = "127.0.0.1:1"
    job._ps_addresses = lambda: "127.0.0.1:2"  # type: ignore[method-assign]  # no PS started here
    parser = cli.build_parser()
    for spec in (job.ps_spec(0), job.worker_spec(3)):
        args = parser.parse_args(list(spec.command[1:]))
        assert args.model_def == ZOO_MODEL
        assert model_options_from_args(args) == options, spec.command
        model = load_model_spec(args.model_def, model_options_from_args(args)).custom_model()
        assert dense_units(model) == [16, 10]


def test_input_function_may_be_named_dataset_fn(tmp_path: Path) -> None:
    """Files written before ElasticDL renamed dataset_fn to feed load too; --feed/--dataset-fn pick a name."""
    source = (ZOO / "digits" / "digits_functional_api.py").read_text()
    old_style = tmp_path / "old_style.py"
    old_style.write_text(source.replace("def feed(", "def dataset_fn("))
    assert load_model_spec(str(old_style)).feed.__name__ == "dataset_fn"
    renamed = tmp_path / "renamed.py"
    renamed.write_text(source.replace("def feed(", "def input_records(").replace("def loss(", "def xent("))
    spec = load_model_spec(str(renamed), ModelOptions(feed="input_records", loss="xent"))
    assert (spec.feed.__name__, spec.loss.__name__) == ("input_records", "xent")
    with pytest.raises(ConfigError, match=r"lacks 'feed'.*--feed"):
        load_model_spec(str(renamed), ModelOptions(loss="xent"))
    with pytest.raises(ConfigError, match="lacks 'no_such'"):
        load_model_spec(str(old_style), ModelOptions(eval_metrics_fn="no_such"))


def test_optional_functions_are_looked_up_by_default_and_required_when_a_flag_names_them() -> None:
    """Without --callbacks or --prediction-outputs-processor a model file may lack them; a name a flag gives
    must be there, as for --loss."""
    spec = load_model_spec(DIGITS_MODEL)  # defines neither callbacks() nor PredictionOutputsProcessor
    assert (spec.callbacks, spec.prediction_outputs_processor) == (None, None)
    with pytest.raises(ConfigError, match=r"lacks 'on_epoch' \(--callbacks\)"):
        load_model_spec(DIGITS_MODEL, ModelOptions(callbacks="on_epoch"))
    with pytest.raises(ConfigError, match=r"lacks 'Writer' \(--prediction-outputs-processor\)"):
        load_model_spec(DIGITS_MODEL, ModelOptions(prediction_outputs_processor="Writer"))


def test_dotted_names_resolve_in_the_model_zoo() -> None:
    spec = load_model_spec(
        ZOO_MODEL, ModelOptions(model_zoo=str(ZOO), optimizer="digits.optimizers.momentum_sgd")
    )
    assert spec.optimizer().get_config()["momentum"] == pytest.approx(0.9)
    assert spec.custom_model().name == "digits_model"
    with pytest.raises(ConfigError, match=r"no such file .*nothing.py"):
        load_model_spec(ZOO_MODEL, ModelOptions(model_zoo=str(ZOO), loss="digits.nothing.loss"))
    with pytest.raises(ConfigError, match=r"in --model-zoo .* no such file .*absent.py"):
        load_model_spec("digits.absent.custom_model", ModelOptions(model_zoo=str(ZOO)))
    with pytest.raises(ConfigError, match=r"use module.path.function"):
        load_model_spec(DIGITS_MODEL, ModelOptions(model_zoo=str(ZOO)))


MISSING_MODEL_FILE = """
import sys
from edl_argo.errors import ConfigError
from edl_argo.master.config import TrainConfig
from edl_argo.master.job_parts import load_job_parts
config = TrainConfig(model_def="absent/model.py:build", training_data="data/train", output=sys.argv[1])
try:
    load_job_parts(config)
except ConfigError as error:
    print(error, "tensorflow" in sys.modules)
"""


def test_a_model_file_that_is_not_there_is_refused_before_tensorflow_is_imported(tmp_path: Path) -> None:
    """A typo in ``--model-def`` is said in a second, not after the 3 s of TensorFlow's import."""
    done = subprocess.run(
        [sys.executable, "-c", MISSING_MODEL_FILE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.stdout == "--model-def absent/model.py:build: no such file absent/model.py False\n", (
        done.stderr
    )


def test_model_params_parse_as_python_literals() -> None:
    params = parse_model_params('units=32; rate=0.5;name="wide";flag=True;sizes=[1, 2];mode=deep; expr=a=b;')
    assert params == {
        "units": 32,
        "rate": 0.5,
        "name": "wide",
        "flag": True,
        "sizes": [1, 2],
        "mode": "deep",
        "expr": "a=b",
    }
    assert parse_model_params("") == {}
    with pytest.raises(ConfigError, match=r"--model-params .*'units' is not name=value"):
        parse_model_params("units")
    spec = load_model_spec(ZOO_MODEL, ModelOptions(model_zoo=str(ZOO), model_params="num_classes=3"))
    assert spec.custom_model().output_shape == (None, 3)


@pytest.mark.parametrize(
    ("flags", "culprit"),
    [
        (["--model-params", "depth=3"], "--model-params 'depth=3': custom_model() does not take them"),
        (["--model-params", "3"], "--model-params '3'"),
        (["--custom-data-reader", "reader"], "--custom-data-reader reader: model definition"),
        (["--model-zoo", "/no/such/zoo"], "--model-zoo /no/such/zoo: no such folder"),
        (["--loss", "nothing"], "lacks 'nothing'"),
        (["--callbacks", "nosuch"], "lacks 'nosuch' (--callbacks)"),
        (["--prediction-outputs-processor", "nosuch"], "lacks 'nosuch' (--prediction-outputs-processor)"),
    ],
)
def test_bad_model_flags_fail_with_one_line(
    digits_data: Path, tmp_path: Path, capsys, flags, culprit
) -> None:
    argv = [
        "train",
        "--model-zoo", str(ZOO),
        "--model-def", ZOO_MODEL,
        "--training-data", str(digits_data / "train"),
        "--output", str(tmp_path / "out"),
        *flags,
    ]  # fmt: skip
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    lines = error_lines(err)
    assert len(lines) == 1 and culprit in lines[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("return 5", "returned int, not a keras.optimizers.Optimizer"),
        # ElasticDL's Keras 2 argument name, which Keras 3 refuses
        ("return tf.keras.optimizers.SGD(lr=0.1)", "ValueError: Argument(s) not recognized"),
    ],
)
def test_an_optimizer_function_returning_no_optimizer_is_refused_before_any_pod_starts(
    digits_data: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch, body: str, error: str
) -> None:
    """Each worker would fail on it with a traceback and each PS be relaunched: the master calls it first."""
    from edl_argo.pods.local import LocalProcessBackend

    def no_pod(self, spec) -> None:
        raise AssertionError(f"{spec.role} pod {spec.pod_id} started")

    monkeypatch.setattr(LocalProcessBackend, "start", no_pod)
    model = tmp_path / "bad_optimizer.py"
    model.write_text(Path(DIGITS_MODEL).read_text() + f"\n\ndef optimizer():\n    {body}\n")
    argv = ["train", "--model-def", str(model), "--training-data", str(digits_data / "train")]

    code, _, err = run_cli(capsys, *argv, "--output", str(tmp_path / "out"))

    assert code == 2
    (line,) = error_lines(err)
    assert line.startswith(f"edl-argo train: error: model file {model}, function optimizer: {error}"), err
    if body == "return 5":
        with pytest.raises(ConfigError, match=r"function optimizer: returned int"):  # as a pod calls it
            load_model_spec(str(model)).optimizer()


def test_model_file_defining_custom_data_reader_reads_the_data_with_it(tmp_path: Path) -> None:
    """ElasticDL's custom_data_reader is found by its default name, or by --custom-data-reader's."""
    model = tmp_path / "with_reader.py"
    model.write_text(
        (ZOO / "digits" / "digits_functional_api.py").read_text()
        + "\n\ndef custom_data_reader(data_origin, records_per_task=None, **kwargs):\n    return None\n"
        + "\n\ndef my_reader(data_origin, records_per_task=None, **kwargs):\n    return None\n"
    )
    assert load_model_spec(str(model)).custom_data_reader == "custom_data_reader"
    named = load_model_spec(str(model), ModelOptions(custom_data_reader="my_reader"))
    assert named.custom_data_reader == "my_reader"
    with pytest.raises(
        ConfigError, match=r"--custom-data-reader nothing: model definition .* has no function"
    ):
        load_model_spec(str(model), ModelOptions(custom_data_reader="nothing"))
    assert load_model_spec(ZOO_MODEL, ModelOptions(model_zoo=str(ZOO))).custom_data_reader == ""


def test_num_ps_pods_is_num_ps(tmp_path: Path) -> None:
    parser = cli.build_parser()
    common = ["--model-def", "m.py", "--training-data", "d", "--output", "o"]
    assert parser.parse_args(["train", *common, "--num_ps_pods", "3"]).num_ps == 3
    assert parser.parse_args(["train", *common, "--num-ps-pods", "2"]).num_ps == 2
    assert parser.parse_args(["ps", "--model-def", "m.py", "--num_ps_pods", "4"]).num_ps == 4


# -- callbacks(): a learning rate by model version ------------------------------------------------------

SCHEDULED_MODEL = """
import keras
from edl_argo.model.callbacks import LearningRateScheduler
def custom_model(): return keras.Sequential([keras.layers.Dense(1)])
def feed(dataset, mode, metadata): return dataset
def loss(labels, predictions): return 0.0
def optimizer(): return keras.optimizers.SGD(OPTIMIZER_RATE)
def eval_metrics_fn(): return {}
def callbacks():
    def _schedule(model_version):
        return 0.5 if model_version < 2 else 0.25
    return [CALLBACK]
"""


def scheduled_model(
    tmp_path: Path, rate: str = "0.1", callback: str = "LearningRateScheduler(_schedule)"
) -> str:
    path = tmp_path / f"scheduled_{abs(hash((rate, callback)))}.py"
    path.write_text(SCHEDULED_MODEL.replace("OPTIMIZER_RATE", rate).replace("CALLBACK", callback))
    return str(path)


def test_parameter_server_applies_the_learning_rate_of_each_version(tmp_path: Path, connect) -> None:  # noqa: F811
    """Every update from version v uses schedule(v), on dense variables and embedding rows alike."""
    from edl_argo.ps.server import PSConfig, create_servicer
    from tests.test_ps_service import B, model, pull_dense, pull_rows, push

    servicer = create_servicer(PSConfig(model_def=scheduled_model(tmp_path), host="127.0.0.1"))
    stub = connect(servicer)
    stub.PushModel(model())
    row = pull_rows(stub, [7])[0]
    ones = np.ones(3, np.float32)
    for version in range(4):
        assert push(stub, version, {"b": ones}, rows=([7], np.ones((1, 4), np.float32))).accepted
    applied = 0.5 + 0.5 + 0.25 + 0.25  # schedule(0..3); the optimizer's own 0.1 would give 0.4
    np.testing.assert_allclose(pull_dense(stub)["b"], B - applied, rtol=1e-6)
    np.testing.assert_allclose(pull_rows(stub, [7])[0], row - applied, rtol=1e-6)


def test_allreduce_learning_rate_follows_the_schedule_times_world_size() -> None:
    import keras

    from edl_argo.collective.learning_rate import WorldSizeScaling

    optimizer = keras.optimizers.SGD(0.1)
    scaling = WorldSizeScaling(optimizer)
    scaling.set(3)
    scaling.set_base(0.25)
    assert float(optimizer.learning_rate.numpy()) == pytest.approx(0.75)
    assert scaling.set(2) == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("rate", "callback", "message"),
    [
        ("0.1", "keras.callbacks.EarlyStopping()", "returned EarlyStopping; edl-argo runs only"),
        (
            "keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)",
            "LearningRateScheduler(_schedule)",
            r"optimizer\(\) must have a float learning_rate",
        ),
        ("0.1", "LearningRateScheduler(lambda v: 'fast')", r"schedule\(0\) failed"),
        ("0.1", "LearningRateScheduler(lambda v: -1.0)", r"schedule\(0\) is -1.0, not a learning rate"),
    ],
)
def test_callbacks_edl_argo_does_not_run_are_refused(tmp_path: Path, rate, callback, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_model_spec(scheduled_model(tmp_path, rate, callback))


def test_zoo_model_callbacks_give_its_schedule() -> None:
    spec = load_model_spec(ZOO_MODEL, ModelOptions(model_zoo=str(ZOO)))
    assert spec.learning_rate_at is not None
    assert [spec.learning_rate_at(v) for v in (0, 199, 200)] == [0.1, 0.1, 0.05]
    assert load_model_spec(DIGITS_MODEL).learning_rate_at is None


# ---------------------------------------------------------------- model errors (issue 31 §5)

FAILING_LOSS = """
def loss(labels, predictions):
    return predictions["no_such_output"]
"""


def failing_model(tmp_path: Path) -> str:
    path = tmp_path / "failing.py"
    path.write_text(Path(DIGITS_MODEL).read_text() + "\n" + FAILING_LOSS)
    return str(path)


def test_an_error_raised_in_a_model_function_names_the_model_file_and_function(tmp_path: Path) -> None:
    import tensorflow as tf

    from edl_argo.model.user_code import model_error_of

    model = failing_model(tmp_path)
    spec = load_model_spec(model)
    with pytest.raises(TypeError) as called:
        spec.loss(tf.zeros([2]), tf.zeros([2, 10]))
    found = model_error_of(called.value)
    assert found is not None and (found.source, found.function) == (model, "loss")
    assert str(found).startswith(f"model file {model}, function loss: TypeError: ")
    assert "\n" not in str(found)

    # Traced by TensorFlow, which raises a copy of the error with the original as its context.
    traced = tf.function(lambda labels, outputs: spec.loss(labels, outputs))
    with pytest.raises(Exception) as in_graph:
        traced(tf.zeros([2]), tf.zeros([2, 10]))
    assert in_graph.value is not called.value
    found = model_error_of(in_graph.value)
    assert found is not None and found.function == "loss", repr(in_graph.value)


def test_errors_outside_the_model_files_code_are_not_model_errors(tmp_path: Path) -> None:
    from edl_argo.errors import StorageError
    from edl_argo.model.user_code import model_error_of

    spec = load_model_spec(failing_model(tmp_path))
    assert model_error_of(StorageError("cannot read s3://b/k: connection refused")) is None
    assert model_error_of(ConnectionError("PS 0 at 10.0.0.3:2222 is unavailable")) is None
    try:
        try:
            spec.loss(None, {})
        except KeyError:  # as Keras re-raises an error of a layer's call, with more words
            raise RuntimeError("Exception encountered when calling layer 'dense'") from None
    except RuntimeError as reworded:
        assert model_error_of(reworded) is not None  # replaced on purpose: the model's error stands
    try:
        try:
            spec.loss(None, {})
        except KeyError:
            raise ConnectionError("PS 0 lost while the worker handled it")  # noqa: B904
    except ConnectionError as infrastructure:
        assert model_error_of(infrastructure) is None  # a new failure while handling it: not the model's


def test_an_error_of_a_traced_step_at_run_time_is_reported_by_its_message_not_tensorflows_heading() -> None:
    """A shape error found while a traced function runs comes as "Graph execution error:", then where the
    node was defined, then the message: the task's one-line error is the message."""
    import tensorflow as tf

    from edl_argo.model.user_code import error_line

    @tf.function(autograph=False, input_signature=[tf.TensorSpec([None]), tf.TensorSpec([None])])
    def product(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        return x * y

    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        product(tf.ones([2]), tf.ones([3]))
    assert str(raised.value).startswith("Graph execution error:")
    assert error_line(raised.value) == "InvalidArgumentError: Incompatible shapes: [2] vs. [3]"
