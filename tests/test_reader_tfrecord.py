"""TFRecord files behind the reader contract (edl_argo/readers/tfrecord.py): files written by TensorFlow's
own writer (plain and GZIP) are indexed by the master and read by range from the spec's JSON and a hint;
damaged and replaced files are named."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from edl_argo.errors import DataFormatError
from edl_argo.readers import registry, tfrecord
from edl_argo.readers.base import ReaderSpec
from edl_argo.readers.files import INDEX_STRIDE
from edl_argo.recordio.reader import ShardChangedError

CUTS = [
    (0, 1),
    (0, 64),
    (1, 65),
    (63, 64),
    (64, 128),
    (100, 101),
    (130, 200),
    (199, 200),
    (0, 200),
    (200, 200),
]


def records(count: int, tag: str) -> list[bytes]:
    return [f"{tag}-{i}-".encode() * (1 + i % 7) for i in range(count)]


def write_tf(path: Path, values: list[bytes], compression: str = "") -> None:
    import tensorflow as tf

    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path), options=compression or None) as writer:
        for value in values:
            writer.write(value)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[bytes]]]:
    root = tmp_path_factory.mktemp("tfrecord")
    files = {
        "a.tfrecord": records(200, "a"),
        "b/c.tfrecords": records(70, "c"),
        "d.tfrecord.gz": records(200, "d"),
    }
    for name, values in files.items():
        write_tf(root / name, values, "GZIP" if name.endswith(".gz") else "")
    return root, files


def test_every_range_read_from_the_spec_and_hint_is_what_tensorflow_wrote(dataset) -> None:
    root, files = dataset
    assert registry.detect_format(str(root)) == "tfrecord"
    opened = registry.open_data(str(root))
    assert opened.records == {name: len(values) for name, values in sorted(files.items())}
    reader = registry.range_reader(ReaderSpec.from_json(opened.spec.to_json()))
    for name, values in files.items():
        for start, end in CUTS:
            end, start = min(end, len(values)), min(start, len(values))
            hint = opened.locate(name, start, end)
            assert bool(hint) != name.endswith(".gz")  # GZIP files are read from their start
            version = opened.versions[name]
            assert list(reader.read(name, start, end, version=version, hint=hint)[0]) == values[start:end]
            assert list(reader.read(name, start, end, version=version)[0]) == values[start:end]  # no hint


def test_the_index_keeps_every_64th_offset_and_a_range_reads_only_its_blocks(dataset) -> None:
    root, _ = dataset
    opened = registry.open_data(str(root))
    index = opened._indexes["a.tfrecord"]
    assert len(index.offsets) == -(-200 // INDEX_STRIDE)
    hint = tfrecord.RangeHint.from_str(opened.locate("a.tfrecord", 70, 80))
    assert hint.skip == 70 - 64 and hint.offset == index.offsets[1] and hint.end_offset == index.offsets[2]


def test_a_damaged_record_names_the_file_and_its_offset(tmp_path: Path) -> None:
    path = tmp_path / "data" / "x.tfrecord"
    write_tf(path, records(10, "x"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(DataFormatError, match=r"TFRecord file .*x\.tfrecord, record at byte \d+: .*checksum"):
        registry.open_data(str(tmp_path / "data"))


def test_a_truncated_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "data" / "x.tfrecord"
    write_tf(path, records(10, "x"))
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(DataFormatError, match=r"x\.tfrecord.*ends inside a record"):
        registry.open_data(str(tmp_path / "data"))
    gz = tmp_path / "gz" / "y.tfrecord.gz"
    write_tf(gz, records(500, "y"), "GZIP")
    gz.write_bytes(gz.read_bytes()[:-30])
    with pytest.raises(DataFormatError, match=r"y\.tfrecord\.gz"):
        registry.open_data(str(tmp_path / "gz"))


def test_a_file_replaced_after_opening_fails_the_read_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "data" / "x.tfrecord"
    write_tf(path, records(100, "x"))
    opened = registry.open_data(str(tmp_path / "data"))
    write_tf(path, records(100, "z"))
    with pytest.raises(ShardChangedError, match=r"x\.tfrecord"):
        opened.read("x.tfrecord", 0, 10)


def test_one_file_url_and_gzip_of_python_gzip(tmp_path: Path) -> None:
    values = records(90, "q")
    (tmp_path / "q.tfrecord.gz").write_bytes(gzip.compress(b"".join(tfrecord.frame(v) for v in values)))
    opened = registry.open_data(str(tmp_path / "q.tfrecord.gz"))
    assert opened.records == {"q.tfrecord.gz": 90}
    assert list(opened.read("q.tfrecord.gz", 80, 90)[0]) == values[80:90]
