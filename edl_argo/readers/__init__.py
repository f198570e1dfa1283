"""Data readers: every format a job reads, behind one contract (:mod:`edl_argo.readers.base`)."""

from edl_argo.readers.base import (
    SERIALIZED,
    Column,
    DataFormat,
    OpenedDataset,
    RangeReader,
    ReaderSpec,
    Records,
    RecordSchema,
    ShardInfo,
    num_records,
    serialized_records,
    slice_records,
)
from edl_argo.readers.registry import (
    FORMATS,
    detect_format,
    open_data,
    parse_data_options,
    range_reader,
    spec_from_json,
    worker_spec_json,
)

__all__ = [
    "FORMATS",
    "SERIALIZED",
    "Column",
    "DataFormat",
    "OpenedDataset",
    "RangeReader",
    "ReaderSpec",
    "RecordSchema",
    "Records",
    "ShardInfo",
    "detect_format",
    "num_records",
    "open_data",
    "parse_data_options",
    "range_reader",
    "serialized_records",
    "slice_records",
    "spec_from_json",
    "worker_spec_json",
]
