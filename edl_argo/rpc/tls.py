"""Optional TLS on the job's gRPC services: the master's and every parameter server's.

**The files.** A certificate ``tls.crt`` and its key ``tls.key`` (PEM), optionally the CA ``ca.crt`` that
signed the certificate: the keys of a Kubernetes Secret of type ``kubernetes.io/tls``. Locally they are a
folder (``--tls-dir``); on Kubernetes the Secret named by ``--tls-secret``, which the elastic-train step
mounts into the master's pod (the master reads no Secret through the API) and the master mounts read-only
into its worker and PS pods at :data:`POD_TLS_DIR` (their ``--tls-dir``).
:func:`load_tls_dir` / :func:`TlsFiles.from_pem` check them: a missing, unreadable or mismatched file is a
one-line :class:`~edl_argo.errors.ConfigError` naming the file and the setting, never its content.

**Servers** (the master, each PS) present ``tls.crt`` and serve TLS only: a plaintext client's connection
fails its handshake and none of its calls reaches the service. There are no client certificates: callers
are authenticated by the job's tokens (:mod:`edl_argo.rpc.auth`), which TLS now keeps off the wire.

**Clients** (workers, the master's PS pings and ``edl-argo scale``) trust ``ca.crt``, else ``tls.crt``
itself (a self-signed certificate), and check that the server's certificate names :data:`SERVER_NAME`
(``edl-argo``), whatever address they dialled (``grpc.ssl_target_name_override``). Pods dial each other by
pod IP, Service IP or Service name, which change from job to job and from pod to pod; one fixed name lets one
certificate serve every job of a namespace. So the certificate must carry ``DNS:edl-argo`` among its
subjectAltNames (other names may be there too).

**Not covered:** the AllreduceStrategy collective port (:mod:`edl_argo.collective.transport`), raw TCP
between workers, stays plaintext (authenticated by the collective token). A PS's tensor port
(:mod:`edl_argo.rpc.tensor_port`) is TLS when its gRPC port is, with the same certificate and checks
(:meth:`TlsFiles.server_context`, :meth:`TlsFiles.client_context`).
"""

from __future__ import annotations

import os
import ssl
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from edl_argo.errors import ConfigError

#: The name every client checks in the server's certificate (a DNS subjectAltName it must carry).
SERVER_NAME = "edl-argo"
#: The files of a TLS folder, as the keys of a ``kubernetes.io/tls`` Secret.
CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"
CA_FILE = "ca.crt"
#: Where worker and PS pods find the ``--tls-secret`` Secret (mounted read-only): their ``--tls-dir``.
POD_TLS_DIR = "/etc/edl-argo/tls"


@dataclass(frozen=True)
class TlsFiles:
    """A certificate, its key and the CA clients trust (``ca`` None: the certificate itself); PEM bytes.
    ``repr`` names where they came from, never the key."""

    certificate: bytes = field(repr=False)
    key: bytes = field(repr=False)
    ca: bytes | None = field(repr=False)
    source: str = ""

    @classmethod
    def from_pem(
        cls, certificate: bytes, key: bytes, ca: bytes | None, source: str, setting: str
    ) -> TlsFiles:
        """Checked files (``source`` and ``setting`` name them in errors): the certificate and key must be
        PEM and belong together, ``ca`` must be PEM."""
        _check_pair(certificate, key, source, setting)
        if ca is not None and b"-----BEGIN CERTIFICATE-----" not in ca:
            raise ConfigError(f"{setting}: {CA_FILE} of {source} is not a PEM certificate")
        return cls(certificate, key, ca, source)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.certificate)])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca or self.certificate)

    def server_context(self) -> ssl.SSLContext:
        """An ``ssl`` server context presenting the certificate (for a socket of our own: the PS's tensor
        port)."""
        return _server_context(self.certificate, self.key)

    def client_context(self) -> ssl.SSLContext:
        """An ``ssl`` client context that trusts the CA (else the certificate) and checks for
        :data:`SERVER_NAME`, as the gRPC clients do; wrap sockets with ``server_hostname=SERVER_NAME``."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.load_verify_locations(cadata=(self.ca or self.certificate).decode("ascii", errors="replace"))
        return context


#: Channel options of a TLS client: the name checked in the server's certificate.
CHANNEL_OPTIONS = (("grpc.ssl_target_name_override", SERVER_NAME),)


def load_tls_dir(folder: str, setting: str = "--tls-dir", *, server: bool = True) -> TlsFiles:
    """The TLS files of ``folder`` (``tls.crt``, ``tls.key``, optional ``ca.crt``); ConfigError naming the
    file at fault and ``setting``. ``server=False``: a client's, which needs no ``tls.key`` (``edl-argo
    scale``; its :meth:`TlsFiles.server_credentials` must not be used)."""
    path = Path(folder)
    if not path.is_dir():
        raise ConfigError(f"{setting} {folder}: not a folder (it holds {CERT_FILE}, {KEY_FILE}, {CA_FILE})")
    certificate = _read(path / CERT_FILE, setting)
    ca = _read(path / CA_FILE, setting) if (path / CA_FILE).exists() else None
    if not server:
        if b"-----BEGIN CERTIFICATE-----" not in certificate:
            raise ConfigError(f"{setting}: {CERT_FILE} of {path} is not a PEM certificate")
        return TlsFiles(certificate, b"", ca, str(path))
    key = _read(path / KEY_FILE, setting)
    return TlsFiles.from_pem(certificate, key, ca, str(path), setting)


def channel(address: str, tls: TlsFiles, options: list[tuple[str, object]]) -> grpc.Channel:
    """A TLS channel to ``address`` with ``options`` (see the module docstring for what it checks)."""
    return grpc.secure_channel(address, tls.channel_credentials(), options=[*options, *CHANNEL_OPTIONS])


def add_port(server: grpc.Server, address: str, tls: TlsFiles | None) -> int:
    """Listen on ``address``: TLS with ``tls``, plaintext without; the port bound (as ``add_*_port``)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


def _read(path: Path, setting: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{setting}: {path} is missing") from None
    except OSError as error:
        raise ConfigError(f"{setting}: {path} is unreadable ({error.strerror})") from None


def _server_context(certificate: bytes, key: bytes) -> ssl.SSLContext:
    """A server context of ``certificate`` and ``key`` (PEM); ``ssl.SSLError`` when they do not go
    together."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    # ssl loads a chain from files only: a private temporary folder, removed at once.
    with tempfile.TemporaryDirectory(prefix="edl-tls-") as scratch:
        cert_path, key_path = os.path.join(scratch, CERT_FILE), os.path.join(scratch, KEY_FILE)
        for target, data in ((cert_path, certificate), (key_path, key)):
            descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "wb") as file:
                file.write(data)
        context.load_cert_chain(cert_path, key_path, password="")
    return context


def _check_pair(certificate: bytes, key: bytes, source: str, setting: str) -> None:
    """The certificate and key parse and match (loaded into a throw-away ssl context, from memory)."""
    if b"-----BEGIN CERTIFICATE-----" not in certificate:
        raise ConfigError(f"{setting}: {CERT_FILE} of {source} is not a PEM certificate")
    if b"PRIVATE KEY-----" not in key:
        raise ConfigError(f"{setting}: {KEY_FILE} of {source} is not a PEM private key")
    try:
        _server_context(certificate, key)
    except ssl.SSLError as error:
        what = "does not match" if "KEY_VALUES_MISMATCH" in str(error) else "cannot be used with"
        raise ConfigError(
            f"{setting}: {KEY_FILE} of {source} {what} its {CERT_FILE} (an unencrypted PEM key of that"
            " certificate is needed)"
        ) from None
