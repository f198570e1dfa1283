"""Behaviour of the storage backends: one suite run against LocalStorage and S3Storage, plus
backend-specific checks (atomic local writes; S3 errors, credentials and retries against the stand-in)."""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
from fault_proxy import FAULTS, FaultProxy, self_signed_certificate
from s3_stand_in import S3StandIn

from edl_argo.errors import ConfigError, StorageError
from edl_argo.storage import (
    TREE_COMPLETE_MARKER,
    LocalStorage,
    ObjectChangedError,
    ObjectInfo,
    ObjectNotFoundError,
    S3Storage,
    Storage,
    join_url,
    open_storage,
)
from edl_argo.storage.local import TEMP_PREFIX
from edl_argo.storage.retry import (
    Progress,
    RetryBudgetExhausted,
    RetryPolicy,
    call_with_retry,
    is_transient,
    socket_timeouts,
)
from edl_argo.storage.s3 import READ_CHUNK
from edl_argo.storage.trees import POINTER_NAME
from tests.engine_helpers import python_lines

# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    """Each backend, empty."""
    if request.param == "local":
        return LocalStorage(tmp_path / "root")
    return S3Storage(request.getfixturevalue("s3_env"))


@pytest.fixture
def s3(s3_env: str) -> S3Storage:
    return S3Storage(s3_env)


class _Events(logging.Handler):
    """Collects edl-argo log events by name (independent of how logging is configured)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.events: list[tuple[str, dict[str, object]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append((record.getMessage(), getattr(record, "fields", {})))

    def named(self, event: str) -> list[dict[str, object]]:
        return [fields for name, fields in self.events if name == event]


@pytest.fixture
def events() -> Iterator[_Events]:
    handler = _Events()
    logger = logging.getLogger("edl_argo.storage")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def make_tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- the shared contract --------------------------------------------------------------------------


def test_write_read_overwrite(storage: Storage) -> None:
    storage.write("a/b.bin", b"first")
    assert storage.read("a/b.bin") == b"first"
    storage.write("a/b.bin", b"second, longer")
    assert storage.read("a/b.bin") == b"second, longer"
    storage.write("empty", b"")
    assert storage.read("empty") == b""


def test_ranged_reads(storage: Storage) -> None:
    storage.write("r", b"0123456789")
    assert storage.read("r", 2, 3) == b"234"
    assert storage.read("r", 7) == b"789"
    assert storage.read("r", 8, 100) == b"89"  # past the end: what exists
    assert storage.read("r", 10, 5) == b""
    assert storage.read("r", 50) == b""
    assert storage.read("r", 3, 0) == b""
    with pytest.raises(ValueError):
        storage.read("r", -1)


def test_missing_objects(storage: Storage) -> None:
    for call in (
        lambda: storage.read("no/such"),
        lambda: storage.stat("no/such"),
        lambda: storage.read("no/such", 0, 0),
    ):
        with pytest.raises(ObjectNotFoundError, match="no/such"):
            call()
    assert not storage.exists("no/such")
    storage.delete("no/such")  # not an error


def test_list_with_prefix_is_sorted_and_recursive(storage: Storage) -> None:
    for key in ["d/b", "d/a/x", "e", "d/a.txt", "d/ab/y", "c"]:
        storage.write(key, key.encode())
    assert [o.key for o in storage.list()] == ["c", "d/a.txt", "d/a/x", "d/ab/y", "d/b", "e"]
    assert [o.key for o in storage.list("d/")] == ["d/a.txt", "d/a/x", "d/ab/y", "d/b"]
    assert [o.key for o in storage.list("d/a")] == ["d/a.txt", "d/a/x", "d/ab/y"]  # a raw prefix
    assert [o.key for o in storage.list("d/a/")] == ["d/a/x"]
    assert storage.list("nothing/") == []
    assert storage.list("d/b") == [ObjectInfo("d/b", 3)]


def test_stat_exists_delete(storage: Storage) -> None:
    storage.write("x/y", b"12345")
    assert storage.stat("x/y") == ObjectInfo("x/y", 5)
    assert storage.stat("/x/y/") == ObjectInfo("x/y", 5)  # keys are normalised
    assert storage.exists("x/y")
    assert not storage.exists("x")  # a "directory" is not an object
    storage.delete("x/y")
    assert not storage.exists("x/y")
    assert storage.list() == []


def test_versions_pin_an_object_and_change_when_it_is_replaced(storage: Storage) -> None:
    """stat and list report the same version token; rewriting the object (even with the same size) changes
    it; read_version returns the bytes with the version they came from, or refuses when it changed."""
    storage.write("d/shard", b"0123456789")
    pinned = storage.stat("d/shard").version
    assert pinned and [i.version for i in storage.list("d/")] == [pinned]
    assert storage.read_version("d/shard", 2, 3, version=pinned) == b"234"
    time.sleep(0.01)  # a later mtime on coarse clocks
    storage.write("d/shard", b"abcdefghij")  # same size, new content
    assert storage.stat("d/shard").version != pinned
    with pytest.raises(ObjectChangedError, match=r"d/shard.*changed"):
        storage.read_version("d/shard", 2, 3, version=pinned)


def test_write_file_uploads_a_local_file_atomically(storage: Storage, tmp_path: Path) -> None:
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(300_000))
    storage.write_file("f/big.bin", source)
    assert storage.read("f/big.bin") == source.read_bytes()
    with pytest.raises(StorageError, match=r"missing\.bin"):
        storage.write_file("f/other", tmp_path / "missing.bin")
    assert not storage.exists("f/other")


def test_keys_cannot_escape_the_root(storage: Storage) -> None:
    for key in ["../outside", "a/../../b", "./a"]:
        with pytest.raises(StorageError, match="invalid storage key"):
            storage.write(key, b"x")
    with pytest.raises(StorageError, match="invalid storage key"):
        storage.read("")


def versions_of(storage: Storage, key: str) -> list[str]:
    """The version folders below ``key``, sorted."""
    prefix = key + "/"
    return sorted({o.key[len(prefix) :].split("/")[0] for o in storage.list(prefix) if "/v-" in "/" + o.key})


def test_put_tree_replaces_and_get_tree_round_trips(storage: Storage, tmp_path: Path) -> None:
    first = make_tree(
        tmp_path / "v1", {"saved_model.pb": b"pb1", "variables/v.data": b"d1", "variables/v.index": b"i1"}
    )
    assert not storage.tree_complete("model")
    storage.put_tree(first, "model")
    assert storage.tree_complete("model")
    storage.get_tree("model", tmp_path / "out1")
    assert read_tree(tmp_path / "out1") == read_tree(first)
    (v1,) = versions_of(storage, "model")

    second = make_tree(tmp_path / "v2", {"saved_model.pb": b"pb2", "assets/vocab.txt": b"a b c"})
    storage.put_tree(second, "model")
    assert storage.tree_complete("model")
    (v2,) = set(versions_of(storage, "model")) - {v1}
    pointer = json.loads(storage.read(f"model/{POINTER_NAME}"))
    assert pointer["current"] == v2 and pointer["files"] == {"assets/vocab.txt": 5, "saved_model.pb": 3}
    assert [o.key for o in storage.list("model/")] == sorted(
        [f"model/{POINTER_NAME}", f"model/{v2}/assets/vocab.txt", f"model/{v2}/saved_model.pb"]
        + [f"model/{v1}/{rel}" for rel in read_tree(first)]  # the previous version is kept
    )
    storage.get_tree("model/", tmp_path / "out2")
    assert read_tree(tmp_path / "out2") == read_tree(second)
    at_model = open_storage(storage.describe("model"))  # the tree's own URL: the root is the tree
    assert at_model.tree_complete("")
    at_model.get_tree("", tmp_path / "out3")
    assert read_tree(tmp_path / "out3") == read_tree(second)

    storage.put_tree(first, "model")  # a third version: the first is pruned, the second kept
    (v3,) = set(versions_of(storage, "model")) - {v1, v2}
    assert versions_of(storage, "model") == sorted([v2, v3])
    storage.get_tree("model", tmp_path / "out4")
    assert read_tree(tmp_path / "out4") == read_tree(first)
    if isinstance(storage, LocalStorage):  # pruning leaves no empty folder behind
        assert sorted(p.name for p in (storage.root / "model").iterdir()) == sorted([POINTER_NAME, v2, v3])


def test_get_tree_requires_the_pointer_or_an_older_marker(storage: Storage, tmp_path: Path) -> None:
    storage.write("half/saved_model.pb", b"pb")
    with pytest.raises(ObjectNotFoundError, match=f"no complete tree at .*half .*{POINTER_NAME}"):
        storage.get_tree("half", tmp_path / "out")


def test_a_tree_of_older_edl_argo_is_read_as_it_is_then_replaced(storage: Storage, tmp_path: Path) -> None:
    """Files and a _COMPLETE marker, no pointer: read as it is; the first publish over it keeps it as the
    previous version (beside the new one), the second deletes it."""
    legacy = {"model.keras": b"k1", "saved_model/saved_model.pb": b"pb1"}
    for rel, data in legacy.items():
        storage.write(f"model/{rel}", data)
    storage.write(f"model/{TREE_COMPLETE_MARKER}", b"")
    assert storage.tree_complete("model")
    storage.get_tree("model", tmp_path / "legacy")
    assert read_tree(tmp_path / "legacy") == legacy

    new = make_tree(tmp_path / "new", {"model.keras": b"k2"})
    storage.put_tree(new, "model")
    storage.get_tree("model", tmp_path / "out")
    assert read_tree(tmp_path / "out") == {"model.keras": b"k2"}
    assert {f"model/{rel}" for rel in [*legacy, TREE_COMPLETE_MARKER]} <= {o.key for o in storage.list()}
    storage.put_tree(new, "model")
    assert not any(
        o.key.startswith(("model/model.keras", "model/saved_model", "model/_C")) for o in storage.list()
    )
    assert len(versions_of(storage, "model")) == 2


def test_an_invalid_pointer_is_one_line_naming_it_and_a_publish_replaces_it(
    storage: Storage, tmp_path: Path
) -> None:
    storage.write(f"model/{POINTER_NAME}", b'{"current": "../../etc"}')
    with pytest.raises(StorageError, match=rf"^{storage.describe('model/' + POINTER_NAME)} is not a valid"):
        storage.get_tree("model", tmp_path / "out")
    storage.put_tree(make_tree(tmp_path / "t", {"f": b"1"}), "model")
    storage.get_tree("model", tmp_path / "out")
    assert read_tree(tmp_path / "out") == {"f": b"1"}


def test_put_tree_keeps_reserved_names_and_rejects_the_empty_key(storage: Storage, tmp_path: Path) -> None:
    """Nested trees (a pipeline artifact holding a model) keep their pointer and markers as files."""
    tree = make_tree(tmp_path / "t", {TREE_COMPLETE_MARKER: b"", POINTER_NAME: b"{}", "f": b"1"})
    storage.put_tree(tree, "t")
    storage.get_tree("t", tmp_path / "out")
    assert read_tree(tmp_path / "out") == read_tree(tree)
    with pytest.raises(StorageError, match="invalid storage key"):
        storage.put_tree(make_tree(tmp_path / "u", {"f": b"1"}), "")


@pytest.mark.parametrize("previous", [False, True])
def test_failed_put_tree_leaves_the_previous_tree_untouched(
    storage: Storage, tmp_path: Path, previous: bool
) -> None:
    """On every backend: the previous tree (or none) stands, exactly, and the failed upload left nothing."""
    old = make_tree(tmp_path / "old", {"a": b"old-a", "old-only": b"x"})
    if previous:
        storage.put_tree(old, "model")
    before = {info.key: storage.read(info.key) for info in storage.list()}
    new = make_tree(tmp_path / "new", {"a": b"new-a", "z": b"new-z"})
    (new / "m_broken").symlink_to(tmp_path / "does-not-exist")  # fails after "a" was copied/uploaded
    with pytest.raises(StorageError, match="m_broken"):
        storage.put_tree(new, "model")
    assert {info.key: storage.read(info.key) for info in storage.list()} == before
    assert storage.tree_complete("model") == previous
    if previous:
        storage.get_tree("model", tmp_path / "out")
        assert read_tree(tmp_path / "out") == read_tree(old)
    if isinstance(storage, LocalStorage) and storage.root.exists():
        assert [p.name for p in storage.root.rglob(f"{TEMP_PREFIX}*")] == []


# -- local-only -----------------------------------------------------------------------------------


def test_local_concurrent_reader_never_sees_a_partial_file(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    small, large = b"a" * (1 << 20), b"b" * (3 << 20)
    storage.write("f", small)
    done = threading.Event()
    seen: list[int] = []

    def reader() -> None:
        while not done.is_set():
            data = storage.read("f")
            seen.append(len(data) if data in (small, large) else -len(data))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(40):
            storage.write("f", large if i % 2 == 0 else small)
    finally:
        done.set()
        thread.join()
    assert seen and all(n > 0 for n in seen), sorted(set(seen))  # negative: a partial or mixed read
    assert [o.key for o in storage.list()] == ["f"]  # no temporaries left


def test_local_list_skips_temporaries_and_missing_root(tmp_path: Path) -> None:
    assert LocalStorage(tmp_path / "not-yet").list() == []
    storage = LocalStorage(tmp_path)
    storage.write("a/real", b"1")
    (tmp_path / "a" / f"{TEMP_PREFIX}real-123").write_bytes(b"partial")
    (tmp_path / f"{TEMP_PREFIX}model-456").mkdir()
    (tmp_path / f"{TEMP_PREFIX}model-456" / "f").write_bytes(b"partial")
    assert storage.list() == [ObjectInfo("a/real", 1)]


def test_local_writes_below_a_file_fail_with_one_line_naming_the_path(tmp_path: Path) -> None:
    """A root, or a folder of a key, that is a regular file: every write is a StorageError naming the path
    (not the OSError of removing a temporary that could never be created), and nothing is left."""
    (tmp_path / "afile").write_bytes(b"mine")
    source = tmp_path / "tree"
    source.mkdir()
    (source / "part").write_bytes(b"1")
    for storage, key in ((LocalStorage(tmp_path / "afile"), "x/y"), (LocalStorage(tmp_path), "afile/y")):
        for write, argument in (
            (storage.write, b"1"),
            (storage.write_file, source / "part"),
            (lambda k, path: storage.put_tree(path, k), source),  # noqa: B023 (called in this iteration)
        ):
            with pytest.raises(StorageError, match="afile is a file, not a folder") as raised:
                write(key, argument)
            assert "\n" not in str(raised.value)
    with pytest.raises(StorageError, match="afile is a file, not a folder"):
        LocalStorage(tmp_path / "afile" / "x").check_reachable()
    assert (tmp_path / "afile").read_bytes() == b"mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "tree"]
    LocalStorage(tmp_path / "not" / "yet").check_reachable()  # a folder that a write makes
    assert not (tmp_path / "not").exists()
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    with pytest.raises(StorageError, match=r"dangling is a link to .*gone, which is not there"):
        LocalStorage(tmp_path / "dangling" / "x").check_reachable()  # no write could make that folder


def test_local_check_reachable_is_one_line_for_a_folder_it_cannot_look_into(tmp_path: Path) -> None:
    """A permission error is the StorageError naming the folder, not an OSError (root reads any folder:
    the test stands in for the denial)."""
    storage = LocalStorage(tmp_path / "closed" / "out")
    real_stat = Path.stat

    def denied(path: Path, **kwargs: object) -> os.stat_result:
        if path == tmp_path / "closed" / "out":
            raise PermissionError(13, "Permission denied")
        return real_stat(path, **kwargs)

    (tmp_path / "closed").mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "stat", denied)
        with pytest.raises(StorageError, match=r"closed/out: Permission denied"):
            storage.check_reachable()


# -- S3-only --------------------------------------------------------------------------------------


def test_s3_stand_in_answers_a_write_only_once_its_data_is_stored(
    s3: S3Storage, s3_server: S3StandIn
) -> None:
    """Read-after-write, as S3 gives: the stand-in once answered a PUT before its data reached the disk."""
    s3.write("k", b"first")
    big = os.urandom(6 << 20)  # multipart: CompleteMultipartUpload writes the object from its parts
    with s3_server.slow_disk(0.02):
        s3.write("k", b"second, longer")
        assert s3.read("k") == b"second, longer"
        s3.write("big", big)
        assert s3.read("big") == big


def test_s3_large_object_uses_multipart_and_ranged_reads(s3: S3Storage) -> None:
    data = os.urandom(17 * 1024 * 1024 + 3)
    s3.write("big", data)
    assert s3.stat("big").size == len(data)
    start = 5 * 1024 * 1024 - 10  # across the first part boundary
    assert s3.read("big", start, 20) == data[start : start + 20]
    assert s3.read("big", len(data) - 2) == data[-2:]


@pytest.mark.parametrize("wrong", ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"])
def test_s3_wrong_credentials(
    s3_env: str, monkeypatch: pytest.MonkeyPatch, events: _Events, wrong: str
) -> None:
    secret = "wrong-secret-value-" + "x" * 16
    monkeypatch.setenv(wrong, "WRONGKEYID" if wrong == "AWS_ACCESS_KEY_ID" else secret)
    storage = S3Storage(s3_env)
    for call in (lambda: storage.read("k"), lambda: storage.write("k", b"1"), lambda: storage.list()):
        with pytest.raises(StorageError) as info:
            call()
        message = str(info.value)
        assert message.startswith(f"access denied to {s3_env}")
        assert "AWS_ACCESS_KEY_ID" in message and "AWS_SECRET_ACCESS_KEY" in message
        assert secret not in message and os.environ["AWS_SECRET_ACCESS_KEY"] not in message
    with pytest.raises(StorageError, match="access denied"):
        storage.exists("k")  # not "False": the caller must learn that it cannot see
    assert events.named("storage_retry") == []  # denial is not transient


def test_s3_anonymous_access_is_explained(s3_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(StorageError, match="AWS_ACCESS_KEY_ID is not set, so the request was anonymous"):
        S3Storage(s3_env).read("k")


def test_s3_missing_bucket_and_key_messages(s3_env: str, s3_server: S3StandIn) -> None:
    missing = S3Storage("s3://no-such-bucket-here/p")
    expected = f"bucket 'no-such-bucket-here' does not exist at endpoint {s3_server.endpoint}"
    for call in (
        lambda: missing.read("k"),
        lambda: missing.stat("k"),
        lambda: missing.list(),
        lambda: missing.exists("k"),
    ):
        with pytest.raises(StorageError, match=expected) as info:
            call()
        assert not isinstance(info.value, ObjectNotFoundError)
    with pytest.raises(ObjectNotFoundError, match=f"^no object at {s3_env}/dir/key$"):
        S3Storage(s3_env).read("dir/key")


def test_s3_retries_until_the_server_is_back(s3: S3Storage, s3_server: S3StandIn, events: _Events) -> None:
    s3.write("k", b"survives restarts")
    s3_server.stop()
    restart = threading.Timer(2.0, s3_server.start)
    restart.start()
    try:
        started = time.monotonic()
        assert s3.read("k", 9) == b"restarts"
        assert time.monotonic() - started >= 2.0
    finally:
        restart.join()
    retries = events.named("storage_retry")
    assert retries and retries[0]["url"] == f"{s3.url}/k"
    assert [r["attempt"] for r in retries] == list(range(1, len(retries) + 1))


def test_s3_unreachable_after_budget(
    s3: S3Storage, s3_server: S3StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDL_STORAGE_RETRY_SECONDS", "1")
    storage = S3Storage(s3.url)
    s3_server.stop()
    try:
        started = time.monotonic()
        with pytest.raises(StorageError) as info:
            storage.read("k")
        assert time.monotonic() - started < 3
    finally:
        s3_server.start()
    message = str(info.value)
    assert message.startswith(f"cannot reach S3 endpoint {s3_server.endpoint}: ")
    assert "Connection refused" in message
    assert " attempts over " in message and "(after 1 attempts" not in message


def test_s3_throttling_is_retried(s3: S3Storage, s3_server: S3StandIn, events: _Events) -> None:
    s3.write("k", b"data")
    s3_server.inject_errors(3, status=503, code="SlowDown")
    assert s3.read("k") == b"data"
    assert [r["error"] for r in events.named("storage_retry")] == [
        "SlowDown: Injected failure (test stand-in)"
    ] * 3


def test_s3_persistent_5xx_exhausts_the_budget(
    s3: S3Storage, s3_server: S3StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDL_STORAGE_RETRY_SECONDS", "0.5")
    s3_server.inject_errors(100, status=500, code="InternalError")
    try:
        with pytest.raises(
            StorageError, match=r"kept failing for .*/k: InternalError: .*\(after \d+ attempts over"
        ):
            S3Storage(s3.url).write("k", b"x")
    finally:
        s3_server.inject_errors(0)


def test_s3_endpoint_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDL_S3_ENDPOINT", "minio:9000")
    with pytest.raises(ConfigError, match="EDL_S3_ENDPOINT='minio:9000' must be an http:// or https:// URL"):
        S3Storage("s3://bucket/p")
    monkeypatch.setenv("EDL_S3_ENDPOINT", "http://user:hunter2@minio:9000")
    with pytest.raises(ConfigError, match="must not contain credentials") as info:
        S3Storage("s3://bucket/p")
    assert "hunter2" not in str(info.value)
    monkeypatch.setenv("EDL_S3_ENDPOINT", "https://minio.example:9443/")
    assert S3Storage("s3://bucket/p").endpoint == "https://minio.example:9443"


# -- URLs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "kind", "root"),
    [
        ("/data/out", LocalStorage, "/data/out"),
        ("relative/dir", LocalStorage, "relative/dir"),
        ("file:///data/my%20out", LocalStorage, "/data/my out"),
        ("file://localhost/data", LocalStorage, "/data"),
        ("s3://bucket", S3Storage, ""),
        ("s3://bucket/a/b/", S3Storage, "a/b"),
    ],
)
def test_open_storage_accepts(url: str, kind: type, root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EDL_S3_ENDPOINT", raising=False)
    storage = open_storage(url)
    assert isinstance(storage, kind)
    assert storage.url == url
    assert str(storage.root if isinstance(storage, LocalStorage) else storage.prefix) == root


@pytest.mark.parametrize(
    "url",
    [
        "gs://bucket/x",
        "http://host/x",
        "s3:/bucket/x",
        "s3://",
        "s3://Bad_Bucket!/x",
        "s3://Bad_Bucket/x",  # S3's legacy names: no virtual-host address can reach them
        "s3://b/x",
        "file://host/x",
        "",
    ],
)
def test_open_storage_rejects(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EDL_S3_ENDPOINT", raising=False)  # AWS's: its bucket names
    with pytest.raises(StorageError) as info:
        open_storage(url)
    message = str(info.value)
    assert (repr(url) in message) if url else ("empty storage URL" in message)
    if url.startswith(("gs:", "http:", "s3:/b", "file:")) or not url:
        assert "s3://bucket/prefix" in message and "file:///absolute/path" in message


def test_a_legacy_bucket_name_is_taken_where_the_server_addresses_buckets_by_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EDL_S3_ENDPOINT", "http://minio.example:9000")
    assert S3Storage("s3://Legacy_Data/x").bucket == "Legacy_Data"
    monkeypatch.setenv("EDL_S3_ENDPOINT", "https://s3.eu-west-1.amazonaws.com")
    with pytest.raises(StorageError, match="'Legacy_Data' is not a valid bucket name"):
        S3Storage("s3://Legacy_Data/x")


def test_join_url() -> None:
    assert join_url("s3://b/p/", "a", "/c/") == "s3://b/p/a/c"
    assert join_url("/root", "", "x") == "/root/x"
    assert join_url("", "k") == "k"


# -- the retry helper -----------------------------------------------------------------------------


class _FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _failing(exc: Exception, times: int) -> tuple[list[int], object]:
    calls: list[int] = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise exc
        return "ok"

    return calls, fn


def test_retry_budget_in_attempts_and_seconds() -> None:
    fake = _FakeTime()
    calls, fn = _failing(ConnectionRefusedError("refused"), 100)
    with pytest.raises(RetryBudgetExhausted) as info:
        call_with_retry(
            fn,
            url="u",
            policy=RetryPolicy(max_seconds=1000, max_attempts=4),
            sleep=fake.sleep,
            clock=fake.clock,
        )
    assert len(calls) == info.value.attempts == 4 and len(fake.sleeps) == 3
    assert all(0.5 * 0.25 * 2**i <= d <= 0.25 * 2**i for i, d in enumerate(fake.sleeps))  # jittered backoff

    fake = _FakeTime()
    calls, fn = _failing(ConnectionRefusedError("refused"), 100)
    with pytest.raises(RetryBudgetExhausted, match=r"refused \(after \d+ attempts over 3.0 s\)"):
        call_with_retry(
            fn,
            url="u",
            policy=RetryPolicy(max_seconds=3, max_attempts=100),
            sleep=fake.sleep,
            clock=fake.clock,
        )
    assert fake.now == pytest.approx(3.0)  # the last attempt starts at the deadline, not after it

    fake = _FakeTime()
    calls, fn = _failing(ConnectionRefusedError("refused"), 2)
    assert call_with_retry(fn, url="u", sleep=fake.sleep, clock=fake.clock) == "ok"
    assert len(calls) == 3


def test_retry_does_not_repeat_permanent_errors() -> None:
    calls, fn = _failing(PermissionError("no"), 100)
    with pytest.raises(PermissionError):
        call_with_retry(fn, url="u", sleep=lambda s: None)
    assert len(calls) == 1


def test_retry_policy_from_env() -> None:
    assert RetryPolicy.from_env({}) == RetryPolicy(max_seconds=30)
    assert RetryPolicy.from_env({"EDL_STORAGE_RETRY_SECONDS": "300"}) == RetryPolicy(max_seconds=300)
    assert RetryPolicy.from_env({}).max_attempts is None  # the budget in seconds decides
    with pytest.raises(ConfigError, match="EDL_STORAGE_RETRY_SECONDS='soon'"):
        RetryPolicy.from_env({"EDL_STORAGE_RETRY_SECONDS": "soon"})


# -- S3 under network faults (tests/fault_proxy.py between S3Storage and the stand-in) ---------------

#: The retry budget of the fault tests, and how long each fault lasts: well inside the budget.
FAULT_BUDGET_S = 8.0
FAULT_SECONDS = 3.0


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(params=["http", "https"])
def proxied(
    request: pytest.FixtureRequest,
    s3_env: str,
    s3_server: S3StandIn,
    certificate: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[FaultProxy, S3Storage]]:
    """The stand-in behind a fault proxy (TLS-terminating for https), and a storage going through it."""
    tls = certificate if request.param == "https" else None
    with FaultProxy((s3_server.host, s3_server.port), tls=tls) as proxy:
        monkeypatch.setenv("EDL_S3_ENDPOINT", proxy.endpoint)
        monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))
        monkeypatch.setenv("EDL_STORAGE_RETRY_SECONDS", str(FAULT_BUDGET_S))
        yield proxy, S3Storage(s3_env)


@pytest.mark.parametrize(
    ("proxied", "fault"),
    [
        (scheme, fault)
        for scheme in ("http", "https")
        for fault in FAULTS
        if (scheme, fault) != ("http", "tls_drop")
    ],
    indirect=["proxied"],
)
def test_s3_rides_out_a_fault_shorter_than_the_budget(
    fault: str, proxied: tuple[FaultProxy, S3Storage], events: _Events
) -> None:
    proxy, storage = proxied
    storage.write("before", b"written before the fault")

    proxy.fault(fault, FAULT_SECONDS)
    started = time.monotonic()
    assert storage.read("before") == b"written before the fault"
    storage.write("during", b"x" * 100_000)
    elapsed = time.monotonic() - started

    assert storage.read("during") == b"x" * 100_000
    # Done after the fault, and at most one backoff (plus a second of slack) after it ended.
    assert FAULT_SECONDS - 0.5 <= elapsed < FAULT_SECONDS + RetryPolicy().max_delay + 1.0, elapsed
    retries = events.named("storage_retry")
    assert len(retries) >= 2 and retries[0]["url"] == f"{storage.url}/before"


@pytest.mark.parametrize("fault", ["refuse", "stall", "http_429"])
def test_s3_gives_up_when_a_fault_outlasts_the_budget(
    fault: str, proxied: tuple[FaultProxy, S3Storage], events: _Events
) -> None:
    proxy, storage = proxied
    storage.write("k", b"v")
    proxy.fault(fault, 3 * FAULT_BUDGET_S)
    started = time.monotonic()
    with pytest.raises(StorageError, match=r"\(after \d+ attempts over \d+\.\d s\)"):
        storage.read("k")
    elapsed = time.monotonic() - started
    connect, read = socket_timeouts(RetryPolicy(max_seconds=FAULT_BUDGET_S))
    assert FAULT_BUDGET_S <= elapsed <= FAULT_BUDGET_S + max(connect, read) + 1.0, elapsed
    assert len(events.named("storage_retry")) >= 3


def test_s3_download_cut_midway_resumes_where_it_broke_off(
    proxied: tuple[FaultProxy, S3Storage], events: _Events
) -> None:
    proxy, storage = proxied
    data = os.urandom(6 << 20)
    storage.write("big", data)
    before = proxy.bytes_to_client

    cut_at = 7 << 19  # 3.5 MiB into the download
    proxy.cut_after(cut_at)
    assert storage.read("big", 1000) == data[1000:]

    assert len(events.named("storage_retry")) == 1
    relayed = proxy.bytes_to_client - before
    first, resumed = proxy.range_starts[-2:]
    assert first == 1000
    # Resumed, not restarted: the second request starts after the whole chunks the first one delivered (the
    # client keeps what it read in whole chunks of READ_CHUNK) and fetches only the rest.
    kept = resumed - first
    assert kept % READ_CHUNK == 0 and READ_CHUNK <= kept <= cut_at, kept
    assert relayed < cut_at + (len(data) - 1000 - kept) + (64 << 10)


def test_s3_certificate_errors_are_not_retried(
    s3_env: str, s3_server: S3StandIn, certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    with FaultProxy((s3_server.host, s3_server.port), tls=certificate) as proxy:
        monkeypatch.setenv("EDL_S3_ENDPOINT", proxy.endpoint)
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)  # the self-signed certificate is not trusted
        started = time.monotonic()
        with pytest.raises(StorageError, match="CERTIFICATE_VERIFY_FAILED"):
            S3Storage(s3_env).read("k")
        assert time.monotonic() - started < 2


class _ObjectsByName:
    """The three minio calls naming needs, over a dict of object names. The S3 stand-in cannot hold names
    with ``//`` (s3rver stores objects as files, where ``a//b`` is ``a/b``); real S3 and MinIO can."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects

    def list_objects(self, bucket: str, prefix: str, recursive: bool) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(object_name=name, size=len(data), etag=None)
            for name, data in sorted(self.objects.items())
            if name.startswith(prefix)
        ]

    def stat_object(self, bucket: str, name: str) -> SimpleNamespace:
        return SimpleNamespace(size=len(self.objects[name]), etag=None)

    def get_object(self, bucket: str, name: str, offset: int, length: int, **_: object) -> _Response:
        data = self.objects[name][offset:]
        return _Response(data[:length] if length else data)


class _Response(io.BytesIO):
    headers: ClassVar[dict[str, str]] = {}

    def stream(self, amount: int) -> Iterator[bytes]:
        while chunk := self.read(amount):
            yield chunk

    def release_conn(self) -> None:
        pass


def test_s3_object_names_with_empty_segments_are_read_as_listed() -> None:
    storage = S3Storage("s3://bucket/prefix")
    storage._client = _ObjectsByName(  # type: ignore[assignment]
        {"prefix/data//shard-0": b"double", "prefix/data/shard-0": b"single", "prefix//top": b"unaddressable"}
    )

    keys = [info.key for info in storage.list("data/")]

    assert keys == ["data//shard-0", "data/shard-0"]
    assert [storage.read(key) for key in keys] == [b"double", b"single"]
    assert storage.stat("data//shard-0") == ObjectInfo("data//shard-0", 6)
    assert storage.read("data//shard-0", 2, 3) == b"ubl"
    assert "top" not in [info.key.strip("/") for info in storage.list()]  # not read as "prefix/top"


def test_retry_uses_the_whole_budget_however_many_attempts_it_takes() -> None:
    fake = _FakeTime()
    calls, fn = _failing(ConnectionResetError("reset"), 10)  # backoff of at most 28 s: inside the budget
    policy = RetryPolicy.from_env({})
    assert call_with_retry(fn, url="u", policy=policy, sleep=fake.sleep, clock=fake.clock) == "ok"
    assert len(calls) == 11 and fake.now < 30

    fake = _FakeTime()
    calls, fn = _failing(ConnectionResetError("reset"), 1000)
    with pytest.raises(RetryBudgetExhausted):
        call_with_retry(fn, url="u", policy=policy, sleep=fake.sleep, clock=fake.clock)
    assert fake.now == pytest.approx(30.0)


def test_retry_budget_counts_from_the_last_progress() -> None:
    """A transfer that progressed for 40 s and then broke gets the whole budget again; attempts that only
    repeat what was already transferred do not extend it."""
    fake = _FakeTime()
    progress = Progress(clock=fake.clock)
    attempts: list[int] = []

    def transfer() -> str:
        attempts.append(1)
        progress.begin(0)
        if len(attempts) == 1:
            for _ in range(40):  # 40 s of progress, then the connection is reset
                fake.now += 1.0
                progress.advance(1000)
            raise ConnectionResetError("reset after 40 s")
        progress.advance(1000)  # a retry starts over: no further than before
        if len(attempts) < 6:
            raise ConnectionResetError("reset")
        return "ok"

    policy = RetryPolicy(max_seconds=30)
    assert call_with_retry(
        transfer, url="u", policy=policy, sleep=fake.sleep, clock=fake.clock, progress=progress
    )

    fake = _FakeTime()
    progress = Progress(clock=fake.clock)

    def never() -> str:
        progress.begin(0)
        fake.now += 1.0
        progress.advance(10)  # the same 10 bytes every time
        raise ConnectionResetError("reset")

    with pytest.raises(RetryBudgetExhausted):
        call_with_retry(never, url="u", policy=policy, sleep=fake.sleep, clock=fake.clock, progress=progress)
    assert 31 <= fake.now <= 33  # 30 s after the first (and only) progress, at 1 s


def test_transient_errors() -> None:
    import ssl

    import urllib3
    from minio.error import InvalidResponseError, ServerError

    handshake_cut = urllib3.exceptions.SSLError(ssl.SSLEOFError(8, "EOF occurred in violation of protocol"))
    bad_certificate = urllib3.exceptions.SSLError(
        ssl.SSLCertVerificationError(1, "CERTIFICATE_VERIFY_FAILED")
    )
    assert is_transient(handshake_cut)
    assert is_transient(ConnectionResetError(104, "Connection reset by peer"))
    assert is_transient(InvalidResponseError(429, "text/plain", "Too Many Requests"))
    assert is_transient(ServerError("server failed with HTTP status code 429", 429))
    assert is_transient(InvalidResponseError(503, "text/html", "Service Unavailable"))
    assert not is_transient(bad_certificate)
    assert not is_transient(InvalidResponseError(400, "text/plain", "Bad Request"))
    connect, read = socket_timeouts(RetryPolicy(max_seconds=30))
    assert connect <= 5 and read <= 10  # well below the budget: a stalled connection costs a fraction of it


def test_the_s3_client_library_is_imported_only_when_s3_storage_is_used(tmp_path: Path) -> None:
    """minio (and the cryptography it loads) takes about 0.1 s to import, on the way to a local job's first
    step twice (the master and its pod template): a process that uses folders does without it, and
    ``S3Storage`` is still where it was."""
    code = (
        "import sys\n"
        "import edl_argo.master.job, edl_argo.ps.server, edl_argo.worker.main, edl_argo.inference\n"
        "from edl_argo.storage import open_storage\n"
        f"open_storage({str(tmp_path)!r}).write('k', b'v')\n"
        "print('minio' in sys.modules)\n"
        "from edl_argo.storage import S3Storage\n"
        "print('minio' in sys.modules, S3Storage.__name__, type(open_storage('s3://bucket/prefix')).__name__)\n"
    )
    assert python_lines(code) == ["False", "True S3Storage S3Storage"]
