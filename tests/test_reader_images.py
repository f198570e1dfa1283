"""Image folders behind the reader contract (edl_argo/readers/images.py): class folders or a labels file,
shards of files, pinned file versions carried in the hint."""

from __future__ import annotations

import hashlib
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from edl_argo.errors import ConfigError
from edl_argo.readers import registry
from edl_argo.readers.base import OpenedDataset, ReaderSpec
from edl_argo.recordio.reader import ShardChangedError
from edl_argo.storage import open_storage


def png(width: int, height: int, shade: int) -> bytes:
    """A grey PNG, encoded by hand (signature, IHDR, one IDAT, IEND)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + bytes([shade % 256]) * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def _class_folders(root: Path, counts: dict[str, int]) -> dict[str, tuple[bytes, int]]:
    """Write ``counts[class]`` images per class folder; key -> (bytes, label), labels by sorted class."""
    written: dict[str, tuple[bytes, int]] = {}
    for label, name in enumerate(sorted(counts)):
        for i in range(counts[name]):
            key = f"{name}/img{i:03d}.png" if i % 4 else f"{name}/deeper/img{i:03d}.PNG"
            data = png(2 + i % 3, 1 + label, shade=i * 7 + label)
            (root / key).parent.mkdir(parents=True, exist_ok=True)
            (root / key).write_bytes(data)
            written[key] = (data, label)
    return written


def _read_all(opened: OpenedDataset, with_hint: bool = True) -> list[tuple[bytes, object]]:
    reader = registry.range_reader(ReaderSpec.from_json(opened.spec.to_json()))
    found: list[tuple[bytes, object]] = []
    for shard, count in opened.records.items():
        for start, end in [(0, count // 3), (count // 3, count - 1), (count - 1, count)]:
            hint = opened.locate(shard, start, end) if with_hint else ""
            images, labels = reader.read(shard, start, end, version=opened.versions[shard], hint=hint)
            assert images.dtype == object and len(images) == len(labels) == end - start
            assert labels.dtype == opened.schema.columns[1].numpy_dtype
            found.extend(zip(images.tolist(), labels.tolist(), strict=True))
    return found


def mixed(keys: object) -> list[str]:
    """``keys`` in the reader's record order: by the SHA-256 of each key."""
    return sorted(keys, key=lambda key: hashlib.sha256(key.encode()).digest())  # type: ignore[arg-type]


def test_class_folders_are_labelled_by_sorted_class_and_read_in_a_mixed_fixed_order(tmp_path: Path) -> None:
    written = _class_folders(tmp_path, {"zebra": 9, "ant": 7, "moth": 11})
    (tmp_path / "loose.png").write_bytes(png(1, 1, 0))  # not in a class folder: left out
    assert registry.detect_format(str(tmp_path)) == "images"
    opened = registry.open_data(str(tmp_path), "", {"files_per_shard": "10"})
    assert opened.spec.options["classes"] == ["ant", "moth", "zebra"]
    assert [(c.name, c.dtype) for c in opened.schema.columns] == [("image", "string"), ("label", "int64")]
    assert list(opened.records.values()) == [10, 10, 7]
    expected = [written[key] for key in mixed(written)]
    assert _read_all(opened) == expected
    assert _read_all(opened, with_hint=False) == expected  # lists again, checks the pinned digest
    assert mixed(written)[0] in opened.describe("part-00000")


def test_consecutive_records_hold_every_class(tmp_path: Path) -> None:
    """Tasks are runs of consecutive records: in folder order each would hold one class, and a model
    trained task by task would not learn (the digits pipeline reached accuracy 0.09 so)."""
    _class_folders(tmp_path, dict.fromkeys("abcd", 60))
    opened = registry.open_data(str(tmp_path), "", {"files_per_shard": "240"})
    labels = [label for _, label in _read_all(opened)]
    assert sorted(labels) == sorted([0, 1, 2, 3] * 60)
    assert all(len(set(labels[start : start + 32])) == 4 for start in range(0, 240, 32))


def test_a_labels_file_names_the_images_and_their_labels(tmp_path: Path) -> None:
    for i in range(6):
        (tmp_path / f"p{i}.jpg").write_bytes(f"jpeg{i}".encode())
    (tmp_path / "p9.jpg").write_bytes(b"unlabelled")
    (tmp_path / "labels.csv").write_text("file,label\np3.jpg,cat\np0.jpg,dog\np1.jpg,cat\n\n")
    opened = registry.open_data(str(tmp_path), "images", {"labels": "labels.csv"})
    assert opened.schema.dtypes == ("string", "string") and "classes" not in opened.spec.options
    labelled = {"p0.jpg": (b"jpeg0", "dog"), "p1.jpg": (b"jpeg1", "cat"), "p3.jpg": (b"jpeg3", "cat")}
    assert _read_all(opened) == [labelled[key] for key in mixed(labelled)]
    (tmp_path / "labels.csv").write_text("file,label\np3.jpg,3\np0.jpg,-1\n")
    numbered = registry.open_data(str(tmp_path), "images", {"labels": "labels.csv"})
    assert numbered.schema.dtypes == ("string", "int64")
    assert _read_all(numbered) == [
        {"p0.jpg": (b"jpeg0", -1), "p3.jpg": (b"jpeg3", 3)}[k] for k in mixed(["p0.jpg", "p3.jpg"])
    ]
    (tmp_path / "labels.csv").write_text("file,label\np3.jpg,3\nnope.jpg,1\n")
    with pytest.raises(
        ConfigError, match=rf"^labels file {tmp_path}/labels\.csv line 3: no image {tmp_path}/nope\.jpg"
    ):
        registry.open_data(str(tmp_path), "images", {"labels": "labels.csv"})
    with pytest.raises(ConfigError, match=r"no labels file .*missing\.csv"):
        registry.open_data(str(tmp_path), "images", {"labels": "missing.csv"})


def test_a_file_replaced_after_open_is_a_changed_shard(tmp_path: Path) -> None:
    written = _class_folders(tmp_path, {"a": 3, "b": 3})
    opened = registry.open_data(str(tmp_path), "images")
    reader = registry.range_reader(ReaderSpec.from_json(opened.spec.to_json()))
    replaced = mixed(written)[4]
    (tmp_path / replaced).write_bytes(png(5, 5, 1))  # record 4
    shard, version = "part-00000", opened.versions["part-00000"]
    assert len(reader.read(shard, 0, 3, version=version, hint=opened.locate(shard, 0, 3))[1]) == 3
    with pytest.raises(
        ShardChangedError, match=rf"{re.escape(replaced)} changed while this job was reading it"
    ):
        reader.read(shard, 3, 6, version=version, hint=opened.locate(shard, 3, 6))
    with pytest.raises(ShardChangedError):
        reader.read(shard, 0, 1, version=version)  # no hint: the listing no longer matches the pin


def test_detection_wants_images_in_folders_only(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x.bmp").write_bytes(b"BM")
    assert registry.detect_format(str(tmp_path)) == "images"
    (tmp_path / "notes.csv").write_text("a\n1\n")
    assert registry.detect_format(str(tmp_path)) == "csv"
    with pytest.raises(ConfigError, match="files_per_shard"):
        registry.open_data(str(tmp_path), "images", {"files_per_shard": "0"})


def test_an_s3_image_folder(s3_env: str) -> None:
    storage = open_storage(s3_env)
    written = {f"{c}/{i}.png": (png(3, 3, i), label) for label, c in enumerate("xy") for i in range(5)}
    for key, (data, _) in written.items():
        storage.write(f"imgs/{key}", data)
    opened = registry.open_data(s3_env + "/imgs", "", {"files_per_shard": "4"})
    assert opened.format == "images" and np.sum(list(opened.records.values())) == 10
    assert _read_all(opened) == [written[key] for key in mixed(written)]
