"""``edl-argo data``: write the bundled digits dataset (RecordIO, or files of another format), generate the
CTR dataset or a census table (in a database), convert a CSV file, inspect and seal datasets."""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from edl_argo.data.csv_table import csv_examples, scan_csv
from edl_argo.data.examples import encode_example
from edl_argo.data.file_writers import DIGITS_FORMATS, write_records_as
from edl_argo.data.formats import inspect_data, refuse_sealed, seal_files
from edl_argo.errors import ConfigError, DataFormatError
from edl_argo.flags import positive_int
from edl_argo.log import get_logger
from edl_argo.readers import detect_format, open_data, parse_data_options
from edl_argo.recordio import (
    MANIFEST_NAME,
    Compressor,
    Dataset,
    DatasetWriter,
    ShardReader,
    ShardSummary,
    list_shards,
    open_dataset,
    seal_dataset,
)
from edl_argo.settings import add_data_settings
from edl_argo.storage import Storage, join_url, open_storage

log = get_logger(__name__)

_COMPRESSORS = {c.name.lower(): c for c in Compressor}


def register(subparsers: argparse._SubParsersAction) -> None:
    data = subparsers.add_parser("data", help="prepare RecordIO datasets; inspect and seal datasets")
    commands = data.add_subparsers(dest="data_command", metavar="DATA_COMMAND", required=True)

    digits = commands.add_parser(
        "digits", help="write scikit-learn's bundled handwritten digits as train/test shards"
    )
    _add_output_flags(digits)
    digits.add_argument("--test-fraction", type=float, default=0.2, help="share of records in test/")
    digits.add_argument("--seed", type=int, default=0, help="seed of the train/test split")
    digits.add_argument(
        "--format",
        choices=DIGITS_FORMATS,
        default="recordio",
        help="recordio (sealed shards, the default); tfrecord, csv or parquet (--shards files per split); "
        "images (a PNG per record in class folders)",
    )
    digits.set_defaults(run=run_digits)

    census = commands.add_parser(
        "census", help="write a generated census table (the SQLFlow example's) into a database"
    )
    census.add_argument(
        "--db", required=True, metavar="URL", help="SQLAlchemy URL (password: EDL_DB_PASSWORD)"
    )
    census.add_argument("--table", required=True, help="the table to create")
    census.add_argument("--rows", type=positive_int, default=2000, help="rows to generate (default 2000)")
    census.add_argument("--seed", type=int, default=11, help="random seed (default 11)")
    census.add_argument("--overwrite", action="store_true", help="replace the table if it exists")
    census.set_defaults(run=run_census)

    ctr = commands.add_parser("ctr", help="generate a synthetic click-through dataset (26 categorical ids)")
    _add_output_flags(ctr)
    ctr.add_argument("--records", type=positive_int, default=20_000, help="training records (test: a fifth)")
    ctr.add_argument("--vocabulary", type=positive_int, default=100_000, help="ids per feature")
    ctr.add_argument("--seed", type=int, default=0)
    ctr.set_defaults(run=run_ctr)

    convert = commands.add_parser("convert", help="convert a CSV file (with a header row) to shards")
    convert.add_argument("--from", dest="source", required=True, metavar="CSV_FILE", help="CSV file to read")
    convert.add_argument("--label-column", required=True, help="name of the label column")
    convert.add_argument(
        "--fill-missing",
        metavar="VALUE",
        default="",
        help="stands for every empty value (default, or empty: an empty value is an error naming its line "
        "and column)",
    )
    _add_output_flags(convert)
    convert.set_defaults(run=run_convert)

    inspect = commands.add_parser(
        "inspect",
        help="list a dataset's shards (any format), its records and schema, and verify every record "
        "(RecordIO: every chunk and the manifest's checksums; without a manifest, say the folder is not "
        "sealed)",
    )
    inspect.add_argument("url", help="dataset folder, s3://bucket/prefix, one file, or a database URL")
    add_data_settings(inspect)
    inspect.set_defaults(run=run_inspect)

    seal = commands.add_parser(
        "seal",
        help="write the manifest of a folder of RecordIO shards made elsewhere, or of TFRecord, CSV or "
        "Parquet files, after reading and checksumming them; jobs then read exactly those files",
    )
    seal.add_argument("url", help="folder or s3://bucket/prefix holding the dataset's files")
    add_data_settings(seal)
    seal.set_defaults(run=run_seal)


def _add_output_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", required=True, metavar="URL", help="folder or s3://bucket/prefix")
    parser.add_argument("--shards", type=positive_int, default=4, help="shards per split (default 4)")
    parser.add_argument(
        "--compressor", choices=sorted(_COMPRESSORS), default="snappy", help="chunk compressor"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a dataset already at --output")


def write_dataset(
    storage: Storage,
    prefix: str,
    records: Sequence[bytes],
    num_shards: int,
    compressor: Compressor,
    overwrite: bool,
) -> list[str]:
    """Write ``records`` as the dataset at ``prefix``: ``num_shards`` contiguous shards, then the manifest
    (see :mod:`edl_argo.recordio.dataset`); returns the shards' storage keys.

    Refuses to replace an existing dataset unless ``overwrite``; replaces it as a whole, and touches
    nothing else. A failed run leaves the previous dataset (or none) and no shard of its own.
    """
    num_shards = max(1, min(num_shards, len(records)))
    bounds = np.linspace(0, len(records), num_shards + 1).astype(int)
    with DatasetWriter(storage, prefix, overwrite=overwrite, compressor=compressor) as writer:
        for start, end in itertools.pairwise(bounds):
            writer.write_shard(records[start:end])
        manifest = writer.commit()
    return [join_url(writer.prefix, shard.key) for shard in manifest.shards]


def digits_records(test_fraction: float, seed: int) -> tuple[list[bytes], list[bytes]]:
    """scikit-learn's 1,797 8×8 digits as (train, test) ``tf.train.Example`` records.

    Features: ``image`` (64 floats, 0–16) and ``label`` (int64, 0–9).
    """
    from sklearn.datasets import load_digits

    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"--test-fraction must be between 0 and 1, got {test_fraction}")
    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    records = [
        encode_example({"image": digits.data[i].astype(np.float32), "label": int(digits.target[i])})
        for i in order
    ]
    num_test = math.ceil(len(records) * test_fraction)
    return records[num_test:], records[:num_test]


def run_digits(args: argparse.Namespace) -> int:
    storage = open_storage(args.output)
    train, test = digits_records(args.test_fraction, args.seed)
    compressor = _COMPRESSORS[args.compressor]
    for split, records in (("train", train), ("test", test)):
        if args.format == "recordio":
            write_dataset(storage, split, records, args.shards, compressor, args.overwrite)
        else:
            write_records_as(args.format, storage, split, records, args.shards, args.overwrite)
    where = f"to {storage.describe()}" + ("" if args.format == "recordio" else f" as {args.format}")
    print(f"wrote {len(train)} train and {len(test)} test records {where}")
    return 0


def run_census(args: argparse.Namespace) -> int:
    from edl_argo.data.census import write_census

    rows = write_census(args.db, args.table, args.rows, args.seed, args.overwrite)
    print(f"wrote {rows} census rows into table {args.table}")
    return 0


def ctr_records(count: int, vocabulary: int, seed: int) -> list[bytes]:
    """Synthetic clicks: 26 Zipf-distributed categorical ids per record; the label follows a hidden
    per-id score, so a model that learns the ids' embeddings can predict it."""
    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(1.2, size=(count, 26)) - 1, vocabulary - 1).astype(np.int64)
    ids = (ids * 7919 + np.arange(26) * 104_729) % vocabulary
    hidden = np.random.default_rng(1234).normal(0.0, 1.0, size=(26, vocabulary))
    score = hidden[np.arange(26), ids].sum(axis=1) / np.sqrt(26) + rng.normal(0.0, 0.3, size=count)
    labels = (score > 0).astype(np.int64)
    return [encode_example({"ids": row, "label": int(label)}) for row, label in zip(ids, labels, strict=True)]


def run_ctr(args: argparse.Namespace) -> int:
    storage = open_storage(args.output)
    compressor = _COMPRESSORS[args.compressor]
    train = ctr_records(args.records, args.vocabulary, args.seed)
    test = ctr_records(max(1, args.records // 5), args.vocabulary, args.seed + 1)
    for split, records in (("train", train), ("test", test)):
        write_dataset(storage, split, records, args.shards, compressor, args.overwrite)
    print(f"wrote {len(train)} train and {len(test)} test records to {storage.describe()}")
    return 0


def run_convert(args: argparse.Namespace) -> int:
    schema = scan_csv(Path(args.source), args.label_column, args.fill_missing or None)
    storage = open_storage(args.output)
    num_shards = min(args.shards, schema.rows)
    bounds = np.linspace(0, schema.rows, num_shards + 1).astype(int)
    examples = csv_examples(schema)
    with DatasetWriter(
        storage, "", overwrite=args.overwrite, compressor=_COMPRESSORS[args.compressor]
    ) as writer:
        for start, end in itertools.pairwise(bounds):
            writer.write_shard(itertools.islice(examples, int(end - start)))
        if next(examples, None) is not None:  # also runs the file's last check
            raise DataFormatError(f"CSV file {args.source}: the file changed while it was converted")
        writer.commit()
    where = f"from {args.source} to {storage.describe()}"
    print(f"wrote {schema.rows} records {where} (columns: {schema.describe()})")
    return 0


def _format_of(args: argparse.Namespace) -> str:
    """The dataset's format: ``--data-format``, else detected (a manifest's, else from the file names)."""
    return str(getattr(args, "data_format", "") or detect_format(args.url))


def run_inspect(args: argparse.Namespace) -> int:
    """Inspect the dataset at ``args.url``: RecordIO as :func:`run_recordio_inspect` does, any other format
    by :func:`edl_argo.data.formats.inspect_data`."""
    fmt = _format_of(args)
    if fmt == "recordio":
        return run_recordio_inspect(args)
    options = parse_data_options(getattr(args, "data_options", ""))
    inspect_data(open_data(args.url, fmt, options), args.url)
    return 0


def run_recordio_inspect(args: argparse.Namespace) -> int:
    """List and verify every shard of the dataset at ``args.url``: the shards its manifest names, each
    checked against the manifest's records, size and SHA-256; or, in a folder of RecordIO shards without a
    manifest (made elsewhere), every shard there, then a last line saying that the folder is not sealed and
    how to seal it (exit 0: inspecting is how a user looks at shards before sealing them). A corrupt shard,
    a shard that does not match the manifest, or a folder with neither manifest nor shards is a
    DataFormatError naming it."""
    storage = open_storage(args.url)
    sealed = storage.exists(MANIFEST_NAME) or not list_shards(storage)
    shards = _manifest_shards(open_dataset(storage)) if sealed else _unsealed_shards(storage)
    print(f"{'shard':<48} {'records':>9} {'chunks':>7} {'bytes':>12}  compressor")
    count, totals = 0, [0, 0, 0]
    for name, summary in shards:
        compressors = ",".join(sorted(summary.compressors))
        print(f"{name:<48} {summary.records:>9} {summary.chunks:>7} {summary.bytes:>12}  {compressors}")
        count += 1
        totals = [totals[0] + summary.records, totals[1] + summary.chunks, totals[2] + summary.bytes]
    label = f"total ({count} shards)"
    print(f"{label:<48} {totals[0]:>9} {totals[1]:>7} {totals[2]:>12}  ok")
    if not sealed:
        url = storage.describe()
        print(
            f"not sealed: {url} has no manifest {MANIFEST_NAME}, so jobs, evaluate and predict refuse it;"
            f" `edl-argo data seal {url}` checksums the shards and writes it"
        )
    return 0


def _manifest_shards(dataset: Dataset) -> Iterator[tuple[str, ShardSummary]]:
    """``(manifest key, summary)`` of each shard the dataset's manifest names, verified against it."""
    for shard in dataset.manifest.shards:
        key = dataset.key(shard)
        summary = ShardReader(dataset.storage, key, version=dataset.versions[key]).verify()
        found = (summary.records, summary.bytes, summary.sha256)
        if found != (shard.records, shard.bytes, shard.sha256):
            raise DataFormatError(
                f"shard {dataset.storage.describe(key)} does not match the dataset's manifest: it holds "
                f"{summary.records} records, {summary.bytes} bytes, sha256 {summary.sha256}; the manifest "
                f"says {shard.records}, {shard.bytes}, {shard.sha256}"
            )
        yield shard.key, summary


def _unsealed_shards(storage: Storage) -> Iterator[tuple[str, ShardSummary]]:
    """``(key, summary)`` of each shard of a folder without a manifest (those `data seal` would seal)."""
    for key in list_shards(storage):
        yield key, ShardReader(storage, key).verify()


def run_seal(args: argparse.Namespace) -> int:
    """Seal the folder at ``args.url``: RecordIO shards by :func:`~edl_argo.recordio.seal_dataset`, files
    of another format by :func:`edl_argo.data.formats.seal_files`. A folder with a manifest is refused."""
    storage = open_storage(args.url)
    fmt = _format_of(args)
    if fmt == "recordio":  # refuses a folder with a manifest itself
        manifest = seal_dataset(storage)
        print(f"sealed {len(manifest.shards)} shards ({manifest.records} records) at {storage.describe()}")
        return 0
    refuse_sealed(storage)
    options = parse_data_options(getattr(args, "data_options", ""))
    manifest = seal_files(open_data(args.url, fmt, options), args.url)
    print(f"sealed {len(manifest.shards)} {fmt} files ({manifest.records} records) at {storage.describe()}")
    return 0
