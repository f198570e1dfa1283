"""SQLFlow feature columns: what a COLUMN clause says, as dataclasses that turn table columns into model
inputs, with TensorFlow ops that exist under Keras 3 (no ``tf.feature_column``).

Functions (SQLFlow's names; ``col`` is a column of the SELECT)::

    col | NUMERIC(col[, shape])      float32 [..., shape]; a text column holds shape comma-separated numbers
    CATEGORY_ID(col, buckets)        an integer id in [0, buckets) (taken modulo buckets); on a text column,
                                     1 + the value's index in the vocabulary of the data (0: not in it)
    CATEGORY_HASH(col, buckets)      the value's text hashed into [0, buckets)
    BUCKET(NUMERIC(col), [b1, ...])  the index of the boundary interval the value falls in: [0, len + 1)
    EMBEDDING(category, dim[, combiner])   a trained dim-vector per id of a CATEGORY_*/BUCKET/CROSS column
    CROSS([col or category, ...], buckets) the values' combination hashed into [0, buckets)

Each column has two halves. :func:`prepare` runs in ``feed`` on a dict of column tensors (per record, a
dict of scalars; batched, a dict of ``[batch]`` tensors: every op is element-wise) and gives one model
input per feature column (:attr:`input_name`): a float32 ``[..., shape]`` for a numeric column, an int64
id for a categorical one (an EMBEDDING's input is its category's ids). The model's side (inputs, one-hot,
embedding tables) is in :mod:`edl_argo.sqlflow.premade`.

Without a COLUMN clause the columns are derived from the SELECT's schema and a sample of its rows
(:func:`derive`, as SQLFlow's feature derivation): a number or boolean is NUMERIC; a text column with at
most :data:`VOCABULARY_LIMIT` distinct values in the sample is ``EMBEDDING(CATEGORY_ID(col, n + 1), dim)``
with that vocabulary, one with more ``EMBEDDING(CATEGORY_HASH(col, HASH_BUCKETS), dim)``. Derived and
written NUMERIC columns are standardized with the sample's mean and deviation (SQLFlow leaves them raw;
raw ages and hours make a small DNN learn slowly). Every column is JSON (:func:`to_json`), so that a
model file carries its columns.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from edl_argo.errors import ConfigError
from edl_argo.sqlflow.parser import Call, Name

#: A derived text column with at most this many distinct values in the sample gets a vocabulary.
VOCABULARY_LIMIT = 100
#: Buckets of a derived CATEGORY_HASH column.
HASH_BUCKETS = 1000
#: Combiners of EMBEDDING (SQLFlow's): how a multi-id row's vectors are reduced (one id per row here).
COMBINERS = ("mean", "sum", "sqrtn")
NUMERIC_TYPES = ("int64", "int32", "float64", "float32", "bool")


@dataclass(frozen=True)
class Numeric:
    """``NUMERIC(key[, shape])``: float32 ``[..., shape]``, standardized by ``mean`` and ``std``."""

    key: str
    shape: int = 1
    mean: float = 0.0
    std: float = 1.0

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key,)


class _KeyedBuckets:
    """What a category column of one ``key`` into ``buckets`` ids answers (fields of the subclass)."""

    key: str
    buckets: int

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key,)

    @property
    def num_buckets(self) -> int:
        return self.buckets


@dataclass(frozen=True)
class CategoryId(_KeyedBuckets):
    """``CATEGORY_ID(key, buckets)``: integer ids (modulo ``buckets``), or with a ``vocabulary`` (a text
    column) 1 + the index of the value in it, 0 for a value not in it."""

    key: str
    buckets: int
    vocabulary: tuple[str, ...] = ()


@dataclass(frozen=True)
class CategoryHash(_KeyedBuckets):
    """``CATEGORY_HASH(key, buckets)``: the value's text, hashed into ``[0, buckets)``."""

    key: str
    buckets: int


@dataclass(frozen=True)
class Bucket:
    """``BUCKET(NUMERIC(key), [boundaries])``: the interval index, in ``[0, len(boundaries) + 1)``."""

    source: Numeric
    boundaries: tuple[float, ...]

    @property
    def keys(self) -> tuple[str, ...]:
        return self.source.keys

    @property
    def num_buckets(self) -> int:
        return len(self.boundaries) + 1


@dataclass(frozen=True)
class Cross:
    """``CROSS([a, b, ...], buckets)``: the combination of the parts' values (a column's text, or a
    categorical column's id) hashed into ``[0, buckets)``."""

    parts: tuple[str | CategoryId | CategoryHash | Bucket, ...]
    buckets: int

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(k for part in self.parts for k in ((part,) if isinstance(part, str) else part.keys))

    @property
    def num_buckets(self) -> int:
        return self.buckets


Categorical = CategoryId | CategoryHash | Bucket | Cross


@dataclass(frozen=True)
class Embedding:
    """``EMBEDDING(category, dim[, combiner])``: a trained ``dim``-vector per id of ``category``."""

    category: Categorical
    dim: int
    combiner: str = "mean"

    @property
    def keys(self) -> tuple[str, ...]:
        return self.category.keys


FeatureColumn = Numeric | CategoryId | CategoryHash | Bucket | Cross | Embedding


@dataclass(frozen=True)
class FeatureColumns:
    """The feature columns of a model, by group (``""``, or ``linear``/``dnn`` for a wide-and-deep one),
    each with its model input's name."""

    groups: dict[str, tuple[FeatureColumn, ...]] = field(default_factory=dict)

    @property
    def all(self) -> tuple[FeatureColumn, ...]:
        seen: dict[FeatureColumn, None] = {}
        for columns in self.groups.values():
            seen.update(dict.fromkeys(columns))
        return tuple(seen)

    def input_name(self, column: FeatureColumn) -> str:
        """The model input of ``column``: ``f<index>_<first key>`` (unique, a valid Keras name)."""
        return f"f{self.all.index(column)}_{column.keys[0]}"

    @property
    def keys(self) -> tuple[str, ...]:
        """The table columns they read."""
        return tuple(dict.fromkeys(k for column in self.all for k in column.keys))


# --- from COLUMN clauses ----------------------------------------------------------------------------------


def _error(expr: Any, message: str) -> ConfigError:
    position = getattr(expr, "position", 0)
    return ConfigError(f"COLUMN: {message}" + (f" at position {position}" if position else ""))


def _int(expr: Any, what: str, call: Call) -> int:
    if isinstance(expr, bool) or not isinstance(expr, int) or expr <= 0:
        raise _error(call, f"{call.function}: {what} must be a positive integer, not {expr!r}")
    return expr


def _column_name(expr: Any, call: Call, schema: Mapping[str, str]) -> str:
    if not isinstance(expr, Name):
        raise _error(call, f"{call.function}: expected a column name, not {expr!r}")
    if expr.name not in schema:
        raise _error(expr, f"no column {expr.name!r} in the SELECT ({', '.join(schema)})")
    return expr.name


def _args(call: Call, least: int, most: int) -> tuple[Any, ...]:
    if not least <= len(call.args) <= most:
        count = f"{least}" if least == most else f"{least} to {most}"
        raise _error(call, f"{call.function} takes {count} arguments, not {len(call.args)}")
    return call.args


def from_expr(expr: Any, schema: Mapping[str, str]) -> FeatureColumn:
    """A COLUMN clause's expression as a feature column; ``schema``: the SELECT's column -> type.
    ConfigError naming the function, what is wrong and the position."""
    if isinstance(expr, Name):
        if expr.name not in schema:
            raise _error(expr, f"no column {expr.name!r} in the SELECT ({', '.join(schema)})")
        if schema[expr.name] not in NUMERIC_TYPES:
            raise _error(
                expr,
                f"column {expr.name!r} is text: say how to use it (CATEGORY_ID, CATEGORY_HASH, EMBEDDING)",
            )
        return Numeric(expr.name)
    if not isinstance(expr, Call):
        raise _error(expr, f"expected a column or a feature column, not {expr!r}")
    function = expr.function
    if function == "NUMERIC":
        args = _args(expr, 1, 2)
        shape = args[1][0] if len(args) == 2 and isinstance(args[1], list) and len(args[1]) == 1 else None
        shape = _int(shape if shape is not None else (args[1] if len(args) == 2 else 1), "shape", expr)
        return Numeric(_column_name(args[0], expr, schema), shape)
    if function in ("CATEGORY_ID", "CATEGORY_HASH"):
        args = _args(expr, 2, 2)
        key = _column_name(args[0], expr, schema)
        buckets = _int(args[1], "the bucket count", expr)
        return CategoryId(key, buckets) if function == "CATEGORY_ID" else CategoryHash(key, buckets)
    if function == "BUCKET":
        args = _args(expr, 2, 2)
        source = from_expr(args[0], schema) if isinstance(args[0], (Call, Name)) else None
        if not isinstance(source, Numeric) or source.shape != 1:
            raise _error(expr, "BUCKET: the first argument must be NUMERIC(col) of one value")
        bounds = args[1]
        if (
            not isinstance(bounds, list)
            or not bounds
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds)
            or sorted(bounds) != bounds
            or len(set(bounds)) != len(bounds)
        ):
            raise _error(expr, f"BUCKET: boundaries must be a list of increasing numbers, not {bounds!r}")
        return Bucket(source, tuple(float(b) for b in bounds))
    if function == "EMBEDDING":
        args = _args(expr, 2, 3)
        category = from_expr(args[0], schema) if isinstance(args[0], Call) else None
        if not isinstance(category, (CategoryId, CategoryHash, Bucket, Cross)):
            raise _error(
                expr, "EMBEDDING: the first argument must be CATEGORY_ID, CATEGORY_HASH, BUCKET or CROSS"
            )
        given = args[2].name if len(args) == 3 and isinstance(args[2], Name) else args[2:3]
        combiner = str(given[0] if isinstance(given, tuple) else given).lower() if len(args) == 3 else "mean"
        if combiner not in COMBINERS:
            raise _error(expr, f"EMBEDDING: combiner {combiner!r} is not one of {', '.join(COMBINERS)}")
        return Embedding(category, _int(args[1], "the dimension", expr), combiner)
    if function == "CROSS":
        args = _args(expr, 2, 2)
        if not isinstance(args[0], list) or len(args[0]) < 2:
            raise _error(expr, "CROSS: the first argument must be a list of at least two columns")
        parts: list[str | CategoryId | CategoryHash | Bucket] = []
        for part in args[0]:
            if isinstance(part, Name):
                parts.append(_column_name(part, expr, schema))
                continue
            column = from_expr(part, schema) if isinstance(part, Call) else None
            if not isinstance(column, (CategoryId, CategoryHash, Bucket)):
                raise _error(expr, "CROSS: its parts are columns, CATEGORY_ID, CATEGORY_HASH or BUCKET")
            parts.append(column)
        return Cross(tuple(parts), _int(args[1], "the bucket count", expr))
    raise _error(
        expr,
        f"unknown feature column {function} (NUMERIC, CATEGORY_ID, CATEGORY_HASH, BUCKET, EMBEDDING, CROSS)",
    )


# --- completing and deriving from the data -----------------------------------------------------------------


def _stats(values: Sequence[Any]) -> tuple[float, float]:
    numbers = [float(v) for v in values if v is not None]
    if not numbers:
        return 0.0, 1.0
    mean = sum(numbers) / len(numbers)
    std = math.sqrt(sum((v - mean) ** 2 for v in numbers) / len(numbers))
    return mean, std if std > 1e-12 else 1.0


def complete(
    column: FeatureColumn, schema: Mapping[str, str], sample: Mapping[str, Sequence[Any]]
) -> FeatureColumn:
    """``column`` with what the data gives: a text CATEGORY_ID's vocabulary (ConfigError if its column
    has more distinct values than buckets - 1: use CATEGORY_HASH), a NUMERIC's mean and deviation."""
    if isinstance(column, Numeric):
        if schema[column.key] not in NUMERIC_TYPES:
            return column  # comma-separated numbers: left raw
        mean, std = _stats(sample.get(column.key, []))
        return replace(column, mean=mean, std=std)
    if isinstance(column, CategoryId) and schema[column.key] == "string" and not column.vocabulary:
        vocabulary = sorted({str(v) for v in sample.get(column.key, []) if v is not None})
        if len(vocabulary) > column.buckets - 1:
            raise ConfigError(
                f"COLUMN: CATEGORY_ID({column.key}, {column.buckets}): the column has {len(vocabulary)} or "
                f"more distinct values, more than {column.buckets - 1}; raise the bucket count or use "
                "CATEGORY_HASH"
            )
        return replace(column, vocabulary=tuple(vocabulary))
    if isinstance(column, Bucket):
        return replace(column, source=Numeric(column.source.key))  # boundaries are in raw units
    if isinstance(column, Cross):
        parts = tuple(p if isinstance(p, str) else complete(p, schema, sample) for p in column.parts)
        return replace(column, parts=parts)  # type: ignore[arg-type]
    if isinstance(column, Embedding):
        category = complete(column.category, schema, sample)
        return replace(column, category=category)  # type: ignore[arg-type]
    return column


def embedding_dim(buckets: int) -> int:
    """A derived embedding's dimension: about the fourth root of the ids (TensorFlow's rule of thumb)."""
    return max(2, min(16, round(buckets**0.25 * 2)))


def derive(
    schema: Mapping[str, str], sample: Mapping[str, Sequence[Any]], exclude: Sequence[str] = ()
) -> tuple[FeatureColumn, ...]:
    """Feature columns for every column of ``schema`` but ``exclude`` (the label), from ``sample``."""
    columns: list[FeatureColumn] = []
    for name, dtype in schema.items():
        if name in exclude:
            continue
        if dtype in NUMERIC_TYPES:
            columns.append(complete(Numeric(name), schema, sample))
            continue
        distinct = {str(v) for v in sample.get(name, []) if v is not None}
        category: Categorical
        if len(distinct) <= VOCABULARY_LIMIT:
            category = CategoryId(name, len(distinct) + 1, tuple(sorted(distinct)))
        else:
            category = CategoryHash(name, HASH_BUCKETS)
        columns.append(Embedding(category, embedding_dim(category.num_buckets)))
    if not columns:
        raise ConfigError(f"COLUMN: the SELECT has no column to learn from besides {', '.join(exclude)}")
    return tuple(columns)


# --- JSON ---------------------------------------------------------------------------------------------------

_TYPES: dict[str, type] = {
    "numeric": Numeric,
    "category_id": CategoryId,
    "category_hash": CategoryHash,
    "bucket": Bucket,
    "cross": Cross,
    "embedding": Embedding,
}


def to_json(column: FeatureColumn | str) -> Any:
    """``column`` as JSON values (a cross's plain part stays a string)."""
    if isinstance(column, str):
        return column
    name = next(name for name, cls in _TYPES.items() if isinstance(column, cls))
    document: dict[str, Any] = {"type": name}
    for key, value in vars(column).items():
        if isinstance(value, tuple):
            document[key] = [to_json(v) if not isinstance(v, (int, float)) else v for v in value]
        elif isinstance(value, (Numeric, CategoryId, CategoryHash, Bucket, Cross)):
            document[key] = to_json(value)
        else:
            document[key] = value
    return document


def from_json(document: Any) -> Any:
    """The inverse of :func:`to_json`."""
    if isinstance(document, str):
        return document
    document = dict(document)
    cls = _TYPES[document.pop("type")]
    values: dict[str, Any] = {}
    for key, value in document.items():
        if isinstance(value, dict):
            values[key] = from_json(value)
        elif isinstance(value, list):
            values[key] = tuple(from_json(v) if isinstance(v, (dict, str)) else v for v in value)
            if key == "vocabulary":
                values[key] = tuple(str(v) for v in value)
        else:
            values[key] = value
    return cls(**values)


def columns_to_json(columns: FeatureColumns) -> dict[str, list[Any]]:
    return {group: [to_json(c) for c in cols] for group, cols in columns.groups.items()}


def columns_from_json(document: Mapping[str, Sequence[Any]]) -> FeatureColumns:
    return FeatureColumns({group: tuple(from_json(c) for c in cols) for group, cols in document.items()})


# --- TensorFlow: the feed's half ---------------------------------------------------------------------------


def _text(tensor: Any) -> Any:
    import tensorflow as tf

    return tensor if tensor.dtype == tf.string else tf.strings.as_string(tensor)


def _ids(column: Categorical, features: Mapping[str, Any]) -> Any:
    """int64 ids of a categorical column (the raw tensors' shape)."""
    import tensorflow as tf

    if isinstance(column, CategoryId):
        value = features[column.key]
        if column.vocabulary:
            table = tf.lookup.StaticHashTable(
                tf.lookup.KeyValueTensorInitializer(
                    tf.constant(column.vocabulary),
                    tf.range(1, len(column.vocabulary) + 1, dtype=tf.int64),
                ),
                default_value=0,
            )
            return table.lookup(_text(value))
        if value.dtype == tf.string:
            value = tf.strings.to_number(value, tf.int64)
        return tf.math.floormod(tf.cast(value, tf.int64), column.buckets)
    if isinstance(column, CategoryHash):
        return tf.strings.to_hash_bucket_fast(_text(features[column.key]), column.buckets)
    if isinstance(column, Bucket):
        value = tf.cast(features[column.source.key], tf.float32)
        bounds = tf.constant(column.boundaries, tf.float32)
        flat = tf.reshape(value, [-1])
        ids = tf.searchsorted(bounds, flat, side="right", out_type=tf.int64)
        return tf.reshape(ids, tf.shape(value))
    parts = [
        _text(features[part]) if isinstance(part, str) else tf.strings.as_string(_ids(part, features))
        for part in column.parts
    ]
    return tf.strings.to_hash_bucket_fast(tf.strings.join(parts, separator="\x1f"), column.buckets)


def transform(column: FeatureColumn, features: Mapping[str, Any]) -> Any:
    """The model input of ``column`` from the column tensors ``features``."""
    import tensorflow as tf

    if isinstance(column, Numeric):
        value = features[column.key]
        if value.dtype == tf.string:
            parts = tf.strings.split(value, ",")
            numbers = tf.strings.to_number(parts.to_tensor(default_value="0"), tf.float32)
            return (
                tf.ensure_shape(numbers, [*value.shape, column.shape]) if value.shape.rank == 0 else numbers
            )
        value = (tf.cast(value, tf.float32) - column.mean) / column.std
        return tf.expand_dims(value, -1)
    return _ids(column.category if isinstance(column, Embedding) else column, features)


def prepare(columns: FeatureColumns, features: Mapping[str, Any]) -> dict[str, Any]:
    """Every model input of ``columns`` from the column tensors ``features`` (``feed``'s half)."""
    return {columns.input_name(column): transform(column, features) for column in columns.all}


def build(
    exprs: Mapping[str, Sequence[Any]],
    schema: Mapping[str, str],
    sample: Mapping[str, Sequence[Any]],
    label: str = "",
) -> FeatureColumns:
    """The feature columns of a COLUMN clause (``exprs`` by group), completed from ``sample``; derived
    from the schema when ``exprs`` is empty (one group ``""``)."""
    if not exprs:
        return FeatureColumns({"": derive(schema, sample, [label] if label else [])})
    groups = {
        group: tuple(complete(from_expr(expr, schema), schema, sample) for expr in group_exprs)
        for group, group_exprs in exprs.items()
    }
    if label:
        for column in (c for cols in groups.values() for c in cols):
            if label in column.keys:
                raise ConfigError(f"COLUMN: the label {label!r} cannot be a feature column too")
    return FeatureColumns(groups)
