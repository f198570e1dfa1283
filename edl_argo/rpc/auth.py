"""Authenticated job traffic: the per-job secret, the credentials derived from it, and their checks.

**The secret.** The master makes a :class:`JobSecret` (32 random bytes) when a job starts and keeps it
across its own restarts (Kubernetes: the Secret ``<job>-auth`` it creates and owns; the local backend: a
file beside its state, :mod:`edl_argo.master.state_store`). It never appears in an argument list, a
manifest or a log line.

**Credentials.** A caller names an *identity* (``worker-3``, ``ps-0``, ``master``, ``admin``) and proves it
with its *token*, ``HMAC-SHA256(secret, identity)`` in hex. Each gRPC call carries both as metadata
(:data:`IDENTITY_KEY`, :data:`TOKEN_KEY`). A worker pod gets only its own token (and the collective
token), never the secret, so it cannot speak as another worker; parameter servers get the secret, as they
check the tokens of the calls they serve. What a process presents comes from its environment
(:func:`credential_from_env`):

* :data:`TOKEN_ENV` + :data:`IDENTITY_ENV`: that identity and token (a worker pod);
* :data:`SECRET_ENV`: the secret itself, presented as :data:`IDENTITY_ENV` (default ``admin``): a PS pod,
  or a person running ``edl-argo scale``.

**Checks.** :func:`server_interceptor` refuses, with ``UNAUTHENTICATED``, every call whose token is
missing or is not the token of its identity under this job's secret (another job's token, a wrong one):
compared with :func:`hmac.compare_digest`, logged once per peer host (``call_unauthenticated``), the
request never reaching the service. :func:`require_identity` then lets a service refuse, with
``PERMISSION_DENIED``, a call that names worker N but comes from another identity.

**The collective port** (:mod:`edl_argo.collective.transport`) carries :func:`JobSecret.collective_token`,
which every worker of the job holds (:data:`COLLECTIVE_ENV`): a connection must present it before the port
reads a frame or serves a state.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from edl_argo.errors import ConfigError
from edl_argo.log import get_logger

log = get_logger(__name__)

#: The job secret, hex (the master's PS pods; an operator's ``edl-argo scale``).
SECRET_ENV = "EDL_JOB_SECRET"
#: The identity a process presents (``worker-3``, ``ps-0``; default ``admin`` with the secret).
IDENTITY_ENV = "EDL_AUTH_IDENTITY"
#: A worker pod's own token (hex HMAC of its identity).
TOKEN_ENV = "EDL_AUTH_TOKEN"
#: The token every worker presents to, and requires on, the collective port.
COLLECTIVE_ENV = "EDL_COLLECTIVE_TOKEN"
#: Every environment variable that carries a credential: a pod inherits none of them from its master.
CREDENTIAL_ENV = (SECRET_ENV, IDENTITY_ENV, TOKEN_ENV, COLLECTIVE_ENV)
#: gRPC metadata keys of a call's credential.
IDENTITY_KEY = "edl-identity"
TOKEN_KEY = "edl-token"
#: Bytes of a fresh secret, and of every token (SHA-256).
SECRET_BYTES = 32
TOKEN_BYTES = 32
#: Identities the secret's holders present: the master, and an operator's tool.
MASTER_IDENTITY = "master"
ADMIN_IDENTITY = "admin"
#: Who may steer the job (``ScaleWorkers``): the secret's holders, not the pods.
OPERATOR_IDENTITIES = (ADMIN_IDENTITY, MASTER_IDENTITY)
#: At most this many peers are remembered as already logged (then the memory starts over).
LOGGED_PEERS_CAP = 1024


def pod_identity(role: str, pod_id: int) -> str:
    """The identity of pod ``pod_id`` of ``role`` (``"worker"``/``"ps"``): ``worker-3``, ``ps-0``."""
    return f"{role}-{pod_id}"


@dataclass(frozen=True)
class ClientCredential:
    """What a caller presents: an identity and its token (hex). ``repr`` hides the token."""

    identity: str
    token: str

    def __repr__(self) -> str:
        return f"ClientCredential(identity={self.identity!r})"

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((IDENTITY_KEY, self.identity), (TOKEN_KEY, self.token))


class JobSecret:
    """One job's secret and what derives from it. ``repr``/``str`` never show it."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("a job secret has at least 16 bytes")
        self._secret = bytes(secret)

    @classmethod
    def generate(cls) -> JobSecret:
        return cls(secrets.token_bytes(SECRET_BYTES))

    @classmethod
    def from_hex(cls, text: str, source: str) -> JobSecret:
        """The secret written as hex in ``source`` (named in the error, never the value)."""
        try:
            return cls(bytes.fromhex(text.strip()))
        except ValueError:
            raise ConfigError(f"{source}: not a job secret (at least 32 hex digits)") from None

    def __repr__(self) -> str:
        return "JobSecret(<hidden>)"

    def hex(self) -> str:
        return self._secret.hex()

    def token(self, identity: str) -> str:
        """The token of ``identity``: ``HMAC-SHA256(secret, identity)`` in hex."""
        return hmac.new(self._secret, identity.encode(), hashlib.sha256).hexdigest()

    def credential(self, identity: str) -> ClientCredential:
        return ClientCredential(identity, self.token(identity))

    def collective_token(self) -> bytes:
        """What the job's workers present on each other's collective ports."""
        return hmac.new(self._secret, b"collective", hashlib.sha256).digest()

    def verify(self, identity: str, token: str) -> bool:
        """Whether ``token`` is ``identity``'s token under this secret (constant time)."""
        return hmac.compare_digest(self.token(identity).encode(), token.encode())

    def pod_env(self, role: str, pod_id: int) -> dict[str, str]:
        """The credentials of pod ``pod_id`` of ``role`` as environment variables: a PS gets the secret
        (it checks callers), a worker its own token and the collective token."""
        identity = pod_identity(role, pod_id)
        if role == "ps":
            return {SECRET_ENV: self.hex(), IDENTITY_ENV: identity}
        return {
            IDENTITY_ENV: identity,
            TOKEN_ENV: self.token(identity),
            COLLECTIVE_ENV: self.collective_token().hex(),
        }


def secret_from_env(environ: Mapping[str, str] | None = None) -> JobSecret | None:
    """The job secret of :data:`SECRET_ENV`, or None when it is not set."""
    text = (os.environ if environ is None else environ).get(SECRET_ENV, "")
    return JobSecret.from_hex(text, SECRET_ENV) if text else None


def credential_from_env(environ: Mapping[str, str] | None = None) -> ClientCredential | None:
    """What this process presents (see the module docstring), or None when it has no credential."""
    env = os.environ if environ is None else environ
    identity = env.get(IDENTITY_ENV, "")
    if env.get(TOKEN_ENV):
        if not identity:
            raise ConfigError(f"{TOKEN_ENV} is set without {IDENTITY_ENV}: the token of which identity?")
        return ClientCredential(identity, env[TOKEN_ENV])
    secret = secret_from_env(env)
    return secret.credential(identity or ADMIN_IDENTITY) if secret is not None else None


def collective_token_from_env(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The collective token of :data:`COLLECTIVE_ENV` (or derived from :data:`SECRET_ENV`), or None."""
    env = os.environ if environ is None else environ
    text = env.get(COLLECTIVE_ENV, "")
    if text:
        try:
            token = bytes.fromhex(text)
        except ValueError:
            token = b""
        if len(token) != TOKEN_BYTES:
            raise ConfigError(f"{COLLECTIVE_ENV}: not a collective token ({2 * TOKEN_BYTES} hex digits)")
        return token
    secret = secret_from_env(env)
    return secret.collective_token() if secret is not None else None


# ---------------------------------------------------------------------------------------------- client


class _ClientInterceptor(
    grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor, grpc.StreamStreamClientInterceptor
):
    """Adds a credential to every call of a channel."""

    def __init__(self, credential: ClientCredential) -> None:
        self._metadata = credential.metadata()

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            (*(details.metadata or ()), *self._metadata),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Callable, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_stream(self, continuation: Callable, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


def authenticated(channel: grpc.Channel, credential: ClientCredential | None) -> grpc.Channel:
    """``channel`` presenting ``credential`` on every call (``channel`` itself when None)."""
    return channel if credential is None else grpc.intercept_channel(channel, _ClientInterceptor(credential))


# ---------------------------------------------------------------------------------------------- server


class PeersLogged:
    """Peer hosts already logged as refused: one line per peer, however many calls it makes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set[str] = set()

    def first(self, peer: str) -> bool:
        with self._lock:
            if peer in self._seen:
                return False
            if len(self._seen) >= LOGGED_PEERS_CAP:
                self._seen.clear()
            self._seen.add(peer)
            return True


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string (``ipv4:10.0.0.3:51234`` -> ``ipv4:10.0.0.3``)."""
    if peer.startswith("ipv6:"):
        return peer.rsplit(":", 1)[0] if "]" in peer else peer
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


class _ServerInterceptor(grpc.ServerInterceptor):
    def __init__(self, secret: JobSecret, service: str) -> None:
        self._secret = secret
        self._service = service
        self._logged = PeersLogged()

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        metadata = dict(details.invocation_metadata or ())
        identity, token = metadata.get(IDENTITY_KEY), metadata.get(TOKEN_KEY)
        if isinstance(identity, str) and isinstance(token, str) and self._secret.verify(identity, token):
            return continuation(details)
        reason = "no credential" if token is None else "wrong credential"
        return self._refusal(details.method, reason)

    def _refusal(self, method: str, reason: str) -> grpc.RpcMethodHandler:
        def refuse(_requests: Any, context: grpc.ServicerContext) -> None:
            peer = peer_host(context.peer())
            if self._logged.first(peer):
                log.warning(
                    "call_unauthenticated", service=self._service, peer=peer, method=method, reason=reason
                )
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{self._service}: {reason} for this job")

        # A streaming-request handler: the refusal does not wait for (nor parse) the request's body.
        return grpc.stream_unary_rpc_method_handler(refuse)


def server_interceptor(secret: JobSecret, service: str) -> grpc.ServerInterceptor:
    """Refuses every call to ``service`` (``master``, ``ps-0``: named in logs) without a valid credential."""
    return _ServerInterceptor(secret, service)


#: Denied (caller, method) pairs already logged: one line each, however often a buggy worker retries.
_DENIALS_LOGGED = PeersLogged()


def caller_identity(context: grpc.ServicerContext | None) -> str | None:
    """The identity a call presented (checked by :func:`server_interceptor` when the server has one);
    None for a call without one, or made in-process (no ``context``: tests call servicers directly)."""
    if context is None:
        return None
    for key, value in context.invocation_metadata() or ():
        if key == IDENTITY_KEY and isinstance(value, str):
            return value
    return None


def require_identity(context: grpc.ServicerContext | None, rpc: str, *identities: str) -> None:
    """End the call with PERMISSION_DENIED unless it came from one of ``identities`` (a call naming
    worker N must come from worker N; logged once per caller and method as ``call_denied``). A call
    without an identity reached a server without authentication (the interceptor refuses it on every
    other): allowed."""
    caller = caller_identity(context)
    if caller is None or caller in identities:
        return
    if _DENIALS_LOGGED.first(f"{caller} {rpc}"):
        log.warning("call_denied", rpc=rpc, caller=caller, allowed=",".join(identities))
    context.abort(
        grpc.StatusCode.PERMISSION_DENIED, f"{rpc}: {caller} cannot act as {' or '.join(identities)}"
    )
    raise AssertionError("unreachable: context.abort raises")
