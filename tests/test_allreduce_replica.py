"""AllreduceStrategy replicas in one process: real :class:`AllreduceReplica` objects (their collective servers
on loopback) driven step by step from threads, with the master's real :class:`RendezvousManager`, so a test
decides exactly when a member leaves, joins again or is replaced.
(Whole jobs: tests/test_training_allreduce.py.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from edl_argo.master.rendezvous import RendezvousManager
from edl_argo.model import load_model_spec
from edl_argo.proto import master_pb2
from edl_argo.storage import LocalStorage
from edl_argo.worker.allreduce_replica import AllreduceReplica
from edl_argo.worker.replica import NonFiniteLossError
from tests.engine_helpers import PYTHON_BRANCH_ON_A_TENSOR_LOSS, assert_fails_as_in_fit
from tests.tcp_proxy import SilentProxy

#: ``(features, labels)`` of one minibatch.
Batch = tuple[np.ndarray, np.ndarray]

#: A small regression model with BatchNormalization and a float learning rate.
MODEL_FILE = """
import keras
import tensorflow as tf


def custom_model():
    inputs = keras.Input(shape=(4,), name="x")
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    hidden = keras.layers.BatchNormalization()(hidden)
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def feed(dataset, mode, metadata):
    return dataset


def loss(labels, predictions):
    return tf.reduce_mean(tf.square(labels - predictions))


def optimizer():
    return keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)


def eval_metrics_fn():
    return {}
"""


class _MasterOf:
    """What a worker's master client does for the group, against ``manager`` in this process."""

    def __init__(self, manager: RendezvousManager, worker_id: int) -> None:
        self.manager = manager
        self.worker_id = worker_id

    def rendezvous(
        self,
        address: str,
        report: master_pb2.RendezvousRequest | None = None,
        budget_seconds: float | None = None,
    ) -> master_pb2.RendezvousResponse:
        current = self.manager.rendezvous(self.worker_id, address, report)
        return self.manager.response(current, self.worker_id)

    def report_collective_failure(self, round_id: int, suspect_worker_id: int, message: str) -> None:
        self.manager.report_failure(self.worker_id, round_id, suspect_worker_id, message)


class _Group:
    """Replicas of one model by worker id, all on one :class:`RendezvousManager`."""

    def __init__(self, model_file: Path, timeout: float = 20.0, **replica_options: Any) -> None:
        self.spec = load_model_spec(str(model_file))
        self.manager = RendezvousManager()
        self.replicas: dict[int, AllreduceReplica] = {}
        self._timeout = timeout
        self._options = replica_options

    def add(self, worker_id: int, join: bool = True) -> AllreduceReplica:
        replica = AllreduceReplica(
            self.spec,
            _MasterOf(self.manager, worker_id),
            "127.0.0.1",
            collective_timeout=self._timeout,
            **self._options,
        )
        replica.ensure_built(_batches(1)[0][0])  # here: Keras names layers unsafely across threads
        self.replicas[worker_id] = replica
        if join:
            self.join(worker_id)
        return replica

    def join(self, worker_id: int) -> None:
        """The worker's first (or next) rendezvous call: it is a member of the next round."""
        self.manager.rendezvous(worker_id, self.replicas[worker_id].address)
        self.settle()

    def leave(self, worker_id: int) -> None:
        """The worker closes (its last report) and its pod stops."""
        self.replicas.pop(worker_id).close()
        self.manager.remove(worker_id, "Completed")
        self.settle()

    def drop(self, reporter: int, suspect: int) -> None:
        """``reporter`` reports ``suspect`` as silent in the current round (it is alive: it joins again
        when it next steps)."""
        self.manager.report_failure(reporter, self.manager.current.round_id, suspect, "silent")
        self.settle()

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until every replica that formed a round the master has since left knows it (by its watch,
        within about a second), so that its next step is in the master's round, as the tests' plans are."""
        current = self.manager.current.round_id
        deadline = time.monotonic() + timeout
        for replica in self.replicas.values():
            member = replica._member
            while member.current is not None and member.current.round_id != current and not member.stale:
                assert time.monotonic() < deadline, "a member never noticed that its round ended"
                time.sleep(0.05)

    def committed_reaches(self, version: int, checkpoint: int = 0, timeout: float = 10.0) -> None:
        """Wait until the master committed ``version`` and, if ``checkpoint``, recorded a checkpoint of that
        version or newer (members report by their watch, about every second, each what it knows: the
        checkpoint comes from the member that saved it, maybe a report after the version)."""
        deadline = time.monotonic() + timeout
        manager = self.manager

        def seen() -> bool:
            committed, saved = manager.committed, manager.checkpoint
            return (committed is not None and committed.version >= version) and (
                not checkpoint or (saved is not None and saved.version >= checkpoint)
            )

        while not seen():
            assert time.monotonic() < deadline, (
                f"committed {manager.committed}, checkpoint {manager.checkpoint}: "
                f"never version {version} and checkpoint {checkpoint}"
            )
            time.sleep(0.05)

    def steps(
        self,
        workers: Sequence[int],
        batches: Sequence[Batch | None],
        after_step: Callable[[int, AllreduceReplica], None] = lambda worker, replica: None,
    ) -> None:
        """Each of ``workers`` trains on ``batches`` in order (one group step per batch), in threads."""
        self.run({worker: batches for worker in workers}, after_step)

    def run(
        self,
        plan: dict[int, Sequence[Batch | None]],
        after_step: Callable[[int, AllreduceReplica], None] = lambda worker, replica: None,
    ) -> None:
        """Each worker of ``plan`` takes one group step per item of its list, in a thread of its own: a batch
        to train on, or None for a step without data."""
        errors: list[BaseException] = []

        def run(worker: int) -> None:
            try:
                for batch in plan[worker]:
                    replica = self.replicas[worker]
                    if batch is None:
                        replica.idle_step()
                    else:
                        replica.train_minibatch(*batch)
                    after_step(worker, replica)
            except BaseException as error:  # re-raised below
                errors.append(error)

        threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in plan]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
            assert not thread.is_alive(), "a replica hung"
        if errors:
            raise errors[0]

    def close(self) -> None:
        for replica in self.replicas.values():
            replica.close()


def _batches(count: int, size: int = 8, seed: int = 0) -> list[Batch]:
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((size, 4)).astype(np.float32), rng.standard_normal((size, 1)).astype(np.float32))
        for _ in range(count)
    ]


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "bn_model.py"
    path.write_text(MODEL_FILE)
    return path


def test_a_scaled_float_learning_rate_is_the_same_on_every_replica_across_a_leave_and_a_rejoin(
    model_file: Path,
) -> None:
    """Worker 1 is dropped from the group (reported as silent) while alive, worker 0 trains alone (rate x1),
    then worker 1 joins again and takes worker 0's state, which holds the rate of a group of one: every
    replica must scale it back to the group of two."""
    group = _Group(model_file, scale_lr_by_world_size=True)
    rates: dict[int, list[tuple[int, float]]] = {0: [], 1: []}

    def record(worker: int, replica: AllreduceReplica) -> None:
        rates[worker].append((replica.version, float(np.asarray(replica._optimizer.learning_rate))))

    try:
        group.add(0), group.add(1)
        group.steps([0, 1], _batches(3, seed=1), record)
        group.drop(0, 1)  # worker 1 is alive: it re-joins
        group.steps([0], _batches(2, seed=2), record)
        group.join(1)
        group.steps([0, 1], _batches(3, seed=3), record)
    finally:
        group.close()
    assert [r for _, r in rates[0]] == pytest.approx([0.02] * 3 + [0.01] * 2 + [0.02] * 3)
    assert rates[1] == rates[0][:3] + rates[0][5:]  # the same rate at the same version


def _max_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(
        float(np.max(np.abs(x.astype(np.float64) - y), initial=0.0)) for x, y in zip(a, b, strict=True)
    )


def _example_weighted_statistics(
    plan: dict[int, Sequence[Batch | None]],
    hidden: list[tuple[np.ndarray, np.ndarray]],
    weighted: bool = True,
) -> list[np.ndarray]:
    """``MODEL_FILE``'s BatchNormalization moving mean and variance after the group steps of ``plan``, when
    each step adds the mean of the members' own updates (``0.99 × old + 0.01 × their batch's mean or
    biased variance``), weighted by the members' examples (``weighted=False``: each member counts once).
    ``hidden[s]``: the first Dense layer's kernel and bias before step ``s``; a member with no batch (None)
    contributes nothing."""
    mean, variance = np.zeros(8), np.ones(8)
    for step, (kernel, bias) in enumerate(hidden):
        inputs = [
            np.maximum(b[0].astype(np.float64) @ kernel + bias, 0.0)
            for b in (p[step] for p in plan.values())
            if b
        ]
        weights = np.array([len(h) if weighted else 1 for h in inputs], np.float64)
        weights /= weights.sum()
        mean, variance = (
            sum(w * (0.99 * mean + 0.01 * h.mean(axis=0)) for w, h in zip(weights, inputs, strict=True)),
            sum(w * (0.99 * variance + 0.01 * h.var(axis=0)) for w, h in zip(weights, inputs, strict=True)),
        )
    return [mean, variance]


def test_batch_normalization_statistics_are_the_example_weighted_mean_on_every_replica(
    model_file: Path,
) -> None:
    """Two members train on different rows with different batch sizes (8 and 3 rows, then one member idle
    for a step): BatchNormalization's moving statistics, which no gradient reaches, end bit-identical
    everywhere, at the example-weighted mean of what each member's batch made of them, step after step."""
    plan: dict[int, Sequence[Batch | None]] = {
        0: _batches(5, size=8, seed=5),
        1: [*_batches(4, size=3, seed=6), None],
    }
    group = _Group(model_file)
    hidden: list[tuple[np.ndarray, np.ndarray]] = []

    def record_hidden(worker: int, replica: AllreduceReplica) -> None:
        if worker == 0:  # the same values on every member; read between worker 0's steps
            hidden.append(tuple(np.array(v.numpy(), np.float64) for v in replica.model.layers[1].weights))

    try:
        first, second = group.add(0), group.add(1)
        record_hidden(0, first)
        group.run(plan, record_hidden)
        states = [first.export_state().values, second.export_state().values]
        statistics = [np.array(v.numpy()) for v in first.model.non_trainable_variables]
    finally:
        group.close()
    assert _max_difference(*states) == 0.0
    expected = _example_weighted_statistics(plan, hidden[:-1])
    for value, want in zip(statistics, expected, strict=True):
        np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-6)
    # The check tells an unweighted mean apart (steps of 8 and 3 rows weigh 8/11 and 3/11, not 1/2 each).
    unweighted = _example_weighted_statistics(plan, hidden[:-1], weighted=False)
    apart = max(float(np.max(np.abs(u - w))) for u, w in zip(unweighted, expected, strict=True))
    print(f"bn_unweighted_vs_weighted max_abs={apart:.3g}")
    assert apart > 1e-4


def test_replacing_every_member_of_a_group_loses_no_step(model_file: Path) -> None:
    """Workers 0 and 1 train; 2 and 3 join and train with them; 0 and 1 leave; 2 and 3 go on from
    where the group was: every step is kept, and the master committed the group's progress."""
    group = _Group(model_file)
    try:
        group.add(0), group.add(1)
        group.steps([0, 1], _batches(3, seed=7))
        group.add(2), group.add(3)
        group.steps([0, 1, 2, 3], _batches(2, seed=8))
        group.leave(0), group.leave(1)
        group.steps([2, 3], _batches(2, seed=9))
        versions = [group.replicas[w].version for w in (2, 3)]
        states = [group.replicas[w].export_state().values for w in (2, 3)]
    finally:
        group.close()
    assert versions == [7, 7]
    assert _max_difference(*states) == 0.0
    assert group.manager.restores == [] and group.manager.steps_lost == 0
    assert group.manager.committed is not None and group.manager.committed.version == 7  # 0 and 1 closed


def test_a_group_of_new_members_restores_the_committed_checkpoint_and_counts_the_steps_lost(
    model_file: Path, tmp_path: Path
) -> None:
    """Workers 2 and 3 start before any checkpoint exists (so they hold no state), then every member that
    held the model leaves at once. The new group must not start over from a fresh model: it restores the
    checkpoint the master recorded (version 4), and the master logs and counts the steps it knew of since."""
    group = _Group(model_file, checkpoint_storage=LocalStorage(tmp_path / "checkpoints"), checkpoint_steps=4)
    try:
        group.add(0), group.add(1)
        group.add(2, join=False), group.add(3, join=False)
        group.steps([0, 1], _batches(6, seed=10))
        assert group.replicas[0]._checkpointer is not None and group.replicas[0]._checkpointer.wait(30)
        group.steps([0, 1], _batches(1, seed=11))
        group.committed_reaches(7, checkpoint=4)  # their watch reports version 7 and checkpoint 4
        assert group.manager.checkpoint is not None and group.manager.checkpoint.version == 4
        group.leave(0), group.leave(1)
        group.join(2), group.join(3)
        group.steps([2, 3], _batches(2, seed=12))
        versions = [group.replicas[w].version for w in (2, 3)]
    finally:
        group.close()
    assert versions == [6, 6]  # 4 restored + 2 steps, not 0 + 2
    assert group.manager.restores == [
        {
            "round": group.manager.restores[0]["round"],
            "origin": "checkpoint",
            "committed_version": 7,
            "restored_version": 4,
            "steps_lost": 3,
        }
    ]
    assert group.manager.steps_lost == 3


def test_a_member_left_behind_never_overrides_the_group_and_a_step_back_is_counted(model_file: Path) -> None:
    """Worker 1 is dropped (silent) at version 3 while alive; worker 0 trains on to version 6 and leaves.
    When worker 1 comes back alone, its state is behind the committed one: with no checkpoint it is all
    there is, so the group goes on from it, and the master records that 3 committed steps were lost."""
    group = _Group(model_file)
    try:
        group.add(0), group.add(1)
        group.steps([0, 1], _batches(3, seed=13))
        group.drop(0, 1)
        group.steps([0], _batches(3, seed=14))
        group.leave(0)
        group.join(1)
        group.steps([1], _batches(1, seed=15))
        version = group.replicas[1].version
    finally:
        group.close()
    assert version == 4
    assert [(r["origin"], r["committed_version"], r["restored_version"]) for r in group.manager.restores] == [
        ("member", 6, 3)  # worker 0 reported its last step as it closed
    ]
    assert group.manager.steps_lost == 3


class _CountingMaster(_MasterOf):
    """:class:`_MasterOf` that counts the calls: joins (the step loop's) and watch reports apart."""

    def __init__(self, manager: RendezvousManager, worker_id: int) -> None:
        super().__init__(manager, worker_id)
        self.calls = 0
        self.watch_calls = 0

    def rendezvous(
        self,
        address: str,
        report: master_pb2.RendezvousRequest | None = None,
        budget_seconds: float | None = None,
    ) -> master_pb2.RendezvousResponse:
        if report is not None and report.watch:
            self.watch_calls += 1
        else:
            self.calls += 1
        return super().rendezvous(address, report, budget_seconds)


def test_steps_in_a_standing_round_make_no_master_call_and_a_lone_member_no_collective(
    model_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a round formed, a group step asks the master nothing (only the background watch reports, about
    once a second), and a group of one runs no collective operation at all."""
    from edl_argo.collective.group import CollectiveGroup

    rings: list[int] = []
    ring = CollectiveGroup._ring
    monkeypatch.setattr(
        CollectiveGroup, "_ring", lambda self, vector: rings.append(self.size) or ring(self, vector)
    )
    group = _Group(model_file)
    masters = {w: _CountingMaster(group.manager, w) for w in (0, 1)}
    try:
        for worker, master in masters.items():
            replica = AllreduceReplica(group.spec, master, "127.0.0.1", collective_timeout=20.0)
            replica.ensure_built(_batches(1)[0][0])
            group.replicas[worker] = replica
        group.join(0)
        group.steps([0], _batches(2, seed=16))  # forms a round of one, then trains
        calls, started = masters[0].calls, time.monotonic()
        rings.clear()
        group.steps([0], _batches(30, seed=17))
        assert masters[0].calls == calls and rings == []
        group.join(1)
        group.steps([0, 1], _batches(2, seed=18))  # forms a round of two, then trains
        calls_by_worker = {w: m.calls for w, m in masters.items()}
        rings.clear()
        group.steps([0, 1], _batches(30, seed=19))
        elapsed = time.monotonic() - started
        versions = [group.replicas[w].version for w in (0, 1)]
    finally:
        group.close()
    assert {w: m.calls for w, m in masters.items()} == calls_by_worker
    assert rings == [2] * 60  # one allreduce per member and step
    assert versions == [64, 64]
    # The watch once a second, and a check of the round each half second a collective wait lasts.
    assert masters[0].watch_calls <= 3 * elapsed + 2, (masters[0].watch_calls, elapsed)


class _Unreachable(grpc.RpcError):
    """What a master call from a partitioned worker ends with."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


class _PartitionedMaster(_MasterOf):
    """A worker whose node reaches the world through ``proxy``: its collective server is known by the proxy's
    address, and once :attr:`partitioned` its calls to the master fail as well."""

    def __init__(self, manager: RendezvousManager, worker_id: int) -> None:
        super().__init__(manager, worker_id)
        self.proxy: SilentProxy | None = None
        self.partitioned = False

    def rendezvous(
        self,
        address: str,
        report: master_pb2.RendezvousRequest | None = None,
        budget_seconds: float | None = None,
    ) -> master_pb2.RendezvousResponse:
        if self.partitioned:
            raise _Unreachable()
        assert self.proxy is not None
        return super().rendezvous(self.proxy.address, report, budget_seconds)

    def report_collective_failure(self, round_id: int, suspect_worker_id: int, message: str) -> None:
        if self.partitioned:
            raise _Unreachable()
        super().report_collective_failure(round_id, suspect_worker_id, message)


def _train_in_thread(
    replica: AllreduceReplica, until: Callable[[], bool], errors: list[BaseException]
) -> threading.Thread:
    """A thread that trains ``replica`` until ``until()`` says so (checked before each step), keeping what
    it raised in ``errors``."""

    def train() -> None:
        try:
            for batch in _batches(10_000, seed=replica.version + 100):
                if until():
                    return
                replica.train_minibatch(*batch)
        except BaseException as error:  # asserted by the caller
            errors.append(error)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    return thread


def test_a_member_behind_a_silent_network_path_is_blamed_and_named_stuck_within_the_bound(
    model_file: Path,
) -> None:
    """Worker 1's node goes silent (a proxy in front of it stops forwarding, its master calls fail) while
    both members are inside their steps. Worker 0 blames it within the collective timeout and trains on
    alone; the master names worker 1 stuck once it has been silent for the timeout since (the job then
    restarts it as a dead worker), and its replacement takes the group's state: nothing hangs, the replicas
    stay bit-identical."""
    timeout = 4.0
    group = _Group(model_file, timeout=timeout)
    master = _PartitionedMaster(group.manager, 1)
    stop, silent = threading.Event(), threading.Event()
    survivor_errors: list[BaseException] = []
    partitioned_errors: list[BaseException] = []
    survivor_steps_after = [0]
    try:
        group.add(0)
        partitioned = AllreduceReplica(group.spec, master, "127.0.0.1", collective_timeout=timeout)
        master.proxy = proxy = SilentProxy(partitioned.address)
        partitioned.ensure_built(_batches(1)[0][0])
        group.replicas[1] = partitioned
        group.manager.rendezvous(1, proxy.address)
        group.settle()
        group.steps([0, 1], _batches(3, seed=20))
        survivor = group.replicas[0]

        def survivor_done() -> bool:
            if silent.is_set():
                survivor_steps_after[0] += 1
            return stop.is_set() and survivor_steps_after[0] > 3

        threads = [
            _train_in_thread(survivor, survivor_done, survivor_errors),
            _train_in_thread(partitioned, stop.is_set, partitioned_errors),
        ]
        time.sleep(1.0)  # both train, in lockstep, inside their steps
        proxy.go_silent()
        master.partitioned = True
        silent.set()
        silent_at = time.monotonic()
        stuck: list[int] = []
        while not stuck and time.monotonic() < silent_at + 6 * timeout + 30:
            stuck = group.manager.stuck(timeout)
            time.sleep(0.1)
        named_after = time.monotonic() - silent_at
        group.manager.remove(1, "Stuck")  # what the master does once the restarted pod is gone
        stop.set()
        for thread in threads:
            thread.join(6 * timeout)
            assert not thread.is_alive(), "a member hung"
        group.replicas.pop(1).close()
        proxy.close()
        group.add(2)  # the replacement
        group.steps([0, 2], _batches(2, seed=23))
        versions = [group.replicas[w].version for w in (0, 2)]
        states = [group.replicas[w].export_state().values for w in (0, 2)]
    finally:
        stop.set()
        group.close()
    assert stuck == [1]
    assert named_after <= 2 * timeout + 10, named_after  # blamed within the timeout, then silent for it
    assert not survivor_errors, survivor_errors
    assert partitioned_errors and isinstance(partitioned_errors[0], _Unreachable), partitioned_errors
    assert versions[0] == versions[1] > 3
    assert _max_difference(*states) == 0.0


def test_a_lone_members_non_finite_loss_changes_nothing_and_its_next_minibatch_trains(
    model_file: Path,
) -> None:
    """A group of one takes its whole step in one call. A minibatch whose loss is not finite applies
    nothing: the error names the version, and every variable is as before it, the batch-normalization
    statistics its forward pass moved and the optimizer's state included. The next minibatch trains."""
    group = _Group(model_file)
    try:
        replica = group.add(0)
        group.steps([0], _batches(3, seed=20))
        version = replica.version
        before = [np.array(v.numpy()) for v in replica._state_variables()]
        features, labels = _batches(1, seed=21)[0]
        with pytest.raises(NonFiniteLossError) as raised:
            replica.train_minibatch(features, np.full_like(labels, np.nan))
        assert (raised.value.model_version, replica.version) == (version, version)
        assert np.isnan(raised.value.loss)

        def same() -> list[bool]:
            variables = replica._state_variables()
            return [np.array_equal(old, v.numpy()) for old, v in zip(before, variables, strict=True)]

        assert all(same()), same()
        loss = replica.train_minibatch(features, labels)
        assert np.isfinite(loss) and replica.version == version + 1
        assert same().count(False) >= len(before) // 2, same()  # weights, statistics, optimizer moments
    finally:
        group.close()


def test_a_loss_branching_in_python_on_a_tensor_fails_on_a_member_as_it_fails_in_fit(tmp_path: Path) -> None:
    """A member traces its step as ``fit`` does, without AutoGraph: a Python ``if`` on a tensor's value fails
    in both, and the error names the model file's ``loss``."""
    path = tmp_path / "branching.py"
    path.write_text(MODEL_FILE + PYTHON_BRANCH_ON_A_TENSOR_LOSS)
    group = _Group(path)
    try:
        replica = group.add(0)
        features, labels = _batches(1, seed=30)[0]
        assert_fails_as_in_fit(str(path), replica.train_minibatch, features, labels)
    finally:
        group.close()
