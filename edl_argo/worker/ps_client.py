"""A worker's view of all parameter servers as one model store.

Dense variables go to the PS the model's layout places them on
(:class:`edl_argo.ps.partition.DensePlacement`, learnt in :meth:`ParameterServerClient.push_model`),
big ones cut into pieces first when the optimizer allows it (:mod:`edl_argo.ps.pieces`): values and
gradients are cut as they are pushed, and the pieces of every pull and push reply are joined, so callers
see whole variables by their model names only. Embedding rows go to the PS that owns their id
(:func:`edl_argo.ps.partition.embedding_owner`). Calls to several PS run in parallel. Every push goes to
every PS (with an empty partition where it owns nothing), so all PS count versions in step.

Synchronous SGD with several PS: PS 0 decides whether a minibatch is applied (see
:mod:`edl_argo.ps.servicer`). A push goes to all PS at once, but the other PS's requests end only
once PS 0 has accepted it, with the step PS 0 gave it (:class:`~edl_argo.rpc.chunked.PendingCall`): their
shares travel while PS 0 decides. When PS 0 refuses, their calls are cancelled before their requests end,
so a refused push changed nothing anywhere. A pull waits (up to
:data:`CONSISTENT_PULL_SECONDS`) until every other PS has applied PS 0's current step, so the gradients
of the next minibatch are computed from parameters of one step.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np

from edl_argo.errors import JobFailedError
from edl_argo.log import get_logger
from edl_argo.model.embedding_tables import EmbeddingTableSpec
from edl_argo.proto import ps_pb2, ps_pb2_grpc
from edl_argo.ps.partition import embedding_owner
from edl_argo.ps.pieces import DensePieces, MissingPieceError, join
from edl_argo.rpc import ps_layout
from edl_argo.rpc.auth import ClientCredential, credential_from_env
from edl_argo.rpc.channel import MAX_MESSAGE_BYTES, RPC_TIMEOUT_SECONDS, call_with_retry, make_channel
from edl_argo.rpc.chunked import ChunkedCall, PendingCall
from edl_argo.rpc.packed import encode_named, read_packed_ropes
from edl_argo.rpc.ps_layout import TENSOR_PORT_METHODS
from edl_argo.rpc.rope import Rope, merged, read_tensor_rope, split_rope, split_rope_fields
from edl_argo.rpc.tensor_port import PendingTensorCall, TensorCall, TensorPort
from edl_argo.rpc.tensors import from_indexed_slices, from_tensor, to_tensor
from edl_argo.rpc.tls import TlsFiles
from edl_argo.rpc.wire import Encoding
from edl_argo.worker.step_timers import STEP_TIMERS

log = get_logger(__name__)

T = TypeVar("T")

#: How long a pull waits for the other PS to apply PS 0's current step (synchronous SGD, several PS).
#: They lag only while a push accepted by PS 0 is on its way to them; a push that never comes (its worker
#: died in between, or a PS restarted from a checkpoint) costs this wait once, then the pull goes on.
CONSISTENT_PULL_SECONDS = 10.0


#: Dense parameters pulled (by model name; only those newer than the versions the caller held) and the
#: versions of every PS they are at.
Pulled = tuple[dict[str, np.ndarray], list[int]]


@dataclass(frozen=True)
class PushResult:
    """Whether the gradients were accepted, the model version each PS now holds (-1: not asked, after
    PS 0 refused), the synchronous step that applies them (0: asynchronous or refused), and, when the push
    asked for them, the parameters the replies carried (None: pull them; e.g. a PS behind PS 0)."""

    accepted: bool
    versions: tuple[int, ...]
    step: int = 0
    parameters: Pulled | None = None

    @property
    def version(self) -> int:
        return max(self.versions)


def _chunked(name: str) -> str:
    """The full name of the streaming twin of a parameter server method."""
    return f"/{ps_layout.CHUNKED_SERVICE}/{name}"


@dataclass(frozen=True)
class DenseAnswer:
    """A pull's answer, or the parameters a push's reply carries; ``values`` by name, each array the only
    copy of its bytes (:func:`~edl_argo.rpc.rope.read_tensor_rope`)."""

    initialized: bool
    version: int
    synced_step: int
    synchronous: bool
    values: dict[str, np.ndarray]

    @classmethod
    def parse(cls, data: Rope) -> DenseAnswer:
        """Decode a serialized ``PullDenseParametersResponse``, its tensors copied once from the chunks."""
        rest, large = split_rope_fields(data, (ps_layout.ANSWER_PARAMETERS, ps_layout.ANSWER_PACKED))
        fields = ps_pb2.PullDenseParametersResponse.FromString(rest)
        values = dict(read_tensor_rope(tensor) for tensor in large[ps_layout.ANSWER_PARAMETERS])
        values.update(read_packed_ropes(large[ps_layout.ANSWER_PACKED]))
        return cls(fields.initialized, fields.version, fields.synced_step, fields.synchronous, values)


@dataclass(frozen=True)
class PushReply:
    """A push's reply; ``parameters`` those it carries (not initialised and empty when it carries none)."""

    accepted: bool
    version: int
    step: int
    parameters: DenseAnswer

    @classmethod
    def parse(cls, data: Rope) -> PushReply:
        """Decode a serialized ``PushGradientsResponse`` (the parameters as :meth:`DenseAnswer.parse`)."""
        rest, carried = split_rope(data, ps_layout.REPLY_PARAMETERS)
        fields = ps_pb2.PushGradientsResponse.FromString(rest)
        parameters = DenseAnswer.parse(merged(carried))
        return cls(fields.accepted, fields.version, fields.step, parameters)


def push_request(
    fields: ps_pb2.PushGradientsRequest,
    dense: Mapping[str, np.ndarray],
    state_changes: Mapping[str, np.ndarray],
    sparse: Mapping[str, tuple[np.ndarray, np.ndarray]],
) -> Encoding:
    """The encoded ``PushGradientsRequest`` of ``fields`` (everything but the gradients) whose
    ``gradients`` (of version ``fields.version``) hold the ``dense`` gradients, the changes of non-trainable
    variables (``state_changes``) and, per table, ``(row_gradients, ids)``: each tensor's bytes copied once
    (:mod:`edl_argo.rpc.wire`), the small dense ones packed by dtype (:mod:`edl_argo.rpc.packed`)."""
    model = Encoding(ps_pb2.Model(version=fields.version))
    for tensor_field, packed_field, arrays in (
        ("dense_parameters", "packed_dense_parameters", dense),
        ("non_trainable_parameters", "packed_non_trainable_parameters", state_changes),
    ):
        encode_named(
            model, ps_layout.MODEL_FIELDS[tensor_field], ps_layout.MODEL_FIELDS[packed_field], arrays
        )
    for table, (values, ids) in sparse.items():
        slices = Encoding().tensor(1, values, table).tensor(2, np.asarray(ids, dtype=np.int64), table)
        model.message(
            ps_layout.MODEL_FIELDS["embedding_tables"], Encoding().string(1, table).message(2, slices)
        )
    return Encoding(fields).message(ps_layout.PUSH_GRADIENTS, model)


def _cancel(calls: Iterable[PendingCall[PushReply] | PendingTensorCall[PushReply]]) -> None:
    for call in calls:
        call.cancel()


class ParameterServerClient:
    """Pull and push model partitions across ``addresses`` (one per PS id, in id order)."""

    def __init__(
        self,
        addresses: Sequence[str],
        retry_budget_seconds: float = 300.0,
        rpc_timeout_seconds: float = RPC_TIMEOUT_SECONDS,
        credential: ClientCredential | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        """Every call has the deadline ``rpc_timeout_seconds`` and is retried for ``retry_budget_seconds``
        while its PS is unavailable or does not answer in time. Calls present ``credential`` (default: this
        process's), over TLS with ``tls`` (:mod:`edl_argo.rpc.tls`)."""
        if not addresses:
            raise ValueError("at least one parameter server address is needed")
        self._addresses = list(addresses)
        credential = credential if credential is not None else credential_from_env()
        channels = [make_channel(a, credential, tls) for a in self._addresses]
        self._stubs = [ps_pb2_grpc.ParameterServerStub(channel) for channel in channels]
        # Pushes and dense pulls, whose messages scale with the model, travel on the PS's tensor port
        # (edl_argo.rpc.tensor_port), or as streams of chunks over gRPC (edl_argo.rpc.chunked) where it has
        # none; pushes pre-encoded, and the parameters of replies and pulls read from the answer's pieces
        # into memory the variables then share (received there by the tensor port, copied once from gRPC's
        # chunks: edl_argo.rpc.rope).
        self._tensor_ports = [
            TensorPort(
                f"ps-{ps_id} {address}",
                self._locator(ps_id),
                credential,
                tls.client_context() if tls is not None else None,
            )
            for ps_id, address in enumerate(self._addresses)
        ]

        def calls(method: str, parse: Callable[[Rope], T]) -> list[TensorCall[T]]:
            number = TENSOR_PORT_METHODS.index(method) + 1
            return [
                TensorCall(
                    port, number, parse, ChunkedCall(channel, _chunked(method), parse, MAX_MESSAGE_BYTES)
                )
                for port, channel in zip(self._tensor_ports, channels, strict=True)
            ]

        self._pushes = calls("PushGradients", PushReply.parse)
        self._pulls = calls("PullDenseParameters", DenseAnswer.parse)
        self._budget = retry_budget_seconds
        self._timeout = rpc_timeout_seconds
        self._pool = ThreadPoolExecutor(max_workers=len(addresses)) if len(addresses) > 1 else None
        # Every push carries this client's id and its number, so that a PS applies a retried push once.
        self._pusher_id = uuid.uuid4().hex
        self._push_numbers = itertools.count(1)
        #: Whether the PS run synchronous SGD (learnt from every pull).
        self.synchronous = False
        #: The pieces of the dense variables and which PS holds each (from :meth:`push_model`; pushes need
        #: them with several PS).
        self._pieces: DensePieces | None = None

    @property
    def num_ps(self) -> int:
        return len(self._stubs)

    def _locator(self, ps_id: int) -> Callable[[float], str]:
        """How a PS's tensor port is found: the address its ``GetStatus`` names ("" for none)."""

        def locate(timeout: float) -> str:
            return str(self._stubs[ps_id].GetStatus(ps_pb2.GetStatusRequest(), timeout=timeout).tensor_port)

        return locate

    def _each(self, fn: Callable[[int], T], ps_ids: Sequence[int] | None = None) -> list[T]:
        """``fn(ps_id)`` for every PS (or those of ``ps_ids``), in parallel when there are several;
        results in id order."""
        ids = range(self.num_ps) if ps_ids is None else ps_ids
        with STEP_TIMERS.section("ps"):
            if self._pool is None or len(ids) == 1:
                return [fn(i) for i in ids]
            return list(self._pool.map(fn, ids))

    def _call(self, ps_id: int, method: str, request: object) -> object:
        if method == "PushGradients":
            rpc = self._pushes[ps_id]
        elif method == "PullDenseParameters":
            rpc = self._pulls[ps_id]
        else:
            rpc = getattr(self._stubs[ps_id], method)
        return call_with_retry(
            lambda timeout: rpc(request, timeout=timeout),
            f"ps-{ps_id} {self._addresses[ps_id]}",
            self._budget,
            self._timeout,
        )

    def push_model(
        self,
        dense: Mapping[str, np.ndarray],
        tables: Iterable[EmbeddingTableSpec],
        non_trainable: Mapping[str, np.ndarray] | None = None,
        constraints: Mapping[str, str] | None = None,
        elementwise: bool = False,
    ) -> bool:
        """Offer initial parameters (trainable and non-trainable, with the trainable variables' constraints);
        each PS keeps the first model it is offered. True if any took ours.

        ``elementwise``: the model's optimizer updates elementwise
        (:func:`edl_argo.model.optimizer.updates_elementwise`), so big trainable variables without a
        constraint may be cut into pieces (:class:`DensePieces`). Every PS is told the model's whole dense
        layout, and this client cuts and places dense values by it from now on: call this before pushing
        to several PS."""
        infos = [
            ps_pb2.EmbeddingTableInfo(
                name=t.name, dim=t.dim, dtype=t.dtype, initializer=t.initializer, constraint=t.constraint
            )
            for t in tables
        ]
        shapes = {name: (v.shape, v.dtype) for name, v in [*dense.items(), *(non_trainable or {}).items()]}
        splittable = set(dense) - set(constraints or {}) if elementwise else set()
        self._pieces = DensePieces.of(shapes, splittable, self.num_ps)
        layout = dict(self._pieces.layout)
        by_owner = self._split_dense(self._pieces.split(dense))
        state_by_owner = self._split_dense(non_trainable or {})
        constraints_by_owner = self._split_dense(constraints or {})

        def push(ps_id: int) -> bool:
            model = ps_pb2.Model(
                dense_parameters=[to_tensor(v, n) for n, v in by_owner[ps_id].items()],
                non_trainable_parameters=[to_tensor(v, n) for n, v in state_by_owner[ps_id].items()],
                constraints=constraints_by_owner[ps_id],
                embedding_table_infos=infos,
                dense_layout=layout,
            )
            return bool(self._call(ps_id, "PushModel", model).accepted)

        return any(self._each(push))

    def pull_dense(
        self,
        versions: Sequence[int],
        consistent_within: float = CONSISTENT_PULL_SECONDS,
        finalized: bool = False,
    ) -> tuple[dict[str, np.ndarray], list[int], bool]:
        """Dense parameters, trainable and non-trainable, newer than ``versions`` (one per PS; -1 for none);
        ``finalized``: all of them as ``fit`` ends with them (EMA averages; for export).

        Synchronous SGD with several PS: pulls again (for up to ``consistent_within`` seconds) until every
        PS has applied PS 0's current step. Returns the changed parameters, the versions now held, and
        whether every PS is initialised.
        """
        held = list(versions)

        def pull(ps_id: int) -> DenseAnswer:
            request = ps_pb2.PullDenseParametersRequest(version=held[ps_id], finalized=finalized)
            return self._call(ps_id, "PullDenseParameters", request)

        def pull_all(ps_id: int) -> DenseAnswer:
            request = ps_pb2.PullDenseParametersRequest(version=-1, finalized=finalized)
            return self._call(ps_id, "PullDenseParameters", request)

        deadline = time.monotonic() + consistent_within
        pause = 0.005
        values: dict[str, np.ndarray] = {}
        while True:
            joined, responses = self._completed(self._each(pull), pull_all)
            values.update(joined)
            held = [r.version for r in responses]
            initialized = all(r.initialized for r in responses)
            lagging = self._lagging(responses)
            if not initialized or not lagging:
                return values, held, initialized
            if time.monotonic() >= deadline:
                log.warning(
                    "ps_behind_authority",
                    ps=lagging,
                    step=responses[0].version,
                    synced=[r.synced_step for r in responses],
                    versions=held,
                )
                return values, held, initialized
            time.sleep(pause)
            pause = min(0.1, pause * 2)

    def _completed(
        self, answers: list[DenseAnswer], pull_all: Callable[[int], DenseAnswer]
    ) -> tuple[dict[str, np.ndarray], list[DenseAnswer]]:
        """The parameters of pull answers (one per PS, in id order) by model name, pieces joined
        (:func:`join`), and the answers they are of.

        A PS answers all its variables or none (the caller held its current version). When one answered
        pieces of a variable whose other pieces are on one that answered none (it had not applied a push
        the first had), every PS that answered none is asked again for all its variables
        (``pull_all(ps_id)``), once; pieces then still missing are a :class:`MissingPieceError`. When pieces
        are missing because a PS is not initialised, no parameter is returned (the caller offers the model
        again)."""
        try:
            return join(self._values_of(answers)), answers
        except MissingPieceError:
            if not all(answer.initialized for answer in answers):
                return {}, answers
            silent = [ps_id for ps_id, answer in enumerate(answers) if not answer.values]
            if not silent:
                raise
        answers = list(answers)
        for ps_id, answer in zip(silent, self._each(pull_all, silent), strict=True):
            answers[ps_id] = answer
        return join(self._values_of(answers)), answers

    @staticmethod
    def _values_of(responses: Sequence[DenseAnswer]) -> dict[str, np.ndarray]:
        """The parameters of pull answers by the names the PS hold them by (pieces apart; read-only views
        of the replies' bytes)."""
        return {name: value for r in responses for name, value in r.values.items()}

    def _lagging(self, responses: Sequence[DenseAnswer]) -> list[int]:
        """The PS whose pull answers (one per PS, in id order) are of a step before PS 0's (synchronous SGD);
        learns from PS 0's answer whether the PS run synchronous SGD."""
        self.synchronous = responses[0].synchronous
        return [
            ps_id
            for ps_id, r in enumerate(responses[1:], start=1)
            if self.synchronous and 0 <= r.synced_step < responses[0].version
        ]

    def _carried(self, responses: Sequence[PushReply]) -> Pulled | None:
        """The parameters the push replies of every PS (in id order) carry, by model name (pieces joined),
        if they are of one step, every PS is initialised and no piece is missing; else None (the caller
        pulls)."""
        answers = [r.parameters for r in responses]
        if not all(a.initialized for a in answers) or self._lagging(answers):
            return None
        try:
            return join(self._values_of(answers)), [a.version for a in answers]
        except MissingPieceError:
            return None

    def pull_embeddings(
        self, lookups: Sequence[tuple[str, np.ndarray]], tables: Mapping[str, EmbeddingTableSpec]
    ) -> list[np.ndarray]:
        """Rows for each ``(table, ids)`` lookup, in that order; one call per PS for all of them.

        Rows are created on the PS on first pull.
        """
        lookups = [(table, np.asarray(ids, dtype=np.int64)) for table, ids in lookups]
        owners = [embedding_owner(ids, self.num_ps) for _, ids in lookups]
        results = [np.empty((len(ids), tables[t].dim), dtype=tables[t].dtype) for t, ids in lookups]

        def pull(ps_id: int) -> None:
            positions = [np.flatnonzero(o == ps_id) for o in owners]
            wanted = [i for i, p in enumerate(positions) if p.size]
            if not wanted:
                return
            request = ps_pb2.PullEmbeddingVectorsBatchRequest(
                lookups=[
                    ps_pb2.PullEmbeddingVectorsRequest(
                        name=lookups[i][0], ids=to_tensor(lookups[i][1][positions[i]])
                    )
                    for i in wanted
                ]
            )
            response = self._call(ps_id, "PullEmbeddingVectorsBatch", request)
            for i, rows in zip(wanted, response.rows, strict=True):
                results[i][positions[i]] = from_tensor(rows)

        self._each(pull)
        return results

    def pull_embedding_table(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        """Every row held of ``table`` across all PS, as ``(values, ids)`` (for model export)."""

        def pull(ps_id: int) -> tuple[np.ndarray, np.ndarray]:
            request = ps_pb2.PullEmbeddingTableRequest(name=table)
            return from_indexed_slices(self._call(ps_id, "PullEmbeddingTable", request))

        parts = self._each(pull)
        return np.concatenate([v for v, _ in parts]), np.concatenate([i for _, i in parts])

    def push_gradients(
        self,
        dense: Mapping[str, np.ndarray],
        sparse: Mapping[str, tuple[np.ndarray, np.ndarray]],
        versions: Sequence[int],
        learning_rate_scale: float = 1.0,
        state_changes: Mapping[str, np.ndarray] | None = None,
        examples: int = 0,
        return_parameters: bool = False,
    ) -> PushResult:
        """Push one minibatch's gradients; ``sparse`` maps a table to ``(row_gradients, ids)``,
        ``state_changes`` how the minibatch's forward pass changed each non-trainable variable (the PS adds
        them), ``examples`` its size.

        ``return_parameters``: the replies carry the dense parameters newer than ``versions`` as a pull
        right after the push would get them (:attr:`PushResult.parameters`), so the caller skips that pull.
        With several synchronous PS, a refused push carries none (PS 0 alone answered)."""
        sequence = next(self._push_numbers)
        dense_by_owner = self._split_dense(dense if self._pieces is None else self._pieces.split(dense))
        state_by_owner = self._split_dense(state_changes or {})
        sparse_by_owner: list[dict[str, tuple[np.ndarray, np.ndarray]]] = [{} for _ in range(self.num_ps)]
        for table, (values, ids) in sparse.items():
            owners = embedding_owner(ids, self.num_ps)
            for ps_id in range(self.num_ps):
                mask = owners == ps_id
                if mask.any():
                    sparse_by_owner[ps_id][table] = (values[mask], ids[mask])

        def request(ps_id: int, authority_step: int = 0) -> Encoding:
            fields = ps_pb2.PushGradientsRequest(
                version=versions[ps_id],
                learning_rate_scale=learning_rate_scale,
                authority_step=authority_step,
                examples=examples,
                return_parameters=return_parameters,
                pusher_id=self._pusher_id,
                sequence=sequence,
            )
            return push_request(fields, dense_by_owner[ps_id], state_by_owner[ps_id], sparse_by_owner[ps_id])

        def push(ps_id: int, authority_step: int = 0) -> PushReply:
            return self._call(ps_id, "PushGradients", request(ps_id, authority_step))

        if not self.synchronous or self.num_ps == 1:
            responses = self._each(push)
            return PushResult(
                all(r.accepted for r in responses),
                tuple(r.version for r in responses),
                responses[0].step,
                self._carried(responses) if return_parameters else None,
            )
        # PS 0 decides for all. The others receive their share meanwhile, all but the step PS 0 gives it,
        # which ends their requests once PS 0 accepted; when it refused, their calls are cancelled before
        # their requests end, and they never read them.
        with STEP_TIMERS.section("ps"):
            followers = range(1, self.num_ps)
            pending = {ps_id: self._pushes[ps_id].start(request(ps_id), self._timeout) for ps_id in followers}
            try:
                decision = push(0)
            except BaseException:
                _cancel(pending.values())
                raise
        if not decision.accepted:
            _cancel(pending.values())
            return PushResult(False, (decision.version,) + (-1,) * (self.num_ps - 1))
        tail = ps_pb2.PushGradientsRequest(authority_step=decision.step).SerializeToString()

        def follow(ps_id: int) -> PushReply:
            try:
                return pending[ps_id].finish(tail)
            except grpc.RpcError as error:
                # Sent again whole, with its retries: a PS that applied it already answers as it did.
                log.info("push_sent_again", ps=ps_id, code=str(error.code()), step=decision.step)
                return push(ps_id, decision.step)

        replies = self._each(follow, followers)
        if not all(r.accepted for r in replies):
            raise JobFailedError("a PS refused a push PS 0 accepted: do the PS run different settings?")
        return PushResult(
            True,
            (decision.version, *(r.version for r in replies)),
            decision.step,
            self._carried([decision, *replies]) if return_parameters else None,
        )

    def status(self, apply_pending: bool = False) -> list[ps_pb2.ParameterServerStatus]:
        """Every PS's version and push counts, in id order; ``apply_pending`` first applies the pushes a
        synchronous step still waits for (at the end of training)."""
        request = ps_pb2.GetStatusRequest(apply_pending=apply_pending)
        return self._each(lambda ps_id: self._call(ps_id, "GetStatus", request))

    def _split_dense(self, values: Mapping[str, T]) -> list[dict[str, T]]:
        """``values`` by the names the PS hold them by (pieces cut already), one mapping per PS."""
        if self.num_ps == 1:
            return [dict(values)]
        if self._pieces is None:
            raise RuntimeError("push_model() places the dense variables on the PS: call it before pushing")
        return self._pieces.placement.split(values)

    def close(self) -> None:
        for port in self._tensor_ports:
            port.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
