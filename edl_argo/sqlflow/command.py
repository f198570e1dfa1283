"""``edl-argo sql "<statement>" --db URL --models URL``: run a SQLFlow statement.

- ``TO TRAIN <model> ... INTO name`` opens the SELECT through the SQL reader (dataset URL ``db#SELECT``),
  builds the feature columns (:mod:`~edl_argo.sqlflow.columns`, from a sample of the rows), writes the
  premade model's file (:mod:`~edl_argo.sqlflow.premade`) to ``<models>/<name>/sqlflow_model.py`` and runs
  an ``edl-argo train`` job with output ``<models>/<name>`` (the trained model is ``<models>/<name>/model``).
  Attributes: ``model.*`` (the premade model's), ``train.epoch`` (--num-epochs), ``train.batch_size``
  (--minibatch-size), ``train.workers`` (--num-workers), ``train.ps`` (--num-ps), ``train.strategy``
  (--distribution-strategy), ``train.key`` (the SQL reader's key column: O(range) reads),
  ``validation.select`` (--validation-data, a SELECT of the same database) and ``validation.metrics``
  (checked against the model's metrics). Anything else is a one-line error before anything starts.
  ``--train-flags`` adds ``edl-argo train`` flags (``--num-workers 2``, ``--backend kubernetes``) but none
  that the statement sets (:data:`SQL_SET_FLAGS`, and a flag its WITH sets): those are one-line errors too.
- ``TO PREDICT table.column USING name`` writes a new table: the SELECT's columns plus ``column`` (the
  class id or value). Rows are written in batches into a temporary table that is renamed to ``table`` only
  once every row is in, so the table is complete or absent. An existing ``table`` is an error unless
  ``WITH predict.overwrite=true``; ``predict.batch_size`` sets the batch.
- ``TO EVALUATE name [LABEL col] INTO table`` writes one row into a new table: the model's metrics (its
  ``eval_metrics_fn``, aggregated as the master does) and ``records``; ``validation.metrics`` picks some.

The database password is ``EDL_DB_PASSWORD`` (never in ``--db``), as for the SQL reader.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from edl_argo.errors import ConfigError
from edl_argo.flags import add_flag
from edl_argo.log import get_logger
from edl_argo.sqlflow.parser import EvaluateStatement, PredictStatement, Statement, TrainStatement, parse

log = get_logger(__name__)

#: The model file a TO TRAIN writes under ``<models>/<name>/``.
MODEL_FILE = "sqlflow_model.py"
#: Rows sampled at TO TRAIN to derive and complete the feature columns.
SAMPLE_ROWS = 2000
#: Rows read (and written) per step of TO PREDICT / TO EVALUATE.
READ_RANGE = 4096
#: ``train.*``/``validation.*`` attribute -> the ``edl-argo train`` flag it sets.
TRAIN_FLAGS = {
    "train.epoch": "--num-epochs",
    "train.batch_size": "--minibatch-size",
    "train.workers": "--num-workers",
    "train.ps": "--num-ps",
    "train.strategy": "--distribution-strategy",
}
#: ``edl-argo train`` flags that ``sql`` sets itself (or leaves out on purpose: the data are the statement's),
#: and what sets them; ``--train-flags`` may not give them, nor a flag of :data:`TRAIN_FLAGS` its WITH sets.
SQL_SET_FLAGS = {
    "--training-data": "the SELECT",
    "--validation-data": "WITH validation.select",
    "--data-format": "the SELECT (sql)",
    "--data-options": "the SELECT and WITH train.key",
    "--model-def": "the statement",
    "--output": "--models and INTO",
}
TRAIN_ATTRS = (*TRAIN_FLAGS, "train.key", "validation.select", "validation.metrics")
PREDICT_ATTRS = ("predict.overwrite", "predict.batch_size")
EVALUATE_ATTRS = ("validation.metrics", "evaluate.overwrite")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sql", help="run a SQLFlow statement (SELECT ... TO TRAIN|PREDICT|EVALUATE)"
    )
    parser.add_argument("statement", help="the statement, e.g. 'SELECT * FROM t TO TRAIN DNNClassifier ...'")
    add_flag(
        parser, "--db", required=True, metavar="URL", help="SQLAlchemy URL of the database (no password)"
    )
    add_flag(
        parser, "--models", required=True, metavar="URL", help="folder or s3:// prefix of trained models"
    )
    add_flag(
        parser,
        "--train-flags",
        default="",
        metavar="FLAGS",
        help="more `edl-argo train` flags for TO TRAIN, e.g. '--backend kubernetes --image IMG'",
    )
    add_flag(parser, "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.set_defaults(run=run_sql)


def run_sql(args: argparse.Namespace) -> int:
    statement = parse(args.statement)
    if isinstance(statement, TrainStatement):
        return run_train_statement(statement, args.db, args.models, args.train_flags.split())
    if isinstance(statement, PredictStatement):
        rows = predict_statement(statement, args.db, args.models)
        print(f"{rows} rows predicted into {statement.table}")
        return 0
    metrics = evaluate_statement(statement, args.db, args.models)
    print(" ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
    return 0


def _check_attrs(statement: Statement, allowed: Sequence[str], prefixes: Sequence[str] = ()) -> None:
    clause = type(statement).__name__.removesuffix("Statement").upper()
    for name in statement.attrs:
        if name not in allowed and not name.startswith(tuple(prefixes)):
            raise ConfigError(
                f"TO {clause}: unknown attribute {name} (known: {', '.join([*prefixes, *allowed])})"
            )


def _check_database(db: str) -> None:
    """``--db``, checked before a statement does anything: a database URL without '#' nor password whose
    dialect and driver are installed; ConfigError naming ``--db`` otherwise."""
    from edl_argo.readers.sql import (
        DEFAULT_CONNECT_TIMEOUT,
        DEFAULT_STATEMENT_TIMEOUT,
        engine_for,
        parse_database,
    )

    if "#" in db:
        raise ConfigError(f"--db {db}: a database URL, without '#' (the statement's SELECT is the dataset)")
    parse_database(db, "--db")
    engine_for(db, DEFAULT_CONNECT_TIMEOUT, DEFAULT_STATEMENT_TIMEOUT, f"--db {db}")


def _dataset_url(db: str, select: str) -> str:
    """The SQL reader's URL of ``select`` in the database ``db`` (a :func:`_check_database` one)."""
    return f"{db}#{select}"


def _sample(opened: Any, rows: int) -> dict[str, list[Any]]:
    """The first ``rows`` rows of an opened dataset, by column."""
    count = min(rows, opened.shards[0].records)
    records = opened.read(opened.shards[0].key, 0, count)
    return {name: array.tolist() for name, array in zip(opened.schema.names, records, strict=True)}


def _model_dir(models: str, name: str) -> str:
    return f"{models.rstrip('/')}/{name}"


# --- TO TRAIN ------


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """What a TO TRAIN runs: the model file's text, where it goes, and the ``edl-argo train`` arguments (as
    a list, and parsed)."""

    model_file: str
    model_url: str
    argv: list[str]
    args: argparse.Namespace


def plan_training(statement: TrainStatement, db: str, models: str, extra: Sequence[str] = ()) -> TrainPlan:
    """Check the statement against the data and make the job's arguments (nothing starts here)."""
    from edl_argo.master.config import config_from_args
    from edl_argo.readers import open_data
    from edl_argo.sqlflow.columns import build
    from edl_argo.sqlflow.premade import PremadeModel, model_file_text

    _check_database(db)
    _check_attrs(statement, TRAIN_ATTRS, ("model.",))
    attrs = statement.attrs
    params = {k.removeprefix("model."): v for k, v in attrs.items() if k.startswith("model.")}
    options = {"key": str(attrs["train.key"])} if "train.key" in attrs else {}
    output = _model_dir(models, statement.into)
    argv = [
        "--training-data",
        _dataset_url(db, statement.select),
        "--model-def",
        f"{output}/{MODEL_FILE}",
        "--output",
        output,
    ]
    if options:
        argv += ["--data-options", f"key={options['key']}"]
    for name, flag in TRAIN_FLAGS.items():
        if name in attrs:
            argv += [flag, str(attrs[name])]
    if "validation.select" in attrs:
        argv += ["--validation-data", _dataset_url(db, str(attrs["validation.select"]))]
    args = _train_args(argv, attrs, extra)
    config_from_args(args)  # the flags together, checked before the model file is written
    opened = open_data(_dataset_url(db, statement.select), "sql", options, what="TO TRAIN")
    schema = dict(zip(opened.schema.names, opened.schema.dtypes, strict=True))
    if not statement.label:
        raise ConfigError(f"TO TRAIN {statement.model}: a LABEL column is needed")
    if statement.label not in schema:
        raise ConfigError(f"LABEL: no column {statement.label!r} in the SELECT ({', '.join(schema)})")
    columns = build(statement.columns, schema, _sample(opened, SAMPLE_ROWS), statement.label)
    premade = PremadeModel(statement.model, columns, statement.label, params)
    if premade.classifier and schema[statement.label] not in ("int64", "int32", "bool"):
        raise ConfigError(
            f"LABEL {statement.label}: a classifier's label must be an integer class id, not "
            f"{schema[statement.label]} (map it to ids in the SELECT)"
        )
    wanted = attrs.get("validation.metrics")
    if wanted is not None:
        _metric_names(premade.eval_metrics_fn(), wanted)
    return TrainPlan(model_file_text(premade), f"{output}/{MODEL_FILE}", [*argv, *extra], args)


def _train_args(argv: Sequence[str], attrs: Mapping[str, Any], extra: Sequence[str]) -> argparse.Namespace:
    """``argv`` (what the statement sets) then ``extra`` (``--train-flags``) parsed as ``edl-argo train``
    parses its flags. A bad value is a ConfigError naming what the user wrote, ``WITH train.epoch=0: ...``
    for a value of the statement and ``--train-flags: ...`` for the rest; no usage is printed."""
    from edl_argo.flags import BuiltArgumentParser
    from edl_argo.master.config import add_train_flags

    parser = BuiltArgumentParser("edl-argo sql train")
    add_train_flags(parser)
    _refuse_flags_sql_sets(parser, attrs, extra)
    try:
        return parser.parse_args([*argv, *extra])
    except argparse.ArgumentError as error:
        flags = (error.argument_name or "").split("/")
        for name, flag in TRAIN_FLAGS.items():
            if name in attrs and flag in flags:
                raise ConfigError(f"WITH {name}={attrs[name]}: {error.message}") from None
        raise ConfigError(f"--train-flags: {error}") from None
    except ConfigError as error:  # not a value: an argument the train command does not take
        raise ConfigError(f"--train-flags: {error}") from None


def _refuse_flags_sql_sets(
    parser: argparse.ArgumentParser, attrs: Mapping[str, Any], extra: Sequence[str]
) -> None:
    """ConfigError for the first of ``extra`` (``--train-flags``) that gives a flag of :data:`SQL_SET_FLAGS`
    or one the statement's WITH sets, by any of its names (``--output``, ``--output=x``, ``--model_def``)."""
    setters = dict(SQL_SET_FLAGS)
    setters |= {flag: f"WITH {name}" for name, flag in TRAIN_FLAGS.items() if name in attrs}
    actions = parser._option_string_actions  # every name of every flag (argparse has no public map)
    by_dest = {actions[flag].dest: (flag, setter) for flag, setter in setters.items()}
    for written in extra:
        name = written.partition("=")[0]
        action = actions.get(name)
        if action is not None and action.dest in by_dest:
            flag, setter = by_dest[action.dest]
            raise ConfigError(
                f"--train-flags {name}: edl-argo sql sets {flag} itself, from {setter}; leave it out"
            )


def run_train_statement(statement: TrainStatement, db: str, models: str, extra: Sequence[str] = ()) -> int:
    """Plan, write the model file, and run the training job in this process (its master)."""
    from edl_argo.master.command import run_train
    from edl_argo.storage import open_reachable_storage

    storage = open_reachable_storage(_model_dir(models, statement.into), "--models")
    plan = plan_training(statement, db, models, extra)
    storage.write(MODEL_FILE, plan.model_file.encode())
    log.info("sqlflow_train", model=statement.model, into=plan.model_url)
    return int(run_train(plan.args) or 0)


# --- the trained model ------


@dataclasses.dataclass
class TrainedModel:
    """A model TO TRAIN published: its premade configuration and the Keras model with its weights."""

    premade: Any
    url: str
    keras: Any = None

    @classmethod
    def load(cls, models: str, name: str) -> TrainedModel:
        """The model ``name`` under ``models``: ConfigError if TO TRAIN wrote none there, StorageError (with
        the storage's own message) if it cannot be read."""
        from edl_argo.model import load_model_spec
        from edl_argo.storage import ObjectNotFoundError, StorageError, open_storage

        url = _model_dir(models, name)
        try:
            text = open_storage(url).read(MODEL_FILE)
        except ObjectNotFoundError:
            raise ConfigError(f"USING {name}: no model trained by TO TRAIN at {url}") from None
        except StorageError as error:  # unreachable, denied, ...: not a missing model
            raise StorageError(f"USING {name}: {error}") from None
        with tempfile.TemporaryDirectory(prefix="edl-sqlflow-") as tmp:
            path = Path(tmp) / MODEL_FILE
            path.write_bytes(text)
            spec = load_model_spec(str(path))
        return cls(spec.module._MODEL, url)

    def outputs(self, features: Any) -> Any:
        """The model's outputs for a batch; built and loaded with the trained weights on the first."""
        if self.keras is None:
            self.keras = self._build(features)
        return self.keras(features, training=False)

    def _build(self, features: Any) -> Any:
        import tensorflow as tf

        from edl_argo.master.export import KERAS_FILE, MODEL_KEY
        from edl_argo.storage import ObjectNotFoundError, open_storage
        from edl_argo.storage.trees import open_tree

        tf.keras.utils.clear_session(free_memory=False)  # as build_model: names restart, no collection
        model = self.premade.custom_model()
        model(features, training=False)
        storage = open_storage(f"{self.url}/{MODEL_KEY}")
        try:
            tree = open_tree(storage, "")
        except ObjectNotFoundError:
            raise ConfigError(f"USING {self.url}: no trained weights at {self.url}/{MODEL_KEY}") from None
        with tempfile.TemporaryDirectory(prefix="edl-sqlflow-") as tmp:
            path = Path(tmp) / KERAS_FILE
            storage.download(tree.file_key(KERAS_FILE), path)
            model.load_weights(path)
        return model


def _batches(opened: Any, premade: Any, mode: str, batch_size: int) -> Iterator[tuple[Any, Any, Any]]:
    """(records, fed batch, labels or None) of every row, in the reader's order, ``READ_RANGE`` at a time."""
    import tensorflow as tf

    from edl_argo.model import Mode

    shard = opened.shards[0]
    names = opened.schema.names
    for first in range(0, shard.records, READ_RANGE):
        last = min(shard.records, first + READ_RANGE)
        records = opened.read(shard.key, first, last)
        columns = {name: array for name, array in zip(names, records, strict=True)}
        tensors = {
            name: tf.constant(array.astype(str) if array.dtype == object else array)
            for name, array in columns.items()
        }
        dataset = fed_rows(premade, tensors, mode).batch(batch_size)
        position = first
        for element in dataset:
            features, labels = (element, None) if mode == Mode.PREDICTION else element
            size = int(next(iter(tf.nest.flatten(features))).shape[0])
            rows = tuple(array[position - first : position - first + size] for array in records)
            yield rows, features, labels
            position += size


def fed_rows(premade: Any, columns: dict[str, Any], mode: str) -> Any:
    """The premade model's ``feed`` over the rows of ``columns`` (tensors by column name), its per-row maps
    run on the thread that asks for the element, as a job's workers run a model file's
    (:mod:`edl_argo.model.feed_maps`)."""
    import tensorflow as tf

    from edl_argo.model.feed_maps import maps_on_the_calling_thread

    with maps_on_the_calling_thread():
        return premade.feed(tf.data.Dataset.from_tensor_slices(columns), mode)


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"WITH {name}={value!r}: a positive integer")
    return value


# --- TO PREDICT ------


def predict_statement(statement: PredictStatement, db: str, models: str) -> int:
    """Write the prediction table; the number of rows written."""
    from edl_argo.model import Mode
    from edl_argo.readers import open_data

    _check_database(db)
    _check_attrs(statement, PREDICT_ATTRS)
    overwrite = statement.attrs.get("predict.overwrite", False) is True
    batch_size = _positive(statement.attrs.get("predict.batch_size", 256), "predict.batch_size")
    model = TrainedModel.load(models, statement.using)
    premade = model.premade
    opened = open_data(_dataset_url(db, statement.select), "sql", {}, what="TO PREDICT")
    missing = [k for k in premade.columns.keys if k not in opened.schema.names]
    if missing:
        raise ConfigError(f"TO PREDICT: the SELECT lacks the model's column(s) {', '.join(missing)}")
    kept = [
        (n, t)
        for n, t in zip(opened.schema.names, opened.schema.dtypes, strict=True)
        if n != statement.column
    ]
    predicted_type = "int64" if premade.classifier else "float64"
    columns = [*kept, (statement.column, predicted_type)]
    indexes = [opened.schema.names.index(n) for n, _ in kept]
    written = 0
    with ResultTable(db, statement.table, columns, overwrite, "TO PREDICT") as table:
        for rows, features, _ in _batches(opened, premade, Mode.PREDICTION, batch_size):
            values = premade.predicted(model.outputs(features))
            table.insert([*(rows[i] for i in indexes), values])
            written += len(values)
    return written


# --- TO EVALUATE ------


def _metric_names(metrics: Mapping[str, Any], wanted: Any) -> list[str]:
    """The model's metric names that ``validation.metrics`` (``"Accuracy"`` or ``"a,b"`` or a list) picks."""
    names = wanted if isinstance(wanted, list) else str(wanted).split(",")
    by_lower = {name.lower(): name for name in metrics}
    chosen = []
    for name in (str(n).strip() for n in names):
        if name.lower() not in by_lower:
            raise ConfigError(
                f"WITH validation.metrics: {name!r} is not one of the model's ({', '.join(metrics)})"
            )
        chosen.append(by_lower[name.lower()])
    return chosen


def evaluate_statement(statement: EvaluateStatement, db: str, models: str) -> dict[str, float]:
    """Write one row of metrics into the statement's table; the metrics."""
    from edl_argo.master.evaluation import MetricsAccumulator
    from edl_argo.model import Mode
    from edl_argo.model.outputs import named_arrays
    from edl_argo.readers import open_data

    _check_database(db)
    _check_attrs(statement, EVALUATE_ATTRS)
    model = TrainedModel.load(models, statement.model)
    premade = model.premade
    if statement.label and statement.label != premade.label:
        premade = dataclasses.replace(premade, label=statement.label)
    opened = open_data(_dataset_url(db, statement.select), "sql", {}, what="TO EVALUATE")
    if premade.label not in opened.schema.names:
        raise ConfigError(
            f"LABEL: no column {premade.label!r} in the SELECT ({', '.join(opened.schema.names)})"
        )
    metrics = MetricsAccumulator(premade.eval_metrics_fn)
    for _, features, labels in _batches(opened, premade, Mode.EVALUATION, 256):
        metrics.update(named_arrays(model.outputs(features)), named_arrays(labels))
    result = metrics.result()
    wanted = statement.attrs.get("validation.metrics")
    if wanted is not None:
        result = {name: result[name] for name in _metric_names(result, wanted)}
    values = {**{k: float(v) for k, v in result.items()}, "records": float(metrics.records)}
    columns = [(name, "float64") for name in values]
    overwrite = statement.attrs.get("evaluate.overwrite", False) is True
    with ResultTable(db, statement.into, columns, overwrite, "TO EVALUATE") as table:
        table.insert([[v] for v in values.values()])
    return values


# --- result tables ------


class ResultTable:
    """A new table written whole or not at all: rows go into a temporary table beside it, renamed to
    ``name`` on a clean exit (replacing an existing table only with ``overwrite``), dropped otherwise."""

    def __init__(
        self, db: str, name: str, columns: Sequence[tuple[str, str]], overwrite: bool, clause: str
    ) -> None:
        import sqlalchemy as sa

        from edl_argo.readers.sql import SqlSource, engine_for

        SqlSource.parse(f"{db}#{name}", clause)  # a plain table name, no password
        self.engine = engine_for(db, 10.0, 600.0)
        self.schema, _, self.name = name.rpartition(".")
        self.schema = self.schema or None
        self.clause = clause
        self.label = f"{clause} {name}"
        if sa.inspect(self.engine).has_table(self.name, schema=self.schema) and not overwrite:
            raise ConfigError(
                f"{self.label}: the table exists; drop it or add WITH "
                f"{'predict' if clause == 'TO PREDICT' else 'evaluate'}.overwrite=true"
            )
        types = {
            "int64": sa.BigInteger,
            "int32": sa.Integer,
            "float64": sa.Float(53),
            "float32": sa.Float(24),
        }
        types |= {"bool": sa.Boolean, "string": sa.Text}
        self.temporary = f"{self.name}_edl_{uuid.uuid4().hex[:8]}"[-63:]
        metadata = sa.MetaData(schema=self.schema)
        self.table = sa.Table(self.temporary, metadata, *(sa.Column(n, types[t]) for n, t in columns))
        self.column_names = [n for n, _ in columns]

    def __enter__(self) -> ResultTable:
        from sqlalchemy import exc as sa_exc

        try:
            self.table.create(self.engine)
        except sa_exc.DBAPIError as error:
            raise ConfigError(f"{self.label}: cannot create it: {_first_line(error)}") from None
        return self

    def insert(self, columns: Sequence[Sequence[Any]]) -> None:
        """Rows given column by column (numpy arrays or lists), one transaction."""
        rows = [
            {name: _plain(value) for name, value in zip(self.column_names, row, strict=True)}
            for row in zip(*columns, strict=True)
        ]
        with self.engine.begin() as connection:
            connection.execute(self.table.insert(), rows)

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        import sqlalchemy as sa

        if kind is not None:
            self.table.drop(self.engine, checkfirst=True)
            return
        quote = self.engine.dialect.identifier_preparer.quote
        prefix = f"{quote(self.schema)}." if self.schema else ""
        target = f"{prefix}{quote(self.name)}"
        temporary = f"{prefix}{quote(self.temporary)}"
        backend = self.engine.dialect.name
        try:
            with self.engine.begin() as connection:
                connection.execute(sa.text(f"DROP TABLE IF EXISTS {target}"))
                if backend in ("mysql", "mariadb"):
                    connection.execute(sa.text(f"RENAME TABLE {temporary} TO {target}"))
                else:
                    connection.execute(sa.text(f"ALTER TABLE {temporary} RENAME TO {quote(self.name)}"))
        except Exception:
            self.table.drop(self.engine, checkfirst=True)
            raise


def _first_line(error: BaseException) -> str:
    from edl_argo.readers.sql import _first_line as first

    return first(error)


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python value a driver takes."""
    item = getattr(value, "item", None)
    return item() if callable(item) else value


__all__ = ["evaluate_statement", "plan_training", "predict_statement", "register", "run_sql"]
