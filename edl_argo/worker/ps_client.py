"""A worker's view of all parameter servers as one model store.

Dense variables go to the PS that owns their name (:func:`edl_argo.ps.partition.dense_owner`), embedding
rows to the PS that owns their id (:func:`edl_argo.ps.partition.embedding_owner`). Calls to several PS run
in parallel. Every push goes to every PS (with an empty partition where it owns nothing), so all PS count
versions in step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from edl_argo.proto import ps_pb2, ps_pb2_grpc
from edl_argo.ps.partition import dense_owner, embedding_owner
from edl_argo.rpc.channel import call_with_retry, make_channel
from edl_argo.rpc.tensors import fill_tensor, from_indexed_slices, from_tensor, to_tensor
from edl_argo.worker.embedding import EmbeddingTableSpec

T = TypeVar("T")


@dataclass(frozen=True)
class PushResult:
    """Whether every PS accepted the gradients, and the model version each now holds."""

    accepted: bool
    versions: tuple[int, ...]

    @property
    def version(self) -> int:
        return max(self.versions)


class ParameterServerClient:
    """Pull and push model partitions across ``addresses`` (one per PS id, in id order)."""

    def __init__(self, addresses: Sequence[str], retry_budget_seconds: float = 300.0) -> None:
        if not addresses:
            raise ValueError("at least one parameter server address is needed")
        self._addresses = list(addresses)
        self._stubs = [ps_pb2_grpc.ParameterServerStub(make_channel(a)) for a in self._addresses]
        self._budget = retry_budget_seconds
        self._pool = ThreadPoolExecutor(max_workers=len(addresses)) if len(addresses) > 1 else None

    @property
    def num_ps(self) -> int:
        return len(self._stubs)

    def _each(self, fn: Callable[[int], T]) -> list[T]:
        """``fn(ps_id)`` for every PS, in parallel when there are several; results in id order."""
        if self._pool is None:
            return [fn(0)]
        return list(self._pool.map(fn, range(self.num_ps)))

    def _call(self, ps_id: int, method: str, request: object) -> object:
        rpc = getattr(self._stubs[ps_id], method)
        return call_with_retry(lambda: rpc(request), f"ps-{ps_id} {self._addresses[ps_id]}", self._budget)

    def push_model(
        self,
        dense: Mapping[str, np.ndarray],
        tables: Iterable[EmbeddingTableSpec],
        non_trainable: Mapping[str, np.ndarray] | None = None,
        constraints: Mapping[str, str] | None = None,
    ) -> bool:
        """Offer initial parameters (trainable and non-trainable, with the trainable variables' constraints);
        each PS keeps the first model it is offered. True if any took ours."""
        infos = [
            ps_pb2.EmbeddingTableInfo(
                name=t.name, dim=t.dim, dtype=t.dtype, initializer=t.initializer, constraint=t.constraint
            )
            for t in tables
        ]
        by_owner = self._split_dense(dense)
        state_by_owner = self._split_dense(non_trainable or {})
        constraints_by_owner = self._split_dense(constraints or {})

        def push(ps_id: int) -> bool:
            model = ps_pb2.Model(
                dense_parameters=[to_tensor(v, n) for n, v in by_owner[ps_id].items()],
                non_trainable_parameters=[to_tensor(v, n) for n, v in state_by_owner[ps_id].items()],
                constraints=constraints_by_owner[ps_id],
                embedding_table_infos=infos,
            )
            return bool(self._call(ps_id, "PushModel", model).accepted)

        return any(self._each(push))

    def pull_dense(
        self, versions: Sequence[int], finalized: bool = False
    ) -> tuple[dict[str, np.ndarray], list[int], bool]:
        """Dense parameters, trainable and non-trainable, newer than ``versions`` (one per PS; -1 for none);
        ``finalized``: all of them as ``fit`` ends with them (EMA averages; for export).

        Returns the changed parameters, the versions now held, and whether every PS is initialised.
        """

        def pull(ps_id: int) -> ps_pb2.PullDenseParametersResponse:
            request = ps_pb2.PullDenseParametersRequest(version=versions[ps_id], finalized=finalized)
            return self._call(ps_id, "PullDenseParameters", request)

        responses = self._each(pull)
        values = {t.name: from_tensor(t) for r in responses for t in r.dense_parameters}
        return values, [r.version for r in responses], all(r.initialized for r in responses)

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
        state: Mapping[str, np.ndarray] | None = None,
        examples: int = 0,
    ) -> PushResult:
        """Push one minibatch's gradients; ``sparse`` maps a table to ``(row_gradients, ids)``, ``state``
        holds the non-trainable values the minibatch's forward pass computed, ``examples`` its size."""
        dense_by_owner = self._split_dense(dense)
        state_by_owner = self._split_dense(state or {})
        sparse_by_owner: list[dict[str, tuple[np.ndarray, np.ndarray]]] = [{} for _ in range(self.num_ps)]
        for table, (values, ids) in sparse.items():
            owners = embedding_owner(ids, self.num_ps)
            for ps_id in range(self.num_ps):
                mask = owners == ps_id
                if mask.any():
                    sparse_by_owner[ps_id][table] = (values[mask], ids[mask])

        def push(ps_id: int) -> ps_pb2.PushGradientsResponse:
            # Built in place: each tensor's bytes are copied once into the request.
            request = ps_pb2.PushGradientsRequest(
                version=versions[ps_id], learning_rate_scale=learning_rate_scale, examples=examples
            )
            gradients = request.gradients
            gradients.version = versions[ps_id]
            for name, gradient in dense_by_owner[ps_id].items():
                fill_tensor(gradients.dense_parameters.add(), gradient, name)
            for name, value in state_by_owner[ps_id].items():
                fill_tensor(gradients.non_trainable_parameters.add(), value, name)
            for table, (values, ids) in sparse_by_owner[ps_id].items():
                slices = gradients.embedding_tables[table]
                fill_tensor(slices.values, values, table)
                fill_tensor(slices.ids, np.asarray(ids, dtype=np.int64), table)
            return self._call(ps_id, "PushGradients", request)

        responses = self._each(push)
        return PushResult(all(r.accepted for r in responses), tuple(r.version for r in responses))

    def _split_dense(self, values: Mapping[str, T]) -> list[dict[str, T]]:
        by_owner: list[dict[str, T]] = [{} for _ in range(self.num_ps)]
        for name, value in values.items():
            by_owner[dense_owner(name, self.num_ps)][name] = value
        return by_owner

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
