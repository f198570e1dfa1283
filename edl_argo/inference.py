"""``edl-argo evaluate`` and ``edl-argo predict``: a published model + shards → metrics or predictions.

Both run in one process: they load the model tree written by ``edl-argo train`` (``model.keras``), read
every shard through the same data path as workers (``feed`` of the model file, in EVALUATION or
PREDICTION mode) and aggregate metrics exactly as the master does.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from edl_argo.errors import ConfigError
from edl_argo.flags import add_flag, positive_int
from edl_argo.log import get_logger
from edl_argo.model import Mode, ModelSpec, load_model_spec
from edl_argo.progress import ProgressReporter
from edl_argo.recordio import ShardReader, open_dataset
from edl_argo.storage import Storage, open_storage

log = get_logger(__name__)

#: Records read per step (a shard is read range by range, never whole).
READ_RANGE = 4096


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
        add_flag(
            parser,
            "--model-def",
            required=True,
            help="the model file used for training (for feed and metrics)",
        )
        add_flag(
            parser, "--data", required=True, metavar="URL", help="folder or s3://bucket/prefix of shards"
        )
        add_flag(
            parser, "--output", required=name == "predict", default="", metavar="URL", help="where results go"
        )
        add_flag(parser, "--minibatch-size", type=positive_int, default=256)
        add_flag(parser, "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
        parser.set_defaults(run=run)


def load_trained_model(spec: ModelSpec, model_url: str) -> Any:
    """The model of ``spec`` with the weights of the published tree at ``model_url``."""
    import keras

    from edl_argo.master.export import KERAS_FILE

    storage = open_storage(model_url)
    if not storage.tree_complete(""):
        raise ConfigError(
            f"--model {model_url}: no complete model there (expected the <output>/model of a finished job)"
        )
    with tempfile.TemporaryDirectory(prefix="edl-model-") as tmp:
        path = Path(tmp) / KERAS_FILE
        path.write_bytes(storage.read(KERAS_FILE))
        keras.utils.clear_session()
        return keras.models.load_model(path, compile=False)


def _batches(
    spec: ModelSpec, storage: Storage, mode: str, minibatch_size: int
) -> Iterator[tuple[str, int, Any]]:
    """(shard, first record, batch) over every shard, in order."""
    from edl_argo.worker.data import make_batches

    dataset = open_dataset(storage, what="--data")
    shards = list(dataset.records)
    readers = [ShardReader(storage, key, version=dataset.versions[key]) for key in shards]
    total = sum(r.num_records for r in readers)
    progress = ProgressReporter(f"{mode} {storage.describe()}", unit="record")
    done = 0
    try:
        for key, reader in zip(shards, readers, strict=True):
            for start in range(0, reader.num_records, READ_RANGE):
                records = reader.read(start, min(reader.num_records, start + READ_RANGE))
                position = start
                for batch in make_batches(spec, records, mode, minibatch_size):
                    yield key, position, batch
                    size = len(batch[0]) if mode == Mode.EVALUATION else len(batch)
                    position += size
                    done += size
                    progress.update(done, total)
    finally:
        progress.close()


def evaluate(spec: ModelSpec, model: Any, storage: Storage, minibatch_size: int) -> dict[str, float]:
    from edl_argo.master.evaluation import MetricsAccumulator

    metrics = MetricsAccumulator(spec.eval_metrics_fn)
    for _shard, _start, (features, labels) in _batches(spec, storage, Mode.EVALUATION, minibatch_size):
        metrics.update(np.asarray(model(features, training=False)), np.asarray(labels))
    return {**metrics.result(), "records": float(metrics.records)}


def run_evaluate(args: argparse.Namespace) -> int:
    spec = load_model_spec(args.model_def)
    model = load_trained_model(spec, args.model)
    results = evaluate(spec, model, open_storage(args.data), args.minibatch_size)
    log.info("evaluation_done", data=args.data, **results)
    if args.output:
        open_storage(args.output).write(
            "metrics.json", json.dumps(results, indent=2, sort_keys=True).encode()
        )
    print(json.dumps(results, sort_keys=True))
    return 0


def run_predict(args: argparse.Namespace) -> int:
    from edl_argo.worker.main import write_predictions

    spec = load_model_spec(args.model_def)
    model = load_trained_model(spec, args.model)
    processor = spec.prediction_outputs_processor() if spec.prediction_outputs_processor else None
    count = 0
    for shard, start, features in _batches(
        spec, open_storage(args.data), Mode.PREDICTION, args.minibatch_size
    ):
        outputs = np.asarray(model(features, training=False))
        if processor is not None:
            processor.process(outputs, 0)
        write_predictions(args.output, shard, start, outputs)
        count += len(outputs)
    log.info("predictions_written", output=args.output, records=count)
    print(f"wrote {count} predictions to {args.output}")
    return 0
