"""The gRPC service of one parameter server (``edl_argo.ParameterServer`` in ``ps.proto``).

Two ways to apply the gradients workers push:

* **Asynchronous** (``use_async=True``): each push is applied on arrival as one optimizer step and the
  version advances by one. With ``lr_staleness_modulation`` the learning rate of that step is multiplied by
  ``1 / max(1, version - push.version)``, so gradients computed against an old model move it less.
* **Synchronous** (default): pushes are accumulated until ``grads_to_wait`` have been accepted; their mean
  weighted by each push's ``examples`` (dense gradients summed, sparse rows concatenated, each times its
  push's examples, divided by the examples of all; a variable missing from a push counts as a zero
  gradient) is applied as one step and the version advances by one. Accepted
  pushes still waiting for their step are not part of checkpoints. A push computed against a version
  older than ``version - sync_version_tolerance``, or newer than ``version + sync_version_tolerance`` (a
  worker that has not pulled since this server restarted from an older checkpoint), is refused
  (``accepted=false``, nothing changes): the worker pulls and recomputes.
  ``GetStatus(apply_pending=true)`` (the master, when training ends) applies the pushes still waiting as
  one last step: their mean, weighted by examples as a full step's.

**Several PS, synchronous**: PS 0 is the authority. PS 0 decides as above and answers the ``step`` (its
version + 1 while the step accumulates) the push belongs to. The other PS receive their share meanwhile, but
its request ends only once PS 0 accepted, with ``authority_step`` set (its last bytes); a request that never
ends is never read (:mod:`edl_argo.rpc.chunked`). So only an accepted push reaches them, and they apply it
without a staleness check of their own, so every PS applies the same minibatches, each at most once, and
counts its versions in step with PS 0. A follower reports in every pull the authority step it applied last
(``synced_step``), from which a worker tells whether the parameters it pulled from all PS are of one step.

A push also carries how its forward pass changed the non-trainable variables (BatchNormalization's moving
statistics): the PS adds the change, with the push (asynchronous) or averaged like the gradients over the
step (synchronous). A change, not a value: a push computed from values other pushes have moved since (any
asynchronous push but the first, or pipelined) still adds its own, as a gradient does, where a value would
undo theirs.

The optimizer is the model's, without the steps the worker takes of it
(:func:`~edl_argo.model.train_step.ps_optimizer_factory`). A pull with ``finalized`` (for export) returns
the values ``fit`` would end with (EMA averages).

A push's ``learning_rate_scale`` (1 when unset) multiplies the learning rate of the step that applies it;
in synchronous mode the step uses the mean scale of the pushes it averages.

A push is applied at most once: one that repeats a push already decided (a retry after the caller's
deadline ran out) is answered from :class:`~edl_argo.ps.push_memory.PushMemory` instead of being applied.

Every request is validated before anything changes (the bounds are in :mod:`edl_argo.ps.bounds`). A push
whose gradients or values hold a NaN or an infinity is refused with ``INVALID_ARGUMENT`` and counted
(``pushes_non_finite`` of ``GetStatus``); a request that would go beyond the server's resource bounds (new
embedding rows past ``--max-embedding-rows``, a pull whose reply would pass the message limit) ends with
``RESOURCE_EXHAUSTED`` and creates nothing. A malformed or mismatched request (unknown variable or
table, wrong dtype or shape, undecodable tensor, id of another server, negative id) ends with
``INVALID_ARGUMENT``;
a request the server cannot serve yet (a push or pull before the first PushModel, a learning-rate scale
with a learning-rate schedule) with ``FAILED_PRECONDITION``; both with a one-line reason naming the
variable or table. The server keeps serving either way.

Thread safety: one lock serialises every state change and every read of the parameters; decoding and
encoding of large messages happen outside it where possible, and the response carrying all dense parameters is
built once per version and shared by every worker that pulls that version.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
import numpy as np

from edl_argo.checkpoint import Checkpointer
from edl_argo.errors import ConfigError, EdlError
from edl_argo.log import get_logger
from edl_argo.model.optimizer import OptimizerFactory
from edl_argo.model.train_step import ps_optimizer_factory
from edl_argo.proto import ps_pb2, ps_pb2_grpc, tensor_pb2
from edl_argo.ps import bounds
from edl_argo.ps.errors import NonFiniteGradientError, ResourceLimitError
from edl_argo.ps.optimizer import LearningRateScaleError, check_optimizer_factory
from edl_argo.ps.parameters import (
    Gradients,
    InvalidRequestError,
    NotInitializedError,
    Parameters,
    ParametersState,
)
from edl_argo.ps.push_memory import PushMemory, PushOutcome
from edl_argo.ps.pushed import PushedGradients, PushedModel
from edl_argo.rpc import ps_layout
from edl_argo.rpc.channel import reject_request
from edl_argo.rpc.packed import encode_named
from edl_argo.rpc.tensors import TensorDecodeError, fill_tensor, from_tensor, to_indexed_slices, to_tensor
from edl_argo.rpc.wire import Encoding

log = get_logger(__name__)


_Response = TypeVar("_Response")


def _rpc(
    method: Callable[[Any, Any, grpc.ServicerContext], _Response],
) -> Callable[[Any, Any, grpc.ServicerContext], _Response]:
    """Turn the exceptions of a request into its gRPC status (see the module's docstring)."""

    @functools.wraps(method)
    def handle(self: Any, request: Any, context: grpc.ServicerContext) -> _Response:
        name = method.__name__
        try:
            return method(self, request, context)
        except (InvalidRequestError, TensorDecodeError) as error:
            reject_request(context, name, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except ResourceLimitError as error:
            reject_request(context, name, grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except (NotInitializedError, LearningRateScaleError, EdlError) as error:
            reject_request(context, name, grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except Exception as error:
            log.error("request_failed", exc_info=True, rpc=name)
            reject_request(
                context, name, grpc.StatusCode.INTERNAL, f"parameter server failed: {type(error).__name__}"
            )

    return handle


def _non_negative_ids(table: str, ids: np.ndarray) -> np.ndarray:
    """``ids`` of embedding table ``table``, unless one is negative (:class:`InvalidRequestError`): ids
    index the rows of a Keras ``Embedding`` layer, from 0, and rows of negative ids would be trained but
    never make it into the exported model."""
    if ids.size and ids.dtype.kind == "i" and int(ids.min()) < 0:
        raise InvalidRequestError(
            f"embedding table {table!r}: id {int(ids.min())} is negative; ids index the rows of an"
            " Embedding layer, from 0"
        )
    return ids


class _Accumulator:
    """The pushes of one synchronous step, summed (each weighted by its examples) until there are enough."""

    def __init__(self) -> None:
        self.count = 0
        #: The first push and its weight while it is the only one.
        self._first: tuple[Gradients, int] | None = None
        self._dense: dict[str, np.ndarray] = {}
        self._sparse: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._state: dict[str, np.ndarray] = {}
        self._weight = 0
        self._scale_sum = 0.0
        #: The newest step of PS 0 among the pushes PS 0 decided (-1: none).
        self.authority_step = -1

    def add(self, gradients: Gradients, lr_scale: float, examples: int = 0, authority_step: int = 0) -> None:
        """Add one push of the mean gradients over ``examples`` examples (0 counts as 1); ``authority_step``
        is the step PS 0 accepted it for (0: this PS decides)."""
        if authority_step > 0:
            self.authority_step = max(self.authority_step, authority_step)
        weight = max(1, examples)
        if self.count == 0:  # kept as it came: a step of one push applies it unchanged (and uncopied)
            self._first = (gradients, weight)
        else:
            if self._first is not None:
                self._sum(*self._first)
                self._first = None
            self._sum(gradients, weight)
        self._weight += weight
        self._scale_sum += lr_scale
        self.count += 1

    def _sum(self, gradients: Gradients, weight: int) -> None:
        """Add one push's gradients times ``weight`` to the sums."""
        for total, values in ((self._dense, gradients.dense), (self._state, gradients.state_changes)):
            for name, value in values.items():
                if name in total:
                    total[name] += value * weight
                else:
                    total[name] = value * weight
        for name, (ids, values) in gradients.embeddings.items():
            self._sparse.setdefault(name, []).append((ids, values * weight))

    def mean(self) -> tuple[Gradients, float]:
        """The pushes' mean weighted by examples (a variable missing from a push counts as zero), and the
        mean learning-rate scale. A single push is returned as it came. Used for a full step and for the
        pushes left at the end of training alike."""
        if self._first is not None:
            return self._first[0], self._scale_sum
        weight = self._weight
        dense = {name: total / weight for name, total in self._dense.items()}
        state = {name: total / weight for name, total in self._state.items()}
        embeddings = {
            name: (np.concatenate([ids for ids, _ in rows]), np.concatenate([v for _, v in rows]) / weight)
            for name, rows in self._sparse.items()
        }
        return Gradients(dense, embeddings, state), self._scale_sum / self.count


class ParameterServerServicer(ps_pb2_grpc.ParameterServerServicer):
    """Serve this parameter server's partition of the model (see the module's docstring)."""

    def __init__(
        self,
        optimizer_factory: OptimizerFactory,
        *,
        ps_id: int = 0,
        num_ps: int = 1,
        use_async: bool = False,
        grads_to_wait: int = 1,
        lr_staleness_modulation: bool = False,
        sync_version_tolerance: int = 0,
        checkpointer: Checkpointer[ParametersState] | None = None,
        initial_state: ParametersState | None = None,
        jit_compile: bool = True,
        learning_rate_at: Callable[[int], float] | None = None,
        max_embedding_rows: int = 0,
    ) -> None:
        """Raises :class:`ConfigError` for inconsistent settings or an optimizer the server cannot use.

        ``initial_state`` (from :func:`~edl_argo.ps.checkpoint.restore_latest`) makes the server start
        initialised at that state; ``checkpointer`` saves the state every ``checkpointer.every`` versions.
        ``jit_compile`` compiles dense updates with XLA. ``learning_rate_at(version)``: the learning rate of
        the update from ``version`` (the model's ``LearningRateScheduler``). ``max_embedding_rows``: the most
        rows one table may hold on this server (0: no bound).
        """
        if not 0 <= ps_id < num_ps:
            raise ConfigError(f"--ps-id {ps_id} must be in [0, --num-ps {num_ps})")
        if grads_to_wait < 1:
            raise ConfigError(f"--grads-to-wait must be at least 1, got {grads_to_wait}")
        if sync_version_tolerance < 0:
            raise ConfigError(f"--sync-version-tolerance must be at least 0, got {sync_version_tolerance}")
        if max_embedding_rows < 0:
            raise ConfigError(f"--max-embedding-rows must be at least 0, got {max_embedding_rows}")
        if use_async and grads_to_wait > 1:
            raise ConfigError(
                "--use-async applies each push on arrival; it cannot wait for --grads-to-wait > 1"
            )
        if lr_staleness_modulation and not use_async:
            raise ConfigError(
                "--lr-staleness-modulation needs --use-async (synchronous SGD has no staleness)"
            )
        optimizer_factory = ps_optimizer_factory(optimizer_factory)
        check_optimizer_factory(optimizer_factory, scale_learning_rate=lr_staleness_modulation)
        self.use_async = use_async
        self.grads_to_wait = grads_to_wait
        self.lr_staleness_modulation = lr_staleness_modulation
        self.sync_version_tolerance = sync_version_tolerance
        self.parameters = Parameters(
            optimizer_factory,
            ps_id,
            num_ps,
            jit_compile=jit_compile,
            learning_rate_at=learning_rate_at,
            max_embedding_rows=max_embedding_rows,
        )
        self._checkpointer = checkpointer
        self._lock = threading.Lock()
        self._accumulator = _Accumulator()
        self._pushes = PushMemory()
        # The encoded answer carrying every dense parameter, and the version it is of.
        self._dense_cache: tuple[int, Encoding] | None = None
        # Synchronous SGD, PS other than 0: the step of PS 0 whose pushes it applied last (-1: unknown).
        self._synced_step = -1
        self._pushes_accepted = 0
        self._pushes_refused = 0
        # The bytes of the accepted pushes' gradients (GetStatus's gradient_bytes_accepted).
        self._gradient_bytes_accepted = 0
        #: Pushes refused because they carried NaN or infinite gradients or values.
        self.pushes_non_finite = 0
        #: ``host:port`` of the tensor port serving this servicer (``GetStatus`` names it); "" for none.
        self.tensor_port = ""
        self._restored_version = -1 if initial_state is None else initial_state.version
        if initial_state is not None:
            self.parameters.restore(initial_state)
            if checkpointer is not None:
                checkpointer.mark(initial_state.version)

    @property
    def version(self) -> int:
        """The current model version of this server."""
        return self.parameters.version

    @_rpc
    def PushModel(self, request: ps_pb2.Model, context: grpc.ServicerContext) -> ps_pb2.PushModelResponse:
        with self._lock:
            accepted = self.parameters.init_from_model(request)
            version = self.parameters.version
            if accepted:
                self._synced_step = version  # every PS starts from the pushed model, at one step
            if accepted and self._checkpointer is not None:
                self._checkpointer.mark(version)
        if accepted:
            log.info(
                "ps_initialized",
                version=version,
                dense=len(self.parameters.dense),
                tables=len(self.parameters.tables),
            )
        return ps_pb2.PushModelResponse(accepted=accepted, version=version)

    @_rpc
    def PullDenseParameters(
        self, request: ps_pb2.PullDenseParametersRequest, context: grpc.ServicerContext
    ) -> ps_pb2.PullDenseParametersResponse | Encoding:
        """The answer; an encoded one (:mod:`edl_argo.rpc.wire`) when the server is initialised."""
        with self._lock:
            params = self.parameters
            if not params.initialized:
                return ps_pb2.PullDenseParametersResponse(
                    initialized=False, version=params.version, **self._pull_status()
                )
            if request.finalized:
                response = ps_pb2.PullDenseParametersResponse(initialized=True, version=params.version)
                for name, value in params.pull_dense(since_version=-1, finalized=True) or []:
                    fill_tensor(response.dense_parameters.add(), value, name)
                return response
            return self._dense_answer(request.version)

    def _dense_answer(self, since_version: int) -> Encoding:
        """The answer to a pull of the dense parameters newer than ``since_version`` (under the lock, the
        PS initialised), encoded.

        The answer carrying every parameter is encoded once per version and cached: a push's reply and
        every pull of that version send it. Its tensors are views of the values the last update returned,
        which never change (:meth:`Parameters.pull_dense`): their bytes are copied once, into each reply; the
        small ones packed by dtype (:mod:`edl_argo.rpc.packed`), copied once more, into the packed buffer.
        """
        version = self.parameters.version
        fields = ps_pb2.PullDenseParametersResponse(initialized=True, version=version, **self._pull_status())
        if since_version == version:
            return Encoding(fields)
        cache = self._dense_cache
        if cache is None or cache[0] != version:
            values = dict(self.parameters.pull_dense(since_version=-1) or [])
            answer = encode_named(
                Encoding(fields), ps_layout.ANSWER_PARAMETERS, ps_layout.ANSWER_PACKED, values
            )
            # synced_step changes only when the version does: the cache stays right for its version.
            self._dense_cache = cache = (version, answer)
        return cache[1]

    @_rpc
    def PullEmbeddingVectors(
        self, request: ps_pb2.PullEmbeddingVectorsRequest, context: grpc.ServicerContext
    ) -> tensor_pb2.Tensor:
        ids = _non_negative_ids(request.name, from_tensor(request.ids))
        with self._lock:
            rows = self.parameters.pull_embeddings(request.name, ids)
        return to_tensor(rows, request.name)

    @_rpc
    def PullEmbeddingVectorsBatch(
        self, request: ps_pb2.PullEmbeddingVectorsBatchRequest, context: grpc.ServicerContext
    ) -> ps_pb2.PullEmbeddingVectorsBatchResponse:
        lookups = [(r.name, _non_negative_ids(r.name, from_tensor(r.ids))) for r in request.lookups]
        with self._lock:
            rows = [self.parameters.pull_embeddings(name, ids) for name, ids in lookups]
        return ps_pb2.PullEmbeddingVectorsBatchResponse(
            rows=[to_tensor(r, name) for r, (name, _) in zip(rows, lookups, strict=True)]
        )

    @_rpc
    def PullEmbeddingTable(
        self, request: ps_pb2.PullEmbeddingTableRequest, context: grpc.ServicerContext
    ) -> tensor_pb2.IndexedSlices:
        with self._lock:
            ids, rows = self.parameters.export_table(request.name)
        return to_indexed_slices(rows, ids, request.name)

    @_rpc
    def PushGradients(
        self, push: ps_pb2.PushGradientsRequest | PushedGradients, context: grpc.ServicerContext
    ) -> Encoding:
        """An encoded ``PushGradientsResponse`` (:mod:`edl_argo.rpc.wire`). The streaming twin passes the
        push as read from its bytes (:meth:`PushedGradients.parse`), the unary call as a message."""
        if isinstance(push, ps_pb2.PushGradientsRequest):
            push = PushedGradients.of_message(push)
        request = push.fields
        lr_scale = bounds.check_push_fields(request, self.parameters.ps_id)
        with self._lock:
            recalled = self._pushes.recall(request.pusher_id, request.sequence)
            if recalled is not None:
                log.info(
                    "push_repeated",
                    pusher=request.pusher_id,
                    sequence=request.sequence,
                    accepted=recalled.accepted,
                )
                return self._push_answer(request, recalled.accepted, recalled.step)
            outcome = self._decide_push(request, push.gradients, lr_scale)
            self._pushes.remember(request.pusher_id, outcome)
            return self._push_answer(request, outcome.accepted, outcome.step)

    def _decide_push(
        self, request: ps_pb2.PushGradientsRequest, pushed: PushedModel, lr_scale: float
    ) -> PushOutcome:
        """Apply (or accumulate) a new push, or refuse it as stale (under the lock)."""
        params = self.parameters
        gradients = params.decode_gradients(pushed)
        for name, (ids, _) in gradients.embeddings.items():
            _non_negative_ids(name, ids)
        try:
            bounds.check_finite(gradients)
        except NonFiniteGradientError:
            self.pushes_non_finite += 1
            raise
        if lr_scale != 1.0 and not params.lr_scalable:
            raise LearningRateScaleError(
                f"learning_rate_scale {lr_scale:g} asked, but the model's optimizer uses a "
                "learning-rate schedule"
            )
        step = 0
        if self.use_async:
            if self.lr_staleness_modulation:
                lr_scale /= max(1, params.version - request.version)
            params.apply_gradients(gradients, lr_scale)
        elif request.authority_step <= 0 and not (
            params.version - self.sync_version_tolerance
            <= request.version
            <= params.version + self.sync_version_tolerance
        ):
            # Older than the tolerance (stale), or newer than this server ever was (a worker that has
            # not pulled since this server restarted from a checkpoint): pull and recompute.
            self._pushes_refused += 1
            log.debug("gradients_stale", version=request.version, current=params.version)
            return PushOutcome(request.sequence, accepted=False)
        else:
            # PS 0 (or a lone PS) decided above; the others follow PS 0's decision.
            step = request.authority_step if request.authority_step > 0 else params.version + 1
            self._accumulator.add(gradients, lr_scale, request.examples, request.authority_step)
            if self._accumulator.count >= self.grads_to_wait:
                self._apply_accumulated()
        self._pushes_accepted += 1
        self._gradient_bytes_accepted += gradients.nbytes
        self._maybe_checkpoint()
        return PushOutcome(request.sequence, accepted=True, step=step)

    def _push_answer(self, request: ps_pb2.PushGradientsRequest, accepted: bool, step: int = 0) -> Encoding:
        """The reply to a push (under the lock), encoded, with the parameters newer than its version if it
        asks."""
        fields = ps_pb2.PushGradientsResponse(accepted=accepted, version=self.parameters.version, step=step)
        response = Encoding(fields)
        if request.return_parameters:
            response.message(ps_layout.REPLY_PARAMETERS, self._dense_answer(request.version))
        return response

    @_rpc
    def GetStatus(
        self, request: ps_pb2.GetStatusRequest, context: grpc.ServicerContext
    ) -> ps_pb2.ParameterServerStatus:
        applied = 0
        with self._lock:
            if request.apply_pending and self._accumulator.count:
                applied = self._accumulator.count
                self._apply_accumulated()
                self._maybe_checkpoint()
                log.info("pending_pushes_applied", pushes=applied, version=self.parameters.version)
            return ps_pb2.ParameterServerStatus(
                initialized=self.parameters.initialized,
                version=self.parameters.version,
                pushes_accepted=self._pushes_accepted,
                pushes_refused=self._pushes_refused,
                pending_applied=applied,
                pending=self._accumulator.count,
                restored_version=self._restored_version,
                pushes_non_finite=self.pushes_non_finite,
                pushes_repeated=self._pushes.repeated,
                tensor_port=self.tensor_port,
                gradient_bytes_accepted=self._gradient_bytes_accepted,
            )

    def _apply_accumulated(self) -> None:
        """Apply the accumulated pushes as one step (under the lock)."""
        accumulator, self._accumulator = self._accumulator, _Accumulator()
        mean, mean_scale = accumulator.mean()
        self.parameters.apply_gradients(mean, mean_scale)
        if accumulator.authority_step > 0:
            self._synced_step = accumulator.authority_step

    def _pull_status(self) -> dict[str, Any]:
        """The fields of a pull's answer that tell a worker how consistent its parameters are."""
        return {"synced_step": self._synced_step, "synchronous": not self.use_async}

    def save_checkpoint(self, timeout: float | None = None) -> bool:
        """Save the current state now unless it is saved already, and wait up to ``timeout`` seconds.

        For a graceful stop. Returns whether every save finished (true when checkpoints are off).
        """
        checkpointer = self._checkpointer
        if checkpointer is None or checkpointer.every == 0:
            return True
        checkpointer.wait(timeout)
        with self._lock:
            params = self.parameters
            if params.initialized and params.version != checkpointer.marked_version and not checkpointer.busy:
                checkpointer.submit(params.snapshot())
        return checkpointer.wait(timeout)

    def _maybe_checkpoint(self) -> None:
        """Called under the lock after the version may have advanced."""
        checkpointer = self._checkpointer
        if checkpointer is not None and checkpointer.due(self.parameters.version):
            checkpointer.submit(self.parameters.snapshot())
