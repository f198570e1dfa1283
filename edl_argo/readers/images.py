"""Image folders: every image file under the dataset URL is one record, ``image`` (the file's bytes, still
encoded: ``feed`` decodes them, e.g. with ``tf.io.decode_image``) and ``label``.

Two layouts:

* **Class folders** (the default): ``URL/<class>/<file>.png``; files deeper down belong to their top
  folder's class, files directly under the URL are left out. A label is the index of its class in the
  sorted class names (as Keras' ``image_dataset_from_directory`` numbers them); the spec's
  ``options["classes"]`` is that list, so predictions can be mapped back to names.
* **A labels file**: ``--data-options labels=labels.csv`` names a CSV file (its key relative to the URL)
  with the header ``file,label``: each row names an image (its key relative to the URL) and its label.
  Labels are int64 when every one is an integer, else strings. Only the images it names are records.

Records are in an order mixed by a hash of their file keys (:func:`mixed_order`): the same files always give
the same order, and consecutive records (a task) hold images of every class, not one class folder after
another, which no shuffle of tasks would undo. Shards are groups of ``files_per_shard`` (option,
default :data:`FILES_PER_SHARD`) consecutive records, keyed ``part-00000``, ``part-00001``, ...; a shard's
version is a digest of its files' keys, versions and labels. Every file's version is pinned when the
dataset is opened, and a task's hint (:meth:`OpenedImages.locate`) is the JSON list of
``[key, version, label]`` of its records, so a worker reads exactly those files (one storage read each,
:data:`READ_THREADS` at a time) without listing. A read without a hint lists the folder again (the only
way to learn which files a range holds) and refuses a shard whose files differ from those pinned.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from edl_argo.errors import ConfigError, DataFormatError
from edl_argo.readers.base import (
    Column,
    DataFormat,
    OpenedDataset,
    RangeReader,
    ReaderSpec,
    Records,
    RecordSchema,
    ShardInfo,
)
from edl_argo.readers.files import PinnedFiles, list_data_files
from edl_argo.readers.text_values import fits_int64
from edl_argo.recordio.reader import ShardChangedError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp")
#: Records (files) per shard unless ``--data-options files_per_shard=N`` says otherwise.
FILES_PER_SHARD = 1000
#: Files a worker reads at once.
READ_THREADS = 8

#: One record before it is read: the file's key, its pinned version and its label.
Entry = tuple[str, str, int | str]


def _is_image(key: str) -> bool:
    return key.lower().endswith(IMAGE_EXTENSIONS)


def _in_class_folder(key: str) -> bool:
    return "/" in key and _is_image(key)


def _shard_key(number: int) -> str:
    return f"part-{number:05d}"


def _digest(entries: Sequence[Entry]) -> str:
    text = "".join(f"{key}\0{version}\0{label}\n" for key, version, label in entries)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class ImagePlan:
    """An image folder listed: its records in order, the label type and the class names (class
    folders only)."""

    folder_url: str
    entries: tuple[Entry, ...]
    label_dtype: str
    classes: tuple[str, ...]
    files_per_shard: int

    def shard(self, key: str) -> tuple[Entry, ...]:
        """The records of shard ``key`` (``part-NNNNN``); empty for a key that is not one of them."""
        try:
            number = int(key.removeprefix("part-"))
        except ValueError:
            return ()
        return self.entries[number * self.files_per_shard : (number + 1) * self.files_per_shard]


def _files_per_shard(value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise ConfigError(f"--data-options files_per_shard={value!r}: a positive number of files")
    return number


def plan_images(url: str, options: dict[str, Any], what: str = "") -> ImagePlan:
    """List the images at ``url`` and label them by the layout ``options`` say (see the module's
    docstring); ConfigError naming the URL (or the labels file and its line) for what is missing."""
    per_shard = _files_per_shard(options.get("files_per_shard", FILES_PER_SHARD))
    labels_key = str(options.get("labels") or "")
    if not labels_key:
        listing = list_data_files(url, _in_class_folder, what, "images")
        classes = tuple(sorted({info.key.split("/", 1)[0] for info in listing.files}))
        number = {name: i for i, name in enumerate(classes)}
        entries = tuple((i.key, i.version, number[i.key.split("/", 1)[0]]) for i in listing.files)
        return ImagePlan(listing.folder_url, mixed_order(entries), "int64", classes, per_shard)
    listing = list_data_files(url, _is_image, what, "images")
    found = {info.key: info for info in listing.files}
    files = PinnedFiles(listing.folder_url)
    describe = files.describe(labels_key)
    try:
        text = files.read(labels_key).decode("utf-8-sig")
    except ShardChangedError:
        raise ConfigError(f"--data-options labels={labels_key}: no labels file {describe}") from None
    except UnicodeDecodeError as error:
        raise DataFormatError(f"labels file {describe}: not UTF-8 ({error.reason})") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, [])
    if [name.strip() for name in header] != ["file", "label"]:
        raise DataFormatError(f"labels file {describe} line 1: the header must be file,label, not {header!r}")
    rows: dict[str, str] = {}
    line = 2
    for row in reader:
        if row:
            if len(row) != 2:
                raise DataFormatError(
                    f"labels file {describe} line {line}: {len(row)} fields, not 2 (file,label)"
                )
            key = row[0].strip()
            if key not in found:
                raise ConfigError(
                    f"labels file {describe} line {line}: no image {files.describe(key)} "
                    f"(keys are relative to {listing.folder_url})"
                )
            rows[key] = row[1].strip()
        line = 1 + reader.line_num
    if not rows:
        raise DataFormatError(f"labels file {describe} names no image")
    numeric = all(fits_int64(label) for label in rows.values())
    entries = tuple(
        (key, found[key].version, int(label) if numeric else label) for key, label in rows.items()
    )
    return ImagePlan(
        listing.folder_url, mixed_order(entries), "int64" if numeric else "string", (), per_shard
    )


def mixed_order(entries: Sequence[tuple[str, str, Any]]) -> tuple[tuple[str, str, Any], ...]:
    """``entries`` (``(key, version, label)``) ordered by the SHA-256 of their keys: a fixed order that
    does not follow the folders."""
    return tuple(sorted(entries, key=lambda entry: hashlib.sha256(entry[0].encode()).digest()))


class ImageReader(RangeReader):
    """A worker's reader of image records: one pinned storage read per file, several at once."""

    def __init__(self, spec: ReaderSpec, plan: ImagePlan | None = None) -> None:
        super().__init__(spec)
        self.files = PinnedFiles(spec.url)
        self._plan = plan

    def entries(self, shard: str, start: int, end: int, version: str) -> list[Entry]:
        """Records ``[start, end)`` of ``shard`` without a hint: from the folder listed again."""
        if self._plan is None:
            self._plan = plan_images(self.spec.url, self.spec.options)
        entries = self._plan.shard(shard)
        if version and _digest(entries) != version:
            raise ShardChangedError(
                f"{self.spec.url} ({shard})", version, _digest(entries) if entries else ""
            )
        return list(entries[start:end])

    def read(self, shard: str, start: int, end: int, *, version: str = "", hint: str = "") -> Records:
        entries = [tuple(e) for e in json.loads(hint)] if hint else self.entries(shard, start, end, version)
        if len(entries) != end - start:
            raise DataFormatError(
                f"{self.spec.url} ({shard}): records [{start}, {end}) asked for, the hint names "
                f"{len(entries)}"
            )
        with ThreadPoolExecutor(max_workers=max(1, min(READ_THREADS, len(entries)))) as pool:
            data = list(pool.map(lambda entry: self.files.read(entry[0], version=entry[1]), entries))
        images = np.empty(len(entries), dtype=object)
        images[:] = data
        label_type = self.spec.schema.columns[1].numpy_dtype
        labels = np.empty(len(entries), dtype=label_type)
        labels[:] = [entry[2] for entry in entries]
        return images, labels


class OpenedImages(OpenedDataset):
    def __init__(self, spec: ReaderSpec, plan: ImagePlan) -> None:
        count = -(-len(plan.entries) // plan.files_per_shard)
        shards = [
            ShardInfo(key, len(plan.shard(key)), _digest(plan.shard(key)))
            for key in map(_shard_key, range(count))
        ]
        super().__init__(spec, shards, ImageReader(spec, plan))
        self.plan = plan

    def describe(self, shard: str = "") -> str:
        entries = self.plan.shard(shard) if shard else ()
        if not entries:
            return self.spec.url
        return f"{self.spec.url} ({shard}: {entries[0][0]} to {entries[-1][0]})"

    def locate(self, shard: str, start: int, end: int) -> str:
        return json.dumps([list(entry) for entry in self.plan.shard(shard)[start:end]], separators=(",", ":"))


class ImageFolderFormat(DataFormat):
    name = "images"
    options = ("labels", "files_per_shard")

    def open(self, url: str, options: dict[str, Any], what: str = "") -> OpenedDataset:
        plan = plan_images(url, options, what)
        spec_options: dict[str, Any] = {"files_per_shard": plan.files_per_shard}
        if plan.classes:
            spec_options["classes"] = list(plan.classes)
        if options.get("labels"):
            spec_options["labels"] = str(options["labels"])
        schema = RecordSchema((Column("image", "string"), Column("label", plan.label_dtype)))
        return OpenedImages(ReaderSpec(self.name, plan.folder_url, schema, spec_options), plan)

    def range_reader(self, spec: ReaderSpec) -> RangeReader:
        return ImageReader(spec)

    def detect(self, url: str, names: Sequence[str]) -> bool:
        return bool(names) and all(_is_image(name) for name in names) and any("/" in name for name in names)
