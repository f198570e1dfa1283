"""``edl-argo evaluate`` and ``edl-argo predict``: a published model + shards → metrics or predictions.

Both run in one process and build the model as a job's workers do: ``custom_model()`` of the model file,
built on the first batch, then loaded with the trained weights of the published tree's ``model.keras`` (of
the version its pointer names; a tree of older edl-argo, without a pointer, is read as it is).
So subclassed models and ``Lambda`` layers work, since nothing is deserialized from the file but weights
(the tree's SavedModel is for serving). Every shard is read through the workers' data path (``feed`` of
the model file, in EVALUATION or PREDICTION mode); metrics are aggregated exactly as the master does
(:class:`~edl_argo.master.evaluation.MetricsAccumulator`).

``predict --output URL`` is one tree (:mod:`edl_argo.storage.trees`), published as a new version only
when every record was predicted; until its pointer is switched, the previous predictions stay readable::

    URL/_edl-tree.json               the pointer: names the current version, written last
    URL/<version>/<shard>.jsonl      one JSON line per record of that input shard (its name in the dataset,
                                     e.g. data-00000, without the dataset's version folder), in record order:
                                     {"shard": ..., "record": <index in the shard>, "output": ...}
    URL/<version>/predictions.json   {"records": N, "shards": {"<shard>": n, ...}, "model": ..., "data": ...}

``output`` is the record's row of a single-tensor output, or ``{name: row}`` for a multi-output model
(:mod:`edl_argo.model.outputs`); NaN and infinities are written as ``null``. ``URL`` may hold nothing but
an earlier prediction output: any other file there makes ``predict`` refuse before it starts.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from edl_argo.cpu_limit import size_tensorflow_threads
from edl_argo.errors import ConfigError, EdlError
from edl_argo.flags import add_flag, positive_int
from edl_argo.json_values import dumps
from edl_argo.log import get_logger
from edl_argo.model import Mode, ModelSpec, load_model_spec
from edl_argo.model.contract import add_model_flags, model_options_from_args
from edl_argo.model.outputs import (
    as_given,
    named_arrays,
    num_records,
    output_names,
    prediction_lines,
)
from edl_argo.model.user_code import MAX_ERROR_CHARS, model_error_of
from edl_argo.progress import ProgressReporter
from edl_argo.readers import OpenedDataset, open_data, parse_data_options
from edl_argo.settings import add_data_settings
from edl_argo.storage import (
    TREE_COMPLETE_MARKER,
    ObjectNotFoundError,
    Storage,
    open_reachable_storage,
    open_storage,
)
from edl_argo.storage.trees import POINTER_NAME, open_tree
from edl_argo.storage.versions import VERSION_FOLDER
from edl_argo.tensorflow_import import import_tensorflow

log = get_logger(__name__)

#: Records read per step (a shard is read range by range, never whole).
READ_RANGE = 4096
#: The summary file of a prediction output.
PREDICTIONS_SUMMARY = "predictions.json"
PREDICTION_SUFFIX = ".jsonl"


def register(subparsers: argparse._SubParsersAction) -> None:
    for name, help_text, run in (
        ("evaluate", "compute the model file's metrics of a trained model on shards", run_evaluate),
        ("predict", "run a trained model over shards and write one prediction per record", run_predict),
    ):
        parser = subparsers.add_parser(name, help=help_text)
        add_flag(
            parser,
            "--model",
            required=True,
            metavar="URL",
            help="the model tree written by `train` (<output>/model)",
        )
        add_model_flags(parser)  # the model file used for training (for feed and metrics)
        add_flag(
            parser,
            "--data",
            required=True,
            metavar="URL",
            help="the data, in the forms --training-data takes",
        )
        add_data_settings(parser)
        output_help = (
            "where the predictions go, replaced as a whole (one <shard>.jsonl per input shard)"
            if name == "predict"
            else "where metrics.json goes"
        )
        add_flag(parser, "--output", required=name == "predict", default="", metavar="URL", help=output_help)
        add_flag(parser, "--minibatch-size", type=positive_int, default=256)
        add_flag(parser, "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
        parser.set_defaults(run=run)


@dataclass(frozen=True)
class Batch:
    """A minibatch of ``shard`` whose first record is number ``start`` of the shard."""

    shard: str
    start: int
    records: int
    features: Any
    labels: Any = None


class Inference:
    """A trained model of ``spec`` run over the dataset ``open_dataset()`` opens (after the model is found,
    so that a missing model is the error reported); the model is built on the first batch."""

    def __init__(
        self, spec: ModelSpec, model_url: str, open_dataset: Callable[[], OpenedDataset], minibatch_size: int
    ) -> None:
        self.spec = spec
        self.model_url = model_url
        self.minibatch_size = minibatch_size
        self._model: Any = None
        self._names: list[str] | None = None
        self._storage = open_storage(model_url)
        try:
            self._tree = open_tree(self._storage, "")
        except ObjectNotFoundError:
            raise ConfigError(
                f"--model {model_url}: no complete model there "
                "(expected the <output>/model of a finished job)"
            ) from None
        #: The dataset: its shards listed (or named by a manifest) and pinned to their versions when opened.
        self.data = open_dataset()
        self.shards = list(self.data.records)
        #: Shard key -> the shard's name in the dataset (``data-00000``), which predictions are named by.
        self.names = self.data.names

    def batches(self, mode: str) -> Iterator[Batch]:
        """Every minibatch of every shard, in order, through one input pipeline (``feed`` traced once, by
        the first range read: :class:`~edl_argo.worker.data.TaskBatches`). ``feed`` errors name the shard."""
        from edl_argo.worker.data import TaskBatches

        pipeline: TaskBatches | None = None
        counts = self.data.records
        total = sum(counts.values())
        progress = ProgressReporter(f"{mode} {self.data.describe()}", unit="record")
        done = 0
        try:
            for key in self.shards:
                for first in range(0, counts[key], READ_RANGE):
                    last = min(counts[key], first + READ_RANGE)
                    position = first
                    records = self.data.read(key, first, last)
                    with self.naming(key, first, last):
                        if pipeline is None:
                            pipeline = TaskBatches(self.spec, mode, self.data.schema, self.minibatch_size)
                        for batch in pipeline.batches(records):
                            features, labels = (batch, None) if mode == Mode.PREDICTION else batch
                            size = num_records(features)
                            yield Batch(key, position, size, features, labels)
                            position += size
                            done += size
                            progress.update(done, total)
                    if mode == Mode.PREDICTION and position != last:
                        raise ConfigError(
                            f"--model-def {self.spec.source}: feed gave {position - first} elements for "
                            f"records {first}-{last - 1} of shard {self.data.describe(key)}; to predict, "
                            "feed must give one element per record"
                        )
        finally:
            progress.close()

    def outputs(self, batch: Batch) -> dict[str, Any]:
        """The model's outputs for ``batch``, named; the model is built and loaded on the first call."""
        with self.naming(batch.shard, batch.start, batch.start + batch.records):
            if self._model is None:
                self._model = self._load(batch.features)
                self._names = output_names(self._model)
            return named_arrays(self._model(batch.features, training=False), self._names)

    def _load(self, sample_features: Any) -> Any:
        from edl_argo.master.export import KERAS_FILE
        from edl_argo.worker.replica import build_model

        model = build_model(self.spec, sample_features)
        key = self._tree.file_key(KERAS_FILE)
        url = self._storage.describe(key)
        with tempfile.TemporaryDirectory(prefix="edl-model-") as tmp:
            path = Path(tmp) / KERAS_FILE
            self._storage.download(key, path)
            # Keras warns about the parts it skips before it fails: the error says what does not fit.
            with warnings.catch_warnings(record=True) as warned:
                try:
                    model.load_weights(path)
                except (zipfile.BadZipFile, EOFError, OSError, KeyError) as error:
                    raise ConfigError(
                        f"--model {url}: not a readable Keras file ({_reason(error)})"
                    ) from None
                except ValueError as error:
                    raise ConfigError(
                        f"--model {url}: its weights do not fit the model of --model-def {self.spec.source}: "
                        f"{_weights_mismatch(error)}"
                    ) from None
            for warning in warned:  # a load that succeeded warns as it would have
                warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
        log.info("model_loaded", model=url, model_def=self.spec.source)
        return model

    @contextmanager
    def naming(self, shard: str, first: int, last: int) -> Iterator[None]:
        """Turns an error of the model file's code (a model error, :mod:`edl_argo.model.user_code`: e.g.
        ``feed`` failing while it is traced), and TensorFlow's and Keras's errors about the data, into one
        ConfigError naming the shard; a model error's names the model file and function, as training's."""
        try:
            yield
        except EdlError:
            raise
        except Exception as error:
            where = f"shard {self.data.describe(shard)}, records {first}-{last - 1}"
            found = model_error_of(error)
            if found is not None:
                raise ConfigError(f"{found} ({where})") from None
            if not isinstance(error, (ValueError, TypeError, *_tf_errors())):
                raise
            raise ConfigError(
                f"--model-def {self.spec.source} does not fit the data of {where}: {_reason(error)}"
            ) from None


def _tf_errors() -> tuple[type[BaseException], ...]:
    import tensorflow as tf

    return (tf.errors.OpError,)


#: Keras's error for weights that do not fit the model (keras/src/saving/saving_lib.py,
#: ``_raise_loading_failure``): how many objects failed, the first one's error, then the list of them.
_OBJECTS_NOT_LOADED = re.compile(r"^A total of (\d+) objects could not be loaded\.")
_OBJECTS_LIST = "List of objects that could not be loaded:"
_OBJECT_NAME = re.compile(r"<\w+ name=([^,>]+)")
#: The error of a variable whose shape differs: the model's shape, the file's, the variable's path.
_SHAPE_MISMATCH = re.compile(
    r"variable\.shape=(\(.*?\)), Received: value\.shape=(\(.*?\))\. Target variable: <Variable path=([^,>]+)"
)


def _weights_mismatch(error: ValueError) -> str:
    """Keras's error about weights that do not fit the model, as one line: how many of its objects (layers)
    could not be loaded, named, and the first one's reason (for a shape: the variable, its shape in the
    file and in the model); an error in another form as :func:`_reason` gives it."""
    text = str(error)
    counted = _OBJECTS_NOT_LOADED.match(text)
    if counted is None:
        return _reason(error)
    example, _, listed = text.partition(_OBJECTS_LIST)
    shapes = _SHAPE_MISMATCH.search(example)
    if shapes is not None:
        model_shape, saved_shape, variable = shapes.groups()
        first = f"variable {variable} has shape {saved_shape} in the file, {model_shape} in the model"
    else:
        lines = [line.strip() for line in example.splitlines()[1:] if line.strip()]
        first = lines[0] if lines else "(Keras gave no reason)"
    names = ", ".join(_OBJECT_NAME.findall(listed))
    return f"{counted[1]} objects could not be loaded ({names}); the first: {first}"[:MAX_ERROR_CHARS]


def _reason(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:500]


def evaluate(inference: Inference) -> dict[str, float]:
    """The model file's metrics over every record; ConfigError if there are none."""
    from edl_argo.master.evaluation import MetricsAccumulator

    metrics = MetricsAccumulator(inference.spec.eval_metrics_fn)
    for batch in inference.batches(Mode.EVALUATION):
        outputs = inference.outputs(batch)
        with inference.naming(batch.shard, batch.start, batch.start + batch.records):
            metrics.update(outputs, named_arrays(batch.labels))
    if metrics.records == 0:
        raise ConfigError(f"--data {inference.data.describe()}: 0 records to evaluate")
    return {**metrics.result(), "records": metrics.records}


def open_inference_data(
    args: argparse.Namespace, spec: ModelSpec | None = None, task_type: str = "evaluation"
) -> OpenedDataset:
    """The dataset of ``--data``, in ``--data-format`` with ``--data-options``; read by the model's custom
    data reader instead when ``spec`` has one (the ``--data-options`` items are then its keyword
    arguments, and its tasks are of ``task_type``)."""
    options = parse_data_options(args.data_options)
    if spec is not None and spec.custom_data_reader:
        from edl_argo.readers.custom import custom_options

        options = custom_options(
            args.model_def,
            spec.custom_data_reader,
            model_zoo=args.model_zoo,
            params=options,
            records_per_task=args.minibatch_size,
            task_type=task_type,
        )
        return open_data(args.data, "custom", options, what="--data")
    return open_data(args.data, args.data_format, options, what="--data")


def load_step_model(args: argparse.Namespace) -> ModelSpec:
    """The model file of an evaluate or predict step, TensorFlow imported first as a pod imports it
    (:func:`~edl_argo.tensorflow_import.import_tensorflow`), its thread pools sized to the step's CPU limit
    before the model runs (:mod:`edl_argo.cpu_limit`)."""
    import_tensorflow()
    spec = load_model_spec(args.model_def, model_options_from_args(args))
    size_tensorflow_threads()
    return spec


def run_evaluate(args: argparse.Namespace) -> int:
    output = open_reachable_storage(args.output, "--output") if args.output else None
    spec = load_step_model(args)
    results = evaluate(
        Inference(spec, args.model, lambda: open_inference_data(args, spec), args.minibatch_size)
    )
    log.info("evaluation_done", data=args.data, **results)
    if output is not None:
        output.write("metrics.json", dumps(results, indent=2, sort_keys=True).encode())
    print(dumps(results, sort_keys=True))
    return 0


def predict(inference: Inference, local_dir: Path) -> dict[str, int]:
    """Write the prediction files of every shard into ``local_dir``; records per shard."""
    processor = inference.spec.prediction_outputs_processor
    processor = processor() if processor is not None else None
    counts = {inference.names[key]: 0 for key in inference.shards}
    with ExitStack() as files:
        opened: dict[str, IO[str]] = {}
        for batch in inference.batches(Mode.PREDICTION):
            outputs = inference.outputs(batch)
            if processor is not None:
                processor.process(as_given(outputs), 0)
            name = inference.names[batch.shard]
            if name not in opened:
                path = local_dir / (name + PREDICTION_SUFFIX)
                path.parent.mkdir(parents=True, exist_ok=True)
                opened[name] = files.enter_context(path.open("w", encoding="utf-8"))
            opened[name].writelines(line + "\n" for line in prediction_lines(name, batch.start, outputs))
            counts[name] += batch.records
    for name, count in counts.items():
        if count == 0:  # an empty shard still has its (empty) file: one file per input shard
            path = local_dir / (name + PREDICTION_SUFFIX)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
    return counts


def prediction_target(url: str) -> tuple[Storage, str]:
    """(the storage holding ``url``, the tree key of ``url`` in it); ConfigError if ``url`` is not a folder
    that may be replaced: it holds files other than an earlier prediction output, or is a bucket's root."""
    head, separator, name = url.strip().rstrip("/").rpartition("/")
    if not name or name in (".", "..") or head in ("s3:", "s3:/"):
        raise ConfigError(
            f"--output {url}: name a folder (or a prefix below an S3 bucket) for the predictions"
        )
    if not separator:
        head = "."
    elif not head or head.endswith(":/"):
        head += "/"
    open_reachable_storage(url, "--output")
    parent = open_storage(head)
    foreign = [
        info.key[len(name) + 1 :]
        for info in parent.list(name + "/")
        if not _a_prediction_file(info.key[len(name) + 1 :])
    ]
    if foreign:
        raise ConfigError(
            f"--output {url} holds {len(foreign)} file(s) that are not predictions (first: {foreign[0]}); "
            "predict replaces its output as a whole: choose an empty or new folder"
        )
    return parent, name


def _a_prediction_file(rel: str) -> bool:
    """Whether ``rel`` (a path in a --output folder) can be part of a prediction output: the tree's
    pointer, or a prediction file or summary in a version folder (or, for older edl-argo, in the folder)."""
    if rel in (POINTER_NAME, TREE_COMPLETE_MARKER):
        return True
    folder, _, inside = rel.partition("/")
    if inside and VERSION_FOLDER.match(folder):
        rel = inside
    return rel.endswith(PREDICTION_SUFFIX) or rel == PREDICTIONS_SUMMARY


def run_predict(args: argparse.Namespace) -> int:
    spec = load_step_model(args)
    target, name = prediction_target(args.output)
    inference = Inference(
        spec, args.model, lambda: open_inference_data(args, spec, "prediction"), args.minibatch_size
    )
    with tempfile.TemporaryDirectory(prefix="edl-predictions-") as tmp:
        local_dir = Path(tmp) / "predictions"
        local_dir.mkdir()
        counts = predict(inference, local_dir)
        summary = {"records": sum(counts.values()), "shards": counts, "model": args.model, "data": args.data}
        (local_dir / PREDICTIONS_SUMMARY).write_text(dumps(summary, indent=2, sort_keys=True))
        target.put_tree(local_dir, name)
    log.info("predictions_written", output=args.output, records=summary["records"])
    print(f"wrote {summary['records']} predictions to {args.output}")
    return 0
