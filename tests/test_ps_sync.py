"""Several workers and several parameter servers in one process, over real gRPC: what each PS applies.

Workers are :class:`ModelReplica` objects in threads; parameter servers are servicers on 127.0.0.1. A PS is
slowed by wrapping its ``PushGradients`` (a test-only delay), so that pushes of different workers reach
the servers in different orders. References are written in numpy, independently of the PS code.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from edl_argo import log
from edl_argo.model import ModelSpec, load_model_spec
from edl_argo.ps.partition import DensePlacement
from edl_argo.ps.server import start_server
from edl_argo.ps.servicer import ParameterServerServicer
from edl_argo.rpc.chunked import PendingCall
from edl_argo.worker.ps_client import ParameterServerClient
from edl_argo.worker.replica import ModelReplica
from tests.engine_helpers import PYTHON_BRANCH_ON_A_TENSOR_LOSS, assert_fails_as_in_fit, mse_model_file
from tests.tcp_proxy import SilentProxy

LEARNING_RATE = 0.05
FEATURES = 4
PARTS = 4

#: A linear model whose prediction is ``x @ (k0 + k1 + k2 + k3) + b`` (the kernels are spread over the
#: PS by name): its gradients are easy to write in numpy.
LINEAR_MODEL = mse_model_file(
    f"keras.optimizers.SGD({LEARNING_RATE})",
    f"""
def custom_model():
    x = keras.Input(shape=({FEATURES},), name="x")
    parts = [keras.layers.Dense(1, name=f"d{{i}}", use_bias=i == 0)(x) for i in range({PARTS})]
    return keras.Model(x, keras.layers.Add()(parts))
""",
)


@pytest.fixture(autouse=True)
def events_to_stderr() -> None:
    """Event lines (e.g. a PS lagging behind PS 0) on stderr, where pytest shows them for a failure."""
    log.configure("INFO")


@pytest.fixture
def linear_spec(tmp_path: Path) -> ModelSpec:
    path = tmp_path / "linear.py"
    path.write_text(LINEAR_MODEL)
    return load_model_spec(str(path))


class Cluster:
    """Parameter servers on 127.0.0.1 and clients of all of them."""

    def __init__(self, spec: ModelSpec, num_ps: int, **settings: Any) -> None:
        self.servicers = [
            ParameterServerServicer(spec.optimizer, ps_id=i, num_ps=num_ps, jit_compile=False, **settings)
            for i in range(num_ps)
        ]
        self.applied = [0] * num_ps  # optimizer steps each PS made
        self.scales: list[dict[int, float]] = [{} for _ in range(num_ps)]  # version after a step -> lr scale
        for ps_id, servicer in enumerate(self.servicers):
            self._count_applies(ps_id, servicer)
        self._servers: list[grpc.Server] = []
        self.addresses: list[str] = []
        self._clients: list[ParameterServerClient] = []

    def _count_applies(self, ps_id: int, servicer: ParameterServerServicer) -> None:
        parameters = servicer.parameters
        apply = parameters.apply_gradients

        def counted(gradients: Any, lr_scale: float = 1.0) -> None:
            apply(gradients, lr_scale)
            self.applied[ps_id] += 1
            self.scales[ps_id][parameters.version] = lr_scale

        parameters.apply_gradients = counted  # type: ignore[method-assign]

    def slow_down(self, ps_id: int, max_delay: float, seed: int = 0) -> None:
        """Delay every push to PS ``ps_id`` by a random time up to ``max_delay`` seconds (before serving)."""
        servicer = self.servicers[ps_id]
        push = servicer.PushGradients
        rng = random.Random(seed)
        lock = threading.Lock()

        def slowed(request: Any, context: Any) -> Any:
            with lock:
                delay = rng.uniform(0, max_delay)
            time.sleep(delay)
            return push(request, context)

        servicer.PushGradients = slowed  # type: ignore[method-assign]

    def count_pulls(self) -> list[int]:
        """Count the dense pulls each PS serves (call before :meth:`start`); the returned list grows live."""
        counts = [0] * len(self.servicers)
        for ps_id, servicer in enumerate(self.servicers):
            pull = servicer.PullDenseParameters

            def counted(request: Any, context: Any, _id: int = ps_id, _pull: Any = pull) -> Any:
                counts[_id] += 1
                return _pull(request, context)

            servicer.PullDenseParameters = counted  # type: ignore[method-assign]
        return counts

    def start(self) -> Cluster:
        for servicer in self.servicers:
            server, port = start_server(servicer, "127.0.0.1", 0)
            self._servers.append(server)
            self.addresses.append(f"127.0.0.1:{port}")
        return self

    def client(self) -> ParameterServerClient:
        client = ParameterServerClient(self.addresses, retry_budget_seconds=30)
        self._clients.append(client)
        return client

    def stop(self) -> None:
        for client in self._clients:
            client.close()
        for server in self._servers:
            server.stop(None)


@pytest.fixture
def cluster(linear_spec: ModelSpec) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(num_ps: int, **settings: Any) -> Cluster:
        made.append(Cluster(linear_spec, num_ps, **settings))
        return made[-1]

    yield make
    for c in made:
        c.stop()


def minibatches(num_workers: int, per_worker: int, size: int = 8, seed: int = 1) -> list[list[tuple]]:
    """``per_worker`` minibatches ``(x, y)`` of a noisy linear target for each worker."""
    rng = np.random.default_rng(seed)
    truth = rng.normal(size=(FEATURES, 1))
    batches = []
    for _ in range(num_workers):
        mine = []
        for _ in range(per_worker):
            x = rng.normal(size=(size, FEATURES)).astype(np.float32)
            y = (x @ truth + 0.1 * rng.normal(size=(size, 1))).astype(np.float32)
            mine.append((x, y))
        batches.append(mine)
    return batches


def build_replicas(spec: ModelSpec, cluster: Cluster, count: int, **options: Any) -> list[ModelReplica]:
    """Replicas built one after the other (building clears Keras' session), all synced with the PS."""
    replicas = [ModelReplica(spec, cluster.client(), **options) for _ in range(count)]
    sample = np.zeros((1, FEATURES), np.float32)
    for replica in replicas:
        replica.ensure_built(sample)
    return replicas


def run_workers(
    replicas: list[ModelReplica], batches: list[list[tuple]], indexes: list[list[int]] | None = None
) -> None:
    """Each replica trains its minibatches in its own thread (``indexes[worker][0]`` is set to the index of
    the minibatch being trained); the first error is raised here."""
    errors: list[BaseException] = []

    def work(worker: int, replica: ModelReplica, mine: list[tuple]) -> None:
        try:
            for i, (x, y) in enumerate(mine):
                if indexes is not None:
                    indexes[worker][0] = i
                replica.train_minibatch(x, y)
            replica.flush()
        except BaseException as error:
            errors.append(error)

    threads = [
        threading.Thread(target=work, args=(w, r, b))
        for w, (r, b) in enumerate(zip(replicas, batches, strict=True))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a worker did not finish"
    if errors:
        raise errors[0]


def record_accepted(replica: ModelReplica, log: list[tuple[int, int, int]], worker: int) -> list[int]:
    """Record ``(step of PS 0, worker, minibatch)`` for every accepted push of ``replica``; the returned list
    holds the index of the minibatch being trained (set it before each ``train_minibatch``)."""
    client = replica._ps
    push = client.push_gradients
    current = [0]

    def recording(*args: Any, **kwargs: Any) -> Any:
        result = push(*args, **kwargs)
        if result.accepted:
            log.append((result.versions[0], worker, current[0]))
        return result

    client.push_gradients = recording  # type: ignore[method-assign]
    return current


def reference_sgd(initial: dict[str, np.ndarray], groups: list[list[tuple[np.ndarray, np.ndarray]]]) -> dict:
    """Plain SGD on the linear model in float64: one step per group of minibatches, with the mean of their
    gradients at the parameters before the step."""
    params = {name: value.astype(np.float64) for name, value in initial.items()}
    kernels = sorted(name for name in params if name.endswith("kernel"))
    bias = next(name for name in params if name.endswith("bias"))
    for group in groups:
        kernel_grad = np.zeros_like(params[kernels[0]])
        bias_grad = np.zeros_like(params[bias])
        for x, y in group:
            prediction = x @ sum(params[k] for k in kernels) + params[bias]
            g = 2.0 * (prediction - y) / len(x)
            kernel_grad += x.T @ g / len(group)
            bias_grad += g.sum(axis=0) / len(group)
        for k in kernels:
            params[k] = params[k] - LEARNING_RATE * kernel_grad
        params[bias] = params[bias] - LEARNING_RATE * bias_grad
    return params


def assert_parameters(cluster: Cluster, expected: dict[str, np.ndarray]) -> None:
    final, _, _ = cluster.client().pull_dense([-1] * len(cluster.servicers))
    assert sorted(final) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(final[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_the_linear_model_is_spread_over_two_ps(linear_spec: ModelSpec) -> None:
    from edl_argo.model.inventory import ModelInventory
    from edl_argo.worker.replica import build_model

    model = build_model(linear_spec, np.zeros((1, FEATURES), np.float32))
    layout = {v.path: v.numpy().nbytes for v in ModelInventory.of(model).held_by_ps}
    assert len(layout) == PARTS + 1
    assert set(DensePlacement.of(layout, 2).owners.values()) == {0, 1}


def test_sync_sgd_over_two_ps_applies_every_minibatch_once_on_every_ps(
    cluster: Callable[..., Cluster], linear_spec: ModelSpec
) -> None:
    """2 PS x 3 workers, synchronous, PS 1 slowed: decisions would split between the PS. Every PS applies
    each minibatch exactly once, and the model is what sequential SGD over the accepted order gives."""
    ps = cluster(2)
    ps.slow_down(1, max_delay=0.03)
    ps.start()
    replicas = build_replicas(linear_spec, ps, 3)
    initial, _, _ = ps.client().pull_dense([-1, -1])
    batches = minibatches(3, per_worker=12)
    accepted: list[tuple[int, int, int]] = []
    indexes = [record_accepted(r, accepted, w) for w, r in enumerate(replicas)]
    run_workers(replicas, batches, indexes)

    trained = sum(len(mine) for mine in batches)
    assert len(accepted) == trained
    assert sorted((w, i) for _, w, i in accepted) == [(w, i) for w in range(3) for i in range(12)]
    assert ps.applied == [trained, trained], "a PS applied a minibatch twice (or missed one)"
    assert [s.version for s in ps.servicers] == [trained, trained]
    steps = sorted(step for step, _, _ in accepted)
    assert steps == list(range(1, trained + 1)), "PS 0 accepted two pushes for one step"
    assert_parameters(ps, reference_sgd(initial, [[batches[w][i]] for _, w, i in sorted(accepted)]))


def test_the_other_ps_receive_their_share_of_a_push_while_ps_0_decides(
    cluster: Callable[..., Cluster], linear_spec: ModelSpec
) -> None:
    """2 PS, synchronous: a push's share for PS 1 travels while PS 0 decides (PS 1 reads it once PS 0's
    step ends its request). PS 0 here decides each push only once PS 1 has received that share, or after
    2 s; pushed one PS after the other, PS 1 would receive nothing before PS 0 answered."""
    ps = cluster(2)
    proxy_of_ps_1: list[SilentProxy] = []
    share_arrived: list[bool] = []
    share = [0, 0]  # bytes of PS 1's dense variables; bytes forwarded to PS 1 when the push started
    decide = ps.servicers[0].PushGradients

    def received() -> bool:
        return proxy_of_ps_1[0].upstream_bytes - share[1] >= share[0]

    def deciding_once_ps_1_has_its_share(request: Any, context: Any) -> Any:
        deadline = time.monotonic() + 2
        while not received() and time.monotonic() < deadline:
            time.sleep(0.005)
        share_arrived.append(received())
        return decide(request, context)

    ps.servicers[0].PushGradients = deciding_once_ps_1_has_its_share  # type: ignore[method-assign]
    ps.start()
    proxy_of_ps_1.append(SilentProxy(ps.addresses[1]))
    client = ParameterServerClient([ps.addresses[0], proxy_of_ps_1[0].address], retry_budget_seconds=30)
    push = client.push_gradients

    def pushing(*args: Any, **kwargs: Any) -> Any:
        share[1] = proxy_of_ps_1[0].upstream_bytes
        return push(*args, **kwargs)

    client.push_gradients = pushing  # type: ignore[method-assign]
    try:
        replica = ModelReplica(linear_spec, client)
        replica.ensure_built(np.zeros((1, FEATURES), np.float32))
        initial, _, _ = ps.client().pull_dense([-1, -1])
        placement = DensePlacement.of({name: value.nbytes for name, value in initial.items()}, 2)
        share[0] = sum(initial[name].nbytes for name, owner in placement.owners.items() if owner == 1)
        (batches,) = minibatches(1, per_worker=4)
        run_workers([replica], [batches])
    finally:
        client.close()
        proxy_of_ps_1[0].close()
    assert share[0] > 0 and share_arrived == [True] * 4
    assert ps.applied == [4, 4]
    assert_parameters(ps, reference_sgd(initial, [[batch] for batch in batches]))


def test_a_push_ps_0_refuses_is_never_read_by_the_other_ps(
    cluster: Callable[..., Cluster], linear_spec: ModelSpec
) -> None:
    """PS 0 refuses a stale push: the other PS's call is cancelled before its request ends, so PS 1 never
    reads it (had its request ended without PS 0's step, PS 1 would have decided on it itself)."""
    ps = cluster(2)
    read_by_ps_1: list[int] = []
    read = ps.servicers[1].PushGradients

    def reading(request: Any, context: Any) -> Any:
        read_by_ps_1.append(1)
        return read(request, context)

    ps.servicers[1].PushGradients = reading  # type: ignore[method-assign]
    ps.start()
    (replica,) = build_replicas(linear_spec, ps, 1)
    (batches,) = minibatches(1, per_worker=3)
    run_workers([replica], [batches])
    client: ParameterServerClient = replica._ps
    current, _, _ = client.pull_dense([-1, -1])
    refused = client.push_gradients({name: np.zeros_like(v) for name, v in current.items()}, {}, [1, 1])
    assert not refused.accepted and refused.versions == (3, -1)
    time.sleep(0.5)  # a request that ended would be read by now
    assert len(read_by_ps_1) == 3
    assert [s.version for s in ps.servicers] == [3, 3] and ps.applied == [3, 3]


class _ConnectionBroke(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


def test_a_share_whose_call_fails_before_its_answer_is_sent_again_and_applied_once(
    cluster: Callable[..., Cluster], linear_spec: ModelSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call carrying PS 1's share fails after PS 1 may have applied it: the share is sent again whole,
    with PS 0's step, and PS 1 (which remembers the pusher's pushes) applies each minibatch once."""
    failures = [0]
    finish = PendingCall.finish

    def failing_after_finishing(call: PendingCall, tail: bytes) -> Any:
        finish(call, tail)
        failures[0] += 1
        raise _ConnectionBroke()

    monkeypatch.setattr(PendingCall, "finish", failing_after_finishing)
    ps = cluster(2)
    ps.start()
    (replica,) = build_replicas(linear_spec, ps, 1)
    initial, _, _ = ps.client().pull_dense([-1, -1])
    (batches,) = minibatches(1, per_worker=3)
    run_workers([replica], [batches])
    assert failures == [3]
    assert ps.applied == [3, 3] and [s.version for s in ps.servicers] == [3, 3]
    assert_parameters(ps, reference_sgd(initial, [[batch] for batch in batches]))


def test_synchronous_steps_take_their_parameters_from_the_push_replies_without_pulls(
    cluster: Callable[..., Cluster], linear_spec: ModelSpec
) -> None:
    """2 PS, 1 worker, synchronous: after the first pull, every step computes from the parameters the
    previous push's replies carried (no PullDenseParameters), and the model is sequential SGD's."""
    ps = cluster(2)
    pulls = ps.count_pulls()
    ps.start()
    (replica,) = build_replicas(linear_spec, ps, 1)
    initial, _, _ = ps.client().pull_dense([-1, -1])
    before = list(pulls)
    (batches,) = minibatches(1, per_worker=8)
    run_workers([replica], [batches])
    assert pulls == before, "a synchronous step pulled although the push reply carried the parameters"
    assert replica.versions == [8, 8]
    assert_parameters(ps, reference_sgd(initial, [[batch] for batch in batches]))


def test_pushes_left_waiting_for_grads_to_wait_are_applied_when_training_ends(
    cluster: Callable[..., Cluster], linear_spec: ModelSpec
) -> None:
    """grads_to_wait=3, 7 minibatches: two full steps, and the last minibatch applied on its own when the
    master asks the PS for their status with apply_pending (as it does when training ends)."""
    ps = cluster(2, grads_to_wait=3).start()
    (replica,) = build_replicas(linear_spec, ps, 1)
    initial, _, _ = ps.client().pull_dense([-1, -1])
    (batches,) = minibatches(1, per_worker=7)
    run_workers([replica], [batches])
    before = ps.client().status()
    assert [(s.version, s.pending, s.pushes_accepted) for s in before] == [(2, 1, 7), (2, 1, 7)]
    after = ps.client().status(apply_pending=True)
    assert [(s.version, s.pending, s.pending_applied) for s in after] == [(3, 0, 1), (3, 0, 1)]
    assert [s.version for s in ps.client().status(apply_pending=True)] == [3, 3]  # idempotent
    assert_parameters(ps, reference_sgd(initial, [batches[0:3], batches[3:6], batches[6:]]))


def test_pipelined_pushes_carry_the_versions_their_gradients_were_computed_from(
    cluster: Callable[..., Cluster], linear_spec: ModelSpec
) -> None:
    """--pipelined with --lr-staleness-modulation: the learning-rate scale of each step is
    1 / (true staleness), the versions the PS moved on from the parameters the gradients came from."""
    ps = cluster(1, use_async=True, lr_staleness_modulation=True).start()
    replicas = build_replicas(linear_spec, ps, 2, pipelined=True)
    computed: list[list[int]] = [[], []]  # per worker: PS version of the parameters of each minibatch
    pushes: list[list[int]] = [[], []]  # per worker: PS version after each push
    for worker, replica in enumerate(replicas):
        gradients = replica._gradients

        def recording_gradients(*args: Any, _w: int = worker, _g: Any = gradients, _r: Any = replica) -> Any:
            computed[_w].append(_r.versions[0])
            return _g(*args)

        replica._gradients = recording_gradients  # type: ignore[method-assign]
        client = replica._ps
        push = client.push_gradients

        def recording_push(*args: Any, _w: int = worker, _p: Any = push, **kwargs: Any) -> Any:
            result = _p(*args, **kwargs)
            pushes[_w].append(result.versions[0])
            return result

        client.push_gradients = recording_push  # type: ignore[method-assign]

    run_workers(replicas, minibatches(2, per_worker=15))

    stalenesses = []
    for worker in range(2):
        assert len(pushes[worker]) == len(computed[worker]) == 15
        for at, after in zip(computed[worker], pushes[worker], strict=True):
            staleness = (after - 1) - at  # versions applied between the pull and this step
            stalenesses.append(staleness)
            assert ps.scales[0][after] == pytest.approx(1.0 / max(1, staleness)), (worker, at, after)
    assert max(stalenesses) >= 2, f"the test needs stale pushes: {stalenesses}"


VOCABULARY = 20
EMBEDDING_MODEL = mse_model_file(
    f"keras.optimizers.SGD({LEARNING_RATE})",
    f"""
def custom_model():
    ids = keras.Input(shape=(3,), dtype="int64", name="ids")
    rows = keras.layers.Embedding({VOCABULARY}, 4, name="emb")(ids)
    return keras.Model(ids, keras.layers.Dense(1, name="out")(keras.layers.Flatten()(rows)))
""",
)


@pytest.mark.parametrize("num_ps", [1, 2])
def test_embedding_updates_equal_model_fit_with_plain_sgd(tmp_path: Path, num_ps: int) -> None:
    """One worker, synchronous SGD: the rows and dense variables on the PS are those Keras' ``model.fit``
    reaches from the same start with the same minibatches (ids repeat within a minibatch; rows no
    minibatch looks up stay exactly as they were in both). Not bit for bit: gradients of a repeated id are
    summed in another order (measured: at most 1.5e-8 apart, one unit in the last place; a step moves a
    row by about 1e-3)."""
    path = tmp_path / "embedding.py"
    path.write_text(EMBEDDING_MODEL)
    spec = load_model_spec(str(path))
    ps = Cluster(spec, num_ps).start()
    try:
        rng = np.random.default_rng(3)
        ids = rng.integers(0, VOCABULARY - 5, size=(48, 3)).astype(np.int64)  # rows 15-19 never looked up
        labels = rng.normal(size=(48, 1)).astype(np.float32)
        (replica,) = build_replicas(spec, ps, 1)
        client = ps.client()
        tables = {t.name: t for t in replica._tables.values()}
        (table,) = tables  # named by the path of the layer's variable
        every_id = np.arange(VOCABULARY, dtype=np.int64)
        (initial_rows,) = client.pull_embeddings([(table, every_id)], tables)  # creates every row
        initial_dense, _, _ = client.pull_dense([-1] * num_ps)

        run_workers([replica], [[(ids[i : i + 8], labels[i : i + 8]) for i in range(0, 48, 8)]])

        reference = spec.custom_model()
        reference.get_layer("emb").embeddings.assign(initial_rows)
        for variable in reference.get_layer("out").trainable_variables:
            variable.assign(initial_dense[variable.path])
        reference.compile(optimizer=spec.optimizer(), loss=spec.loss)
        reference.fit(ids, labels, batch_size=8, epochs=1, shuffle=False, verbose=0)

        (rows,) = client.pull_embeddings([(table, every_id)], tables)
        dense, _, _ = client.pull_dense([-1] * num_ps)
        assert np.array_equal(rows[15:], initial_rows[15:])
        assert not np.allclose(rows[:15], initial_rows[:15], rtol=0, atol=1e-4), "rows must have moved"
        np.testing.assert_allclose(rows, reference.get_layer("emb").embeddings.numpy(), rtol=1e-6, atol=1e-7)
        for variable in reference.get_layer("out").trainable_variables:
            np.testing.assert_allclose(
                dense[variable.path], variable.numpy(), rtol=1e-6, atol=1e-7, err_msg=variable.path
            )
    finally:
        ps.stop()


def test_a_loss_branching_in_python_on_a_tensor_fails_on_the_worker_as_it_fails_in_fit(
    cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """The worker traces its step as ``fit`` does, without AutoGraph: a Python ``if`` on a tensor's value
    fails in both, and the error names the model file's ``loss``."""
    path = tmp_path / "branching.py"
    path.write_text(LINEAR_MODEL + PYTHON_BRANCH_ON_A_TENSOR_LOSS)
    ps = cluster(1)
    ps.start()
    replica = ModelReplica(load_model_spec(str(path)), ps.client())
    (batches,) = minibatches(1, per_worker=1)
    features, labels = batches[0]
    replica.ensure_built(features)
    assert_fails_as_in_fit(str(path), replica.train_minibatch, features, labels)
