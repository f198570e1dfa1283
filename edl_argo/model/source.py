"""Model definitions at a storage URL: fetched once by the master, run as the same bytes by every pod.

Besides a file or a module in the image, ``--model-def`` may name a model in storage (S3, or a local
folder as ``file:///...``), so that a model of one's own needs no image of its own:

* ``s3://bucket/models/mymodel.py[:factory]``: one model file;
* ``s3://bucket/models/mymodel/:entry.py[:factory]``: a folder of modules (every file below it), whose
  ``entry.py`` defines the model and may import the others (the folder is put on ``sys.path``).

**Same bytes everywhere.** The master (:func:`stage_model_def`) fetches the model once and packs it into a
deterministic tar, the *bundle*, which it writes, unless it is there already, to
``<state>/model-defs/sha256-<hex>.tar`` of the job's state URL (``--master-state``, default ``--output``):
named by its content, never overwritten. Its pods get ``<that URL>:entry.py[:factory]`` as their
``--model-def``. A process that loads a bundle (:func:`local_model_def`, called by the loader) checks its
sha256 against its name before anything in it runs, and logs the digest (``model_def_fetched``); the
master puts it in the model's ``flags.json``. Changing the file at the URL while the job runs changes
nothing for the job; a master restarted for the same job (:func:`pin_model_def`) keeps the bundle of
the one before.

Limits: :data:`MAX_FILES` files, :data:`MAX_BYTES` bytes in all.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
import sys
import tarfile
import tempfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from edl_argo.errors import ConfigError, StorageError
from edl_argo.log import get_logger
from edl_argo.storage import LocalStorage, ObjectNotFoundError, Storage, open_storage

log = get_logger(__name__)

#: Most files a model folder may hold, and most bytes a model may have in all.
MAX_FILES = 256
MAX_BYTES = 16 * 1024 * 1024
#: Where the master stages bundles, under its state URL.
STAGE_PREFIX = "model-defs"
#: The name of a bundle: its content's sha256.
BUNDLE_NAME = re.compile(r"sha256-(?P<hex>[0-9a-f]{64})\.tar$")

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_FOLDER = re.compile(r"^(?P<url>.+/):(?P<entry>[^:]+\.py)(?::(?P<factory>\w+))?$")
_FILE = re.compile(r"^(?P<url>.+?\.(?:py|tar))(?::(?P<entry>[^:]+\.py))?(?::(?P<factory>\w+))?$")


@dataclass(frozen=True)
class ModelSource:
    """Where a model in storage is: ``url`` (a file, a folder ending in ``/``, or a bundle), the entry
    file relative to it (``""`` for a single file) and the factory function (``""``: the default)."""

    url: str
    entry: str
    factory: str

    @property
    def is_bundle(self) -> bool:
        return BUNDLE_NAME.search(self.url) is not None

    def with_url(self, url: str, entry: str) -> str:
        """The ``--model-def`` of this model at ``url`` with the entry ``entry``."""
        return f"{url}:{entry}" + (f":{self.factory}" if self.factory else "")


@dataclass(frozen=True)
class StagedModel:
    """A model the master staged: its ``source`` (the ``--model-def`` given), its ``digest``
    (``sha256:<hex>``), and ``pod_model_def``, the ``--model-def`` of its pods (the bundle)."""

    source: str
    digest: str
    pod_model_def: str

    def flags(self) -> dict[str, str]:
        """What the model's ``flags.json`` records about it."""
        return {"model_def_digest": self.digest, "model_def_bundle": self.pod_model_def}


def parse_model_source(model_def: str) -> ModelSource | None:
    """The storage location ``model_def`` names, or None for a path or module (loaded as before).

    Raises :class:`ConfigError` for a URL that names neither a ``.py`` file, a folder with its entry
    (``.../folder/:entry.py``), nor a bundle."""
    if not _URL.match(model_def):
        return None
    folder = _FOLDER.match(model_def)
    if folder:
        return ModelSource(folder["url"], folder["entry"], folder["factory"] or "")
    single = _FILE.match(model_def)
    if single and (single["entry"] is not None) == single["url"].endswith(".tar"):
        return ModelSource(single["url"], single["entry"] or "", single["factory"] or "")
    raise ConfigError(
        f"--model-def {model_def}: a model in storage is URL/file.py[:factory] or"
        " URL/folder/:entry.py[:factory]"
    )


def _split(url: str) -> tuple[Storage, str]:
    """The storage of ``url``'s folder and the key of its last part."""
    parent, _, name = url.rstrip("/").rpartition("/")
    return open_storage(parent + "/"), name


def fetch_files(source: ModelSource) -> dict[str, bytes]:
    """Relative path -> bytes of the model's file, or of every file of its folder (sorted, limited)."""
    try:
        if not source.url.endswith("/"):
            storage, name = _split(source.url)
            data = storage.read(name)
            _check_size(source.url, 1, len(data))
            return {name: data}
        storage = open_storage(source.url)
        objects = [o for o in storage.list() if not o.key.endswith("/")]
        _check_size(source.url, len(objects), sum(o.size for o in objects))
        files = {o.key: storage.read(o.key) for o in sorted(objects, key=lambda o: o.key)}
    except ObjectNotFoundError:
        raise ConfigError(f"--model-def {source.url}: no such file") from None
    except StorageError as error:
        raise ConfigError(f"--model-def {source.url}: {error}") from None
    if source.entry not in files:
        raise ConfigError(f"--model-def {source.url}: the folder has no {source.entry}")
    return files


def _check_size(url: str, count: int, size: int) -> None:
    if count > MAX_FILES or size > MAX_BYTES:
        raise ConfigError(
            f"--model-def {url}: {count} files of {size} bytes; a model has at most {MAX_FILES} files"
            f" and {MAX_BYTES} bytes"
        )


def pack(files: dict[str, bytes]) -> bytes:
    """The bundle of ``files``: a tar whose bytes depend on the names and contents only."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(files[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(files[name]))
    return buffer.getvalue()


def digest_of(bundle: bytes) -> str:
    return f"sha256:{hashlib.sha256(bundle).hexdigest()}"


def _bundle_name(digest: str) -> str:
    return f"sha256-{digest.removeprefix('sha256:')}.tar"


_materialized: dict[str, Path] = {}
_materialized_lock = threading.Lock()


def _materialize(bundle: bytes, digest: str) -> Path:
    """The folder this process unpacked ``bundle`` to (once per digest), on ``sys.path``."""
    with _materialized_lock:
        if digest in _materialized:
            return _materialized[digest]
        root = Path(tempfile.gettempdir()) / "edl-argo-models" / _bundle_name(digest).removesuffix(".tar")
        if not root.is_dir():
            partial = root.with_name(f".{root.name}.{uuid.uuid4().hex[:8]}")
            partial.mkdir(parents=True)
            with tarfile.open(fileobj=io.BytesIO(bundle)) as tar:
                for member in tar.getmembers():
                    path = PurePosixPath(member.name)
                    if not member.isfile() or path.is_absolute() or ".." in path.parts:
                        shutil.rmtree(partial)
                        raise ConfigError(f"model bundle {digest}: unsafe member {member.name!r}")
                tar.extractall(partial, filter="data")
            try:
                partial.rename(root)
            except OSError:  # another process of this machine unpacked it first
                shutil.rmtree(partial)
        sys.path.insert(0, str(root))  # a folder's entry imports its sibling modules
        _materialized[digest] = root
        return root


def local_model_def(model_def: str) -> str:
    """``model_def`` with a model in storage replaced by the local copy to load (a path or module is
    returned as it is). A bundle is checked against its name first; the digest is logged."""
    source = parse_model_source(model_def)
    if source is None:
        return model_def
    if source.is_bundle:
        storage, name = _split(source.url)
        try:
            bundle = storage.read(name)
        except StorageError as error:
            raise ConfigError(f"--model-def {model_def}: cannot read the model bundle: {error}") from None
        digest = digest_of(bundle)
        if _bundle_name(digest) != name:
            raise ConfigError(f"--model-def {model_def}: the bundle's content has {digest}, not its name's")
        entry = source.entry
    else:
        files = fetch_files(source)
        bundle = pack(files)
        digest = digest_of(bundle)
        entry = source.entry or next(iter(files))
    root = _materialize(bundle, digest)
    log.info("model_def_fetched", url=source.url, digest=digest)
    return f"{root / entry}" + (f":{source.factory}" if source.factory else "")


def stage_model_def(model_def: str, state_url: str, *, shared: bool) -> StagedModel | None:
    """Fetch the model in storage that ``model_def`` names, once, and stage its bundle under ``state_url``
    for the job's pods (None for a path or module: pods load those as they are).

    ``shared``: whether the pods need the bundle in storage they share (Kubernetes): a local
    ``state_url`` is then refused, naming the flags."""
    source = parse_model_source(model_def)
    if source is None:
        return None
    stage = open_storage(state_url)
    if shared and isinstance(stage, LocalStorage):
        raise ConfigError(
            f"--model-def {model_def}: the pods fetch the model from the job's state URL, which must be in"
            f" storage they share: {state_url} is local; give --master-state (or --output) as s3://..."
        )
    if source.is_bundle:  # staged already (by hand, or by an earlier job): check it, pass it on
        local_model_def(model_def)
        match = BUNDLE_NAME.search(source.url)
        assert match is not None
        return StagedModel(model_def, f"sha256:{match['hex']}", model_def)
    files = fetch_files(source)
    bundle = pack(files)
    digest = digest_of(bundle)
    key = f"{STAGE_PREFIX}/{_bundle_name(digest)}"
    try:
        if not stage.exists(key):
            stage.write(key, bundle)
    except StorageError as error:
        raise ConfigError(f"--model-def {model_def}: cannot stage it under {state_url}: {error}") from None
    _materialize(bundle, digest)
    url = stage.describe(key)
    if isinstance(stage, LocalStorage):
        url = Path(url).resolve().as_uri()  # a URL, which pods fetch and check, not a path they import
    staged = StagedModel(model_def, digest, source.with_url(url, source.entry or next(iter(files))))
    log.info("model_def_staged", source=model_def, digest=digest, bundle=staged.pod_model_def)
    return staged


def pin_model_def(staged: StagedModel, state_url: str, job_name: str, *, continuing: bool) -> StagedModel:
    """The model the job runs: ``staged``, recorded as the job's; or, when ``continuing`` a job whose
    earlier master staged the same ``--model-def``, that master's bundle (the URL may have changed since)."""
    stage = open_storage(state_url)
    key = f"{STAGE_PREFIX}/{job_name}.json"
    if continuing:
        try:
            pinned = json.loads(stage.read(key))
        except ObjectNotFoundError:
            pinned = None
        except (StorageError, ValueError) as error:
            raise ConfigError(f"{stage.describe(key)}: cannot read the job's model: {error}") from None
        if pinned and pinned.get("source") == staged.source:
            if pinned["digest"] != staged.digest:
                log.warning("model_def_changed", source=staged.source, job_digest=pinned["digest"])
            return StagedModel(staged.source, pinned["digest"], pinned["pod_model_def"])
    record = {"source": staged.source, "digest": staged.digest, "pod_model_def": staged.pod_model_def}
    stage.write(key, json.dumps(record).encode())
    return staged


__all__ = [
    "MAX_BYTES",
    "MAX_FILES",
    "ModelSource",
    "StagedModel",
    "local_model_def",
    "parse_model_source",
    "pin_model_def",
    "stage_model_def",
]
