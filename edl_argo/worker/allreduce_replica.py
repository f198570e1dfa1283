"""The worker's model under AllreduceStrategy: a full replica, kept identical on every member by averaging
gradients with a ring allreduce every step (synchronous SGD, no parameter servers).

One *group step* (:meth:`AllreduceReplica.train_minibatch`, or :meth:`~AllreduceReplica.idle_step` for a
member that has no data right now): make sure this member is in the current round
(:class:`~edl_argo.collective.membership.ElasticMember`: no master call while nothing says the round
ended), compute the gradients of its minibatch, allreduce
``[gradients × examples, statistics changes × examples, examples, loss × examples]`` (so members with
different batch sizes, or none, are weighted by their examples), divide by the group's examples and apply
the mean gradients with the model file's optimizer (``optimizer.apply``, exactly as ``model.fit`` does).
A member without data contributes zeros, so members whose tasks ran out keep the others' steps going.

A group of one member skips the collective: it applies its own gradients as they come out of the tape
(tensors throughout, as ``model.fit`` does), and a step without data does nothing.

*Statistics* are the model's non-trainable floating variables, which layers update in the forward pass
(BatchNormalization's moving mean and variance): each member measures how its forward pass changed them,
puts them back, and every member then adds the example-weighted mean change, so they stay bit-identical on
every member (as trainable variables do) and equal what one forward pass over the group's batch would
nearly make of them (exactly for a moving mean). Variables no forward pass changes stay exactly as they are.

A step interrupted by a lost member is abandoned: the suspect is reported, the next round is formed (which
makes every member hold the newest state) and the step is retried in it — unless the state adopted in the
new round already contains this step (its last steps' rounds are part of the state), in which case the
minibatch is not applied twice.

With a checkpoint series (``--checkpoint-dir``), a replica starts from the newest checkpoint, and with
``--checkpoint-steps N`` the member of rank 0 saves the group's state every N versions
(:mod:`edl_argo.collective.checkpoint`): a group that lost every member at once re-forms from it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import keras
import numpy as np
import tensorflow as tf

from edl_argo.checkpoint import Checkpointer, CheckpointSeries
from edl_argo.collective import CollectiveAborted, CollectiveGroup
from edl_argo.collective.checkpoint import decode_state, group_checkpointer, group_checkpoints
from edl_argo.collective.learning_rate import WorldSizeScaling
from edl_argo.collective.membership import ElasticMember, RendezvousClient
from edl_argo.collective.state import GroupState, Lineage, StatePoint
from edl_argo.errors import EdlError, JobFailedError
from edl_argo.log import get_logger
from edl_argo.model import ModelSpec
from edl_argo.model.train_step import StepCall, fit_loss, step_function
from edl_argo.storage.base import Storage
from edl_argo.worker.replica import NonFiniteLossError, build_model
from edl_argo.worker.step_timers import STEP_TIMERS

log = get_logger(__name__)

#: What one step's update returns (:meth:`AllreduceReplica._applied` hands it back).
Applied = TypeVar("Applied")

#: How many times in a row one step may be abandoned before the worker gives up.
MAX_STEP_ATTEMPTS = 50
#: How long closing waits for a checkpoint being written.
CHECKPOINT_CLOSE_SECONDS = 60.0


class AllreduceReplica:
    """A full model replica trained in lockstep with the other members of the group.

    Args:
        master: the worker's master client (rendezvous and failure reports).
        host, port: where this member's collective server listens (port 0: any free port).
        collective_timeout: seconds any single collective wait may take before the peer is blamed.
        scale_lr_by_world_size: multiply the optimizer's learning rate by the number of members (the
            group's batch is that many minibatches), updated whenever the group changes size.
        checkpoint_storage: where the group's checkpoints are (the newest is loaded when the model is
            built); None: no checkpoints.
        checkpoint_steps: as the member of rank 0, save a checkpoint every this many versions (0: never).
    """

    def __init__(
        self,
        spec: ModelSpec,
        master: RendezvousClient,
        host: str,
        port: int = 0,
        collective_timeout: float = 60.0,
        scale_lr_by_world_size: bool = False,
        checkpoint_storage: Storage | None = None,
        checkpoint_steps: int = 0,
    ) -> None:
        self._spec = spec
        self._checkpoints: CheckpointSeries | None = None
        self._checkpointer: Checkpointer[GroupState] | None = None
        if checkpoint_storage is not None:
            self._checkpoints = group_checkpoints(checkpoint_storage)
            if checkpoint_steps:
                self._checkpointer = group_checkpointer(checkpoint_storage, checkpoint_steps)
        self._scale_lr = scale_lr_by_world_size
        self._model: keras.Model | None = None
        self._optimizer: Any = None
        self._lr_scaling: WorldSizeScaling | None = None
        self._lr_world_size = 0
        self._sizes: list[int] = []
        self._statistics: list[Any] = []
        self._trainable_count = 0
        self._state_lock = threading.Lock()
        self._lineage = Lineage()
        self._checkpoint_points: dict[int, StatePoint] = {}  # version -> point of each snapshot submitted
        self._version = -1
        #: The version the last minibatch's group step made (-1: none yet); for
        #: :mod:`edl_argo.worker.step_trace`.
        self.last_update = -1
        self._member = ElasticMember(master, self, host, port, collective_timeout)

    # -- ReplicaState (what the group keeps identical) ----------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def _state_variables(self) -> list[Any]:
        assert self._model is not None
        return [*self._model.variables, *self._optimizer.variables]

    def export_state(self) -> GroupState:
        with self._state_lock:
            if self._model is None:
                raise RuntimeError("the replica is built on its first batch")
            values = [np.asarray(v.numpy()) for v in self._state_variables()]
            return GroupState(-1, self._version, values, self._lineage)

    def import_state(self, state: GroupState) -> None:
        with self._state_lock:
            variables = self._state_variables()
            values = state.values
            mismatches = [
                f"{v.path} {tuple(v.shape)} vs {value.shape}"
                for v, value in zip(variables, values, strict=False)
                if tuple(v.shape) != value.shape
            ]
            if len(values) != len(variables) or mismatches:
                raise JobFailedError(
                    f"the group's state ({len(values)} variables) does not fit this model "
                    f"({len(variables)} variables; {', '.join(mismatches[:2])}): "
                    "do all workers run the same --model-def?"
                )
            for variable, value in zip(variables, values, strict=True):
                variable.assign(value)
            self._version = state.version
            self._lineage = state.lineage
            # The imported optimizer state holds the learning rate its source scaled for its own group.
            self._lr_world_size = 0

    @property
    def lineage(self) -> Lineage:
        return self._lineage

    def held(self) -> tuple[int, Lineage]:
        with self._state_lock:
            return self._version, self._lineage

    @property
    def saved_checkpoint(self) -> StatePoint | None:
        saved = None if self._checkpointer is None else self._checkpointer.saved_version
        return None if saved is None else self._checkpoint_points.get(saved)

    def load_checkpoint(self, point: StatePoint) -> bool:
        """Load the group's checkpoint at ``point.version`` if it is the state ``point`` names."""
        if self._checkpoints is None:
            return False
        key = self._checkpoints.key(point.version)
        where = self._checkpoints.storage.describe(key)
        try:
            state = decode_state(self._checkpoints.storage.read(key), where)
            if state.version != point.version or state.lineage.round_of(point.version) != point.round_id:
                raise JobFailedError(f"it holds version {state.version} of another lineage")
            self.import_state(state)
        except (EdlError, OSError) as error:
            log.warning("checkpoint_not_restored", checkpoint=where, version=point.version, reason=str(error))
            return False
        log.info("replica_restored", version=state.version, checkpoint=where)
        return True

    # -- the replica interface the worker uses -------------------------------------------------------

    @property
    def model(self) -> keras.Model:
        if self._model is None:
            raise RuntimeError("the replica is built on its first batch")
        return self._model

    @property
    def address(self) -> str:
        """host:port of this member's collective server."""
        return self._member.address

    def ensure_built(self, features: Any) -> None:
        if self._model is not None:
            return
        model = build_model(self._spec, features)
        optimizer = self._spec.optimizer()
        optimizer.build(model.trainable_variables)
        not_float32 = [v.path for v in model.trainable_variables if v.dtype != "float32"]
        if not_float32:
            raise JobFailedError(f"AllreduceStrategy averages float32 variables only; not: {not_float32[:3]}")
        self._statistics = [v for v in model.non_trainable_variables if _is_floating(v)]
        self._trainable_count = len(model.trainable_variables)
        # The pieces of a contribution before its examples and loss: gradients, statistics changes, and
        # one flag per trainable variable (whether it has a gradient).
        self._sizes = [int(np.prod(v.shape)) for v in [*model.trainable_variables, *self._statistics]]
        self._sizes.append(self._trainable_count)
        self._optimizer = optimizer
        if self._scale_lr:
            self._lr_scaling = WorldSizeScaling(optimizer)
        with self._state_lock:
            self._model = model
        self._contribute = StepCall(self._contribution)
        self._apply = step_function(self._apply_mean)
        self._solo = StepCall(self._step_alone)
        self._forward = StepCall(lambda f: self.model(f, training=False))
        log.info("replica_built", variables=len(model.variables), parameters=model.count_params())
        self._restore_checkpoint()

    def sync(self) -> None:
        """Hold the group's current state (join or re-form the round if needed)."""
        self._current_group()

    def flush(self) -> None:
        """Nothing is in flight between steps."""

    def predict(self, features: Any) -> Any:
        self.ensure_built(features)
        return self._forward(features)

    def train_minibatch(self, features: Any, labels: Any) -> float:
        """One group step with this minibatch; returns its loss."""
        self.ensure_built(features)
        self.last_update = -1
        loss, _ = self._group_step((features, labels))
        return loss

    def idle_step(self) -> bool:
        """A group step without data (the master has no task for this worker now).

        Returns whether the group did any work: False means every member was idle, and the caller
        should back off before asking again.
        """
        if self._model is None:
            return False  # not a member yet: a worker joins with its first training batch
        _, group_examples = self._group_step(None)
        return group_examples > 0

    def close(self) -> None:
        """Leave: stop this member's collective server (after a checkpoint being saved is written)."""
        if self._checkpointer is not None and not self._checkpointer.wait(CHECKPOINT_CLOSE_SECONDS):
            log.warning("checkpoint_unfinished", waited_s=CHECKPOINT_CLOSE_SECONDS)
        self._member.close()

    # -- internals ------------------------------------------------------------------------------------

    def _loss_and_gradients(self, features: Any, labels: Any) -> tuple[tf.Tensor, list[Any], tf.Tensor]:
        """The forward and backward pass of one minibatch: (loss as float32, gradients of the trainable
        variables (None where a variable has none), examples as float32). Updates the statistics."""
        model = self.model
        with tf.GradientTape() as tape:
            outputs = model(features, training=True)
            loss = fit_loss(self._spec.loss, labels, outputs, None, model.losses)
            scaled_loss = self._optimizer.scale_loss(loss)  # the optimizer unscales when it applies
        grads = tape.gradient(scaled_loss, model.trainable_variables)
        examples = tf.cast(tf.shape(tf.nest.flatten(outputs)[0])[0], tf.float32)
        return tf.cast(loss, tf.float32), grads, examples

    def _contribution(self, features: Any, labels: Any) -> tf.Tensor:
        """This member's part of a group step: its gradients and changes to the statistics, both times its
        examples, then its examples and loss times examples, as one float32 vector. The statistics are left
        as they were (the group's mean change is applied with the gradients)."""
        before = [tf.identity(v) for v in self._statistics]
        loss, grads, examples = self._loss_and_gradients(features, labels)
        variables = self.model.trainable_variables
        changes = [tf.cast(v - old, tf.float32) for v, old in zip(self._statistics, before, strict=True)]
        for variable, old in zip(self._statistics, before, strict=True):
            variable.assign(old)
        flat = [
            tf.reshape(tf.zeros_like(v) if g is None else tf.convert_to_tensor(g), [-1])
            for v, g in zip(variables, grads, strict=True)
        ] + [tf.reshape(change, [-1]) for change in changes]
        flat.append(tf.constant([0.0 if g is None else 1.0 for g in grads], tf.float32))
        return tf.concat([tf.concat(flat, 0) * examples, tf.stack([examples, loss * examples])], 0)

    def _step_alone(self, features: Any, labels: Any) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """A lone member's whole step, in one call as ``fit``'s: :meth:`_loss_and_gradients`, then, if the
        loss is finite, its own gradients applied with the optimizer (the statistics its forward pass
        updated stay updated, as in ``fit``); else nothing applied and the statistics put back. Returns
        (loss, examples, whether it applied). One call instead of two saves handing every gradient out of
        the first and into the second (2 ms of a 12 ms Transformer step, measured)."""
        before = [tf.identity(v) for v in self._statistics]
        loss, grads, examples = self._loss_and_gradients(features, labels)

        def apply() -> tf.Tensor:
            variables = self.model.trainable_variables
            self._optimizer.apply_gradients(
                [(g, v) for g, v in zip(grads, variables, strict=True) if g is not None]
            )
            return tf.constant(True)

        def put_back() -> tf.Tensor:
            for variable, value in zip(self._statistics, before, strict=True):
                variable.assign(value)
            return tf.constant(False)

        applied = tf.cond(tf.math.is_finite(loss), apply, put_back)
        return loss, examples, applied

    def _apply_mean(self, total: tf.Tensor, has_gradient: tuple[bool, ...]) -> None:
        """Apply the group's mean gradients (``total``: the allreduced contributions) with the optimizer
        (variables without a gradient on any member are left out, as ``fit`` leaves them out) and add the
        mean changes to the statistics."""
        variables = self.model.trainable_variables
        mean = total[:-2] / total[-2]
        pieces = tf.split(mean, self._sizes)
        grads = [
            tf.reshape(p, v.shape) if present else None
            for p, v, present in zip(pieces, variables, has_gradient, strict=False)
        ]
        self._optimizer.apply_gradients(zip(grads, variables, strict=True))
        statistics = pieces[len(variables) : len(variables) + len(self._statistics)]
        for variable, piece in zip(self._statistics, statistics, strict=True):
            variable.assign_add(tf.cast(tf.reshape(piece, variable.shape), variable.dtype))

    def _current_group(self) -> CollectiveGroup:
        """The group of the current round, joining or re-forming it first if needed."""
        for _ in range(MAX_STEP_ATTEMPTS):
            try:
                group = self._member.group()
            except CollectiveAborted as error:
                self._member.abandon(error)
                continue
            self._scale_learning_rate(group.size)
            return group
        raise JobFailedError(f"forming a round was abandoned {MAX_STEP_ATTEMPTS} times in a row")

    def _group_step(self, batch: tuple[Any, Any] | None) -> tuple[float, float]:
        """One group step with ``batch`` (None: an idle member's zeros); returns (loss, group examples).

        A step a lost peer interrupts is retried in the next round, unless the state adopted when that
        round formed already contains it.
        """
        interrupted: tuple[int, int] | None = None  # (version before, round) of an abandoned attempt
        loss_value = 0.0
        for _ in range(MAX_STEP_ATTEMPTS):
            group = self._current_group()
            if interrupted is not None and self._contains_step(*interrupted):
                log.info("interrupted_step_already_applied", version=self._version)
                if batch is not None:
                    self.last_update = interrupted[0] + 1
                return loss_value, 1.0
            before = self._version
            if group.size == 1:
                return self._solo_step(group, batch)
            if batch is None:
                contribution = np.zeros(sum(self._sizes) + 2, dtype=np.float32)
            else:
                contribution = self._contribute(*batch).numpy()
                loss_value = float(contribution[-1] / contribution[-2])
                if not np.isfinite(loss_value):
                    # Before this member's step: it contributes nothing; skipped or fatal (--nan-loss).
                    raise NonFiniteLossError(loss_value, self._version)
            try:
                with STEP_TIMERS.section("peers"):
                    total = group.allreduce(contribution)
            except CollectiveAborted as error:
                self._member.abandon(error)
                interrupted = (before, group.round_id)
                continue
            examples = float(total[-2])
            if examples > 0:
                flags = total[len(total) - 2 - self._trainable_count : len(total) - 2]
                has_gradient = tuple(bool(flag) for flag in flags > 0)
                self._applied(group, partial(self._apply, tf.convert_to_tensor(total), has_gradient))
                if batch is not None:
                    self.last_update = self._version
            return loss_value, examples
        raise JobFailedError(f"a synchronous step was abandoned {MAX_STEP_ATTEMPTS} times in a row")

    def _solo_step(self, group: CollectiveGroup, batch: tuple[Any, Any] | None) -> tuple[float, float]:
        """A group step in a group of one: no collective; without data, nothing to do."""
        if batch is None:
            return 0.0, 0.0

        def step() -> tuple[float, float]:
            loss, examples, applied = self._solo(*batch)
            if not bool(applied):  # before this step: nothing changed; skipped or fatal (--nan-loss)
                raise NonFiniteLossError(float(loss), self._version)
            return float(loss), float(examples)

        loss_and_examples = self._applied(group, step)
        self.last_update = self._version
        return loss_and_examples

    def _applied(self, group: CollectiveGroup, apply: Callable[[], Applied]) -> Applied:
        """Run ``apply`` (one step's update) as the next version of the state made in ``group``'s round, then
        checkpoint if due; what ``apply`` returned."""
        with self._state_lock:
            self._schedule_learning_rate()
            result = apply()
            self._version += 1
            first_of_round = self._lineage.round_of(self._version - 1) != group.round_id
            self._lineage = self._lineage.after_step(self._version, group.round_id)
        if first_of_round:  # training goes on in this round (after a join, a loss, a scale)
            log.info("round_first_step", round=group.round_id, version=self._version, world_size=group.size)
        if group.rank == 0:
            self._maybe_checkpoint(group.round_id)
        return result

    def _restore_checkpoint(self) -> None:
        """Start from the group's newest checkpoint, if there is one (before joining any round)."""
        if self._checkpoints is None:
            return
        state = self._checkpoints.newest(decode_state)
        if state is None:
            return
        where = self._checkpoints.storage.describe(self._checkpoints.key(state.version))
        try:
            self.import_state(state)
        except JobFailedError as error:
            raise JobFailedError(f"checkpoint {where}: {error}") from None
        if self._checkpointer is not None:
            self._checkpointer.mark(state.version)
        log.info("replica_restored", version=state.version, checkpoint=where)

    def _maybe_checkpoint(self, round_id: int) -> None:
        """As the member of rank 0: submit the group's state when a checkpoint is due."""
        if self._checkpointer is None or not self._checkpointer.due(self._version):
            return
        state = self.export_state()
        saved, point = self.saved_checkpoint, state.lineage.point(state.version)
        self._checkpoint_points = {p.version: p for p in (saved, point) if p is not None}
        self._checkpointer.submit(GroupState(round_id, state.version, state.values, state.lineage))

    def _contains_step(self, version_before: int, round_id: int) -> bool:
        """Whether the state now held includes the step attempted at ``version_before`` in ``round_id``."""
        return self._version > version_before and self._lineage.round_of(version_before + 1) == round_id

    def _schedule_learning_rate(self) -> None:
        """The model's ``LearningRateScheduler``: the rate of the step from the current version (every member
        holds the same version, so all set the same rate)."""
        learning_rate_at = self._spec.learning_rate_at
        if learning_rate_at is None:
            return
        rate = learning_rate_at(max(self._version, 0))
        if self._lr_scaling is not None:
            self._lr_scaling.set_base(rate)
        else:
            self._optimizer.learning_rate = rate

    def _scale_learning_rate(self, world_size: int) -> None:
        if self._lr_scaling is None or world_size == self._lr_world_size:
            return
        rate = self._lr_scaling.set(world_size)
        self._lr_world_size = world_size
        log.info(
            "learning_rate_scaled", world_size=world_size, learning_rate=rate, unscaled=rate / world_size
        )


def _is_floating(variable: Any) -> bool:
    return "float" in keras.backend.standardize_dtype(variable.dtype)
