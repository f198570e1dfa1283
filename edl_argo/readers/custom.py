"""ElasticDL's custom data reader: a model file's own reader of its data, as a format (``custom``).

ElasticDL lets a model file define ``custom_data_reader(data_origin, records_per_task=None, **kwargs)``
(or a function ``--custom-data-reader`` names) returning a data reader in the shape of its
``AbstractDataReader``:

- ``create_shards()``: the shards, as a dict ``name -> (start_index, num_records)`` (newer ElasticDL) or a
  list of ``(name, start_index, num_records)`` (older);
- ``read_records(task)``: an iterator of the records of ``task``, whose ``shard.name``, ``shard.start``,
  ``shard.end`` (and older ElasticDL's ``shard_name``, ``start``, ``end``) give the range and ``type`` the
  task's kind (``"training"``, ``"evaluation"`` or ``"prediction"``);
- ``records_output_types``: ``tf.string``, the only kind this format takes: each record is one serialized
  string (bytes or str) that the model's ``feed`` parses, as a RecordIO or TFRecord record is.
- ``metadata`` is not used (``feed`` gets the metadata edl-argo gives every format).

The planning side (:meth:`CustomFormat.open`) loads the factory from the model definition, calls it with the
data URL as ``data_origin``, ``records_per_task`` (the job's minibatch size times minibatches per task,
when known) and the ``--data-options`` items as keyword arguments, and lists the shards. A shard's key is
its name; names that repeat (a list of ranges of one table) get ``#start`` appended, and the hint of a
range (:meth:`OpenedCustom.locate`) is its shard's name and start index. The reader spec carries what a
worker needs to load the same reader: the model definition (the pods' ``--model-def``), ``--model-zoo``
and the function's name. Shards have no version: the reader is trusted to read the same records twice.

A record that is not a string, a factory or reader that raises, or a ``records_output_types`` other than
``tf.string`` is one ConfigError line naming the function; a range that yields another count of records
than asked is a DataFormatError naming the shard.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from edl_argo.errors import ConfigError, DataFormatError, EdlError
from edl_argo.readers.base import (
    DataFormat,
    OpenedDataset,
    RangeReader,
    ReaderSpec,
    Records,
    ShardInfo,
    serialized_records,
)

#: Spec options this format sets itself; every other option is a keyword argument of the factory.
MODEL_DEF, MODEL_ZOO, READER, RECORDS_PER_TASK, TASK_TYPE, PARAMS = (
    "model_def",
    "model_zoo",
    "reader",
    "records_per_task",
    "task_type",
    "params",
)
#: ElasticDL's task kinds, as :attr:`CustomTask.type` gives them.
TASK_TYPES = ("training", "evaluation", "prediction")


@dataclass(frozen=True)
class CustomShard:
    """ElasticDL's ``task.shard``: the shard's name (as ``create_shards`` gave it) and the range's
    absolute record indices ``[start, end)``."""

    name: str
    start: int
    end: int


@dataclass(frozen=True)
class CustomTask:
    """The task a custom reader's ``read_records`` gets: ElasticDL's fields, both its newer
    (``shard.name``, ``shard.start``, ``shard.end``) and older (``shard_name``, ``start``, ``end``)."""

    shard: CustomShard
    type: str = "training"

    @property
    def shard_name(self) -> str:
        return self.shard.name

    @property
    def start(self) -> int:
        return self.shard.start

    @property
    def end(self) -> int:
        return self.shard.end


def custom_options(
    model_def: str,
    reader: str,
    *,
    model_zoo: str = "",
    params: dict[str, Any] | None = None,
    records_per_task: int = 0,
    task_type: str = "training",
) -> dict[str, Any]:
    """The options :meth:`CustomFormat.open` takes: where the reader factory is (the model definition as
    the pods load it, its zoo, the function's name), the factory's keyword arguments (``params``, the
    ``--data-options`` items), ``records_per_task`` (0: None) and the tasks' kind."""
    if task_type not in TASK_TYPES:
        raise ValueError(f"task type {task_type!r} is not one of {TASK_TYPES}")
    return {
        MODEL_DEF: model_def,
        MODEL_ZOO: model_zoo,
        READER: reader,
        PARAMS: dict(params or {}),
        RECORDS_PER_TASK: records_per_task,
        TASK_TYPE: task_type,
    }


def _what(options: dict[str, Any]) -> str:
    return f"custom data reader {options.get(READER)} of {options.get(MODEL_DEF)}"


def make_reader(url: str, options: dict[str, Any]) -> Any:
    """Load the factory ``options`` name and call it for ``url``; ConfigError naming it if that fails."""
    from edl_argo.model.loader import load_model_function

    if not options.get(MODEL_DEF) or not options.get(READER):
        raise ConfigError(
            f"{url}: --data-format custom reads data by a model's custom_data_reader; give --model-def (with "
            "a model file that defines it, or --custom-data-reader NAME)"
        )
    factory = load_model_function(str(options[MODEL_DEF]), str(options[READER]), str(options.get(MODEL_ZOO)))
    per_task = int(options.get(RECORDS_PER_TASK) or 0) or None
    try:
        reader = factory(url, per_task, **dict(options.get(PARAMS) or {}))
    except EdlError:
        raise
    except Exception as error:
        raise ConfigError(f"{_what(options)} raised {type(error).__name__}: {_line(error)}") from None
    for method in ("create_shards", "read_records"):
        if not callable(getattr(reader, method, None)):
            raise ConfigError(
                f"{_what(options)} returned {type(reader).__name__}, which has no {method}(); it must return "
                "an ElasticDL data reader (create_shards(), read_records(task), records_output_types)"
            )
    _check_output_types(reader, options)
    return reader


def _line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text[:300]


def _check_output_types(reader: Any, options: dict[str, Any]) -> None:
    """ConfigError unless the reader's ``records_output_types`` (if it has one) is ``tf.string``."""
    try:
        types = getattr(reader, "records_output_types", None)
    except Exception as error:
        raise ConfigError(f"{_what(options)}: records_output_types raised {_line(error)}") from None
    if types is None:
        return
    name = getattr(types, "name", types)
    if name not in ("string", "str", str, bytes):
        raise ConfigError(
            f"{_what(options)}: records_output_types is {types!r}; edl-argo reads serialized records only "
            "(tf.string: one bytes or str per record, parsed by feed)"
        )


def _shards(listed: Any, options: dict[str, Any]) -> list[tuple[str, int, int]]:
    """``(name, start, count)`` of each shard ``create_shards()`` gave, in either of ElasticDL's forms."""
    items = listed.items() if isinstance(listed, dict) else listed
    shards = []
    try:
        for item in items:
            if isinstance(listed, dict):
                name, (start, count) = item
            else:
                name, start, count = item
            shards.append((str(name), _index(start), _index(count)))
    except (TypeError, ValueError) as error:
        raise ConfigError(
            f"{_what(options)}: create_shards() must give {{name: (start_index, num_records)}} or a list of "
            f"(name, start_index, num_records): {_line(error)}"
        ) from None
    return shards


def _index(value: Any) -> int:
    if isinstance(value, bool) or int(value) != value or int(value) < 0:
        raise ValueError(f"{value!r} is not a record index or count")
    return int(value)


class CustomReader(RangeReader):
    """Reads ranges by the model's reader, made once per process from the spec (thread-safe)."""

    def __init__(self, spec: ReaderSpec, reader: Any = None) -> None:
        super().__init__(spec)
        self._lock = threading.Lock()
        self._reader = reader

    def reader(self) -> Any:
        with self._lock:
            if self._reader is None:
                self._reader = make_reader(self.spec.url, self.spec.options)
            return self._reader

    def read(self, shard: str, start: int, end: int, *, version: str = "", hint: str = "") -> Records:
        name, base = json.loads(hint) if hint else (shard, 0)
        task_type = str(self.spec.options.get(TASK_TYPE, "training"))
        task = CustomTask(CustomShard(str(name), base + start, base + end), task_type)
        what = _what(self.spec.options)
        records: list[bytes] = []
        try:
            for record in self.reader().read_records(task):
                if isinstance(record, str):
                    record = record.encode()
                elif not isinstance(record, bytes):
                    record = _bytes_of(record, what, name, base + start + len(records))
                records.append(record)
                if len(records) > end - start:
                    break
        except EdlError:
            raise
        except Exception as error:
            raise ConfigError(
                f"{what}: read_records of shard {name} records {base + start}-{base + end - 1} raised "
                f"{type(error).__name__}: {_line(error)}"
            ) from None
        if len(records) != end - start:
            raise DataFormatError(
                f"{what}: read_records of shard {name} records {base + start}-{base + end - 1} gave "
                f"{'more' if len(records) > end - start else len(records)} records, not {end - start}"
            )
        return serialized_records(records)


def _bytes_of(record: Any, what: str, shard: str, index: int) -> bytes:
    """A scalar string tensor or numpy bytes as bytes; ConfigError naming the record for anything else."""
    value = record.numpy() if hasattr(record, "numpy") else record
    if hasattr(value, "item") and getattr(value, "shape", None) == ():
        value = value.item()
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes):
        return value
    raise ConfigError(
        f"{what}: read_records gave a {type(record).__name__} for record {index} of shard {shard}; "
        "edl-argo reads serialized records only (bytes or str, as records_output_types tf.string)"
    )


class OpenedCustom(OpenedDataset):
    def __init__(
        self, spec: ReaderSpec, shards: Sequence[ShardInfo], where: dict[str, tuple[str, int]], reader: Any
    ) -> None:
        super().__init__(spec, shards, CustomReader(spec, reader))
        self._where = where

    def locate(self, shard: str, start: int, end: int) -> str:
        name, base = self._where[shard]
        return json.dumps([name, base], separators=(",", ":"))


class CustomFormat(DataFormat):
    """``custom``: the data is read by a model's ElasticDL data reader; ``options`` are
    :func:`custom_options`'s (see the module docstring). Never detected: a model's reader selects it."""

    name = "custom"
    options = None

    def open(self, url: str, options: dict[str, Any], what: str = "") -> OpenedDataset:
        known = {MODEL_DEF, MODEL_ZOO, READER, PARAMS, RECORDS_PER_TASK, TASK_TYPE}
        options = {
            **{k: v for k, v in options.items() if k in known},
            PARAMS: {
                **dict(options.get(PARAMS) or {}),
                **{k: v for k, v in options.items() if k not in known},
            },
        }
        reader = make_reader(url, options)
        try:
            listed = reader.create_shards()
        except Exception as error:
            raise ConfigError(
                f"{_what(options)}: create_shards() raised {type(error).__name__}: {_line(error)}"
            ) from None
        shards = [shard for shard in _shards(listed, options) if shard[2] > 0]
        names = [name for name, _, _ in shards]
        where: dict[str, tuple[str, int]] = {}
        infos = []
        for name, start, count in shards:
            key = name if names.count(name) == 1 else f"{name}#{start}"
            if key in where:
                raise ConfigError(f"{_what(options)}: create_shards() gives shard {key} twice")
            where[key] = (name, start)
            infos.append(ShardInfo(key, count))
        label = f"{what} {url}" if what else url
        if not infos:
            raise ConfigError(f"{label}: {_what(options)} lists no records (create_shards() gave none)")
        return OpenedCustom(ReaderSpec(self.name, url, options=options), infos, where, reader)

    def range_reader(self, spec: ReaderSpec) -> RangeReader:
        return CustomReader(spec)
