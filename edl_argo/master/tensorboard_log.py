"""TensorBoard event files written by the master, uploaded under ``<output>/tensorboard/``.

``tf.summary`` writes only to local paths (and to storage of TensorFlow's own, not through
:mod:`edl_argo.storage`), and the master imports TensorFlow late and only for what needs it. So the master
encodes the few scalar events it writes itself, in the format TensorBoard reads: TFRecord framing (length,
masked CRC-32C of the length, the data, masked CRC-32C of the data) around ``tensorflow.Event`` protocol
buffers whose summary values are ``simple_value`` scalars, after a first event of ``file_version``
``brain.Event:2`` (so that TensorBoard keeps events whose steps go back, as they do when several workers
report).

**Files and uploads.** :class:`EventFileWriter` appends to a local file in a temporary folder of its own and
starts a new file once one holds :data:`MAX_FILE_BYTES`. :meth:`EventFileWriter.upload` writes the current
file, and each file closed since the last upload, to ``<prefix>/<file name>`` of the output storage with
:meth:`~edl_argo.storage.Storage.write`, which is atomic: a reader (TensorBoard, Argo's artifact upload)
sees an earlier complete upload of the file or the new one, and a master killed mid-upload leaves the
previous one. A file is read for its upload under the writer's lock, ending on a whole event; it is written
to storage outside it. File names carry the time, host and process, so a restarted master's files sit
beside those of the master before it.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from edl_argo.errors import StorageError
from edl_argo.log import get_logger
from edl_argo.storage import Storage

log = get_logger(__name__)

#: Where the event files go, relative to the job's ``--output``.
TENSORBOARD_PREFIX = "tensorboard"
#: A new event file starts once the current one holds this many bytes (each upload rewrites the current file
#: whole, so this bounds what one upload costs).
MAX_FILE_BYTES = 1 << 20
#: The version TensorBoard needs to read out-of-order steps without dropping earlier events.
FILE_VERSION = b"brain.Event:2"


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``, as TFRecord files use it."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: the CRC-32C rotated right by 15 bits plus ``0xa282ead8``, modulo 2**32."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tf_record(data: bytes) -> bytes:
    """``data`` framed as one TFRecord."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1  # int64 fields: a negative step takes ten bytes, as protobuf encodes it
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def event_bytes(
    wall_time: float, step: int, *, file_version: bytes = b"", scalar: tuple[str, float] | None = None
) -> bytes:
    """A ``tensorflow.Event`` (wall_time = 1, step = 2, file_version = 3, summary = 5) holding either
    ``file_version`` or one ``Summary.Value`` (tag = 1, simple_value = 2) ``scalar = (tag, value)``."""
    data = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3) + _varint(step)
    if file_version:
        data += _length_delimited(3, file_version)
    if scalar is not None:
        tag, value = scalar
        summary_value = _length_delimited(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", value)
        data += _length_delimited(5, _length_delimited(1, summary_value))
    return data


class EventFileWriter:
    """Scalar events in local event files, uploaded through ``storage`` under ``prefix`` (see the module
    docstring). Thread-safe; ``clock`` gives the events' wall time (default :func:`time.time`)."""

    def __init__(
        self,
        storage: Storage,
        prefix: str = TENSORBOARD_PREFIX,
        *,
        clock: Callable[[], float] = time.time,
        max_file_bytes: int = MAX_FILE_BYTES,
    ) -> None:
        self._storage = storage
        self._prefix = prefix.strip("/")
        self._clock = clock
        self._max_file_bytes = max_file_bytes
        self._lock = threading.Lock()
        self._upload_lock = threading.Lock()  # one upload at a time: files are written in order
        self._folder = Path(tempfile.mkdtemp(prefix="edl-tensorboard-"))
        self._files = 0
        self._current: Path | None = None
        self._size = 0
        #: Files to upload (the current one last), and whether each changed since its last upload.
        self._dirty: dict[Path, bool] = {}
        self._closed = False

    @property
    def url(self) -> str:
        """Where the files go, for messages."""
        return self._storage.describe(self._prefix)

    def scalar(self, tag: str, value: float, step: int, wall_time: float | None = None) -> None:
        """Append the scalar ``tag`` = ``value`` at ``step`` (ignored once closed; a local file that cannot
        be written is logged, and the event dropped: it never fails the caller)."""
        record = tf_record(
            event_bytes(self._clock() if wall_time is None else wall_time, step, scalar=(tag, float(value)))
        )
        with self._lock:
            if self._closed:
                return
            try:
                if self._current is None or self._size >= self._max_file_bytes:
                    self._start_file()
                assert self._current is not None
                with self._current.open("ab") as file:
                    file.write(record)
            except OSError as error:  # the local disk: the event is lost, the job goes on
                log.warning("tensorboard_write_failed", tag=tag, error=str(error))
                return
            self._size += len(record)
            self._dirty[self._current] = True

    def upload(self) -> bool:
        """Write every file changed since its last upload to storage; True if all went, else the
        failure is logged and the files are tried again on the next call."""
        with self._upload_lock:
            with self._lock:
                pending = [path for path, dirty in self._dirty.items() if dirty]
                try:
                    contents = {path: path.read_bytes() for path in pending}
                except OSError as error:
                    log.warning("tensorboard_upload_failed", url=self.url, error=str(error))
                    return False
                for path in pending:
                    self._dirty[path] = False
            for path in pending:
                key = f"{self._prefix}/{path.name}"
                try:
                    self._storage.write(key, contents[path])
                except StorageError as error:
                    log.warning("tensorboard_upload_failed", url=self.url, error=str(error))
                    with self._lock:
                        for unsent in pending[pending.index(path) :]:
                            if unsent in self._dirty:
                                self._dirty[unsent] = True
                    return False
            with self._lock:  # closed files that went up are done with
                for path in [p for p, dirty in self._dirty.items() if not dirty and p != self._current]:
                    del self._dirty[path]
            return True

    def close(self) -> bool:
        """Stop writing, upload what is left (see :meth:`upload`) and remove the local files; idempotent."""
        with self._lock:
            self._closed = True
        uploaded = self.upload()
        shutil.rmtree(self._folder, ignore_errors=True)
        return uploaded

    def _start_file(self) -> None:
        """With the lock held: a new event file, beginning with the file version event."""
        self._files += 1
        now = self._clock()
        name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.{self._files:06d}"
        self._current = self._folder / name
        header = tf_record(event_bytes(now, 0, file_version=FILE_VERSION))
        self._current.write_bytes(header)
        self._size = len(header)
        self._dirty[self._current] = True
