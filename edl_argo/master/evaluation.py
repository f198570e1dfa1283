"""Periodic and final evaluation: rounds of evaluation tasks, metrics aggregated on the master.

Every ``evaluation_steps`` model versions (as reported by workers) and once when training ends, an
evaluation round over the validation shards is queued. Workers send model outputs and labels per task;
the master feeds them to the metrics of the model file's ``eval_metrics_fn()``: a Keras metric is
updated with ``update_state(labels, outputs)``; a plain function ``fn(labels, outputs)`` returns
per-record values whose mean is the metric (ElasticDL's convention), or one value for the whole batch (a
mean), which is weighted by the batch's records.

Outputs and labels arrive named (:mod:`edl_argo.model.outputs`). ``eval_metrics_fn()`` returns either
``{metric name: metric}``, fed the model's output as it returns it (one array, or a dict of them for a
multi-output model) and the labels as ``feed`` gives them; or, for a multi-output model as Keras compiles
one, ``{output name: {metric name: metric}}``, each fed that output and the labels of the same name (or
the only labels). The results of the second form are named ``<output>_<metric>``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edl_argo.log import get_logger
from edl_argo.master.task_dispatcher import TaskDispatcher
from edl_argo.model.outputs import as_given

log = get_logger(__name__)


class MetricsRefusedError(ValueError):
    """The model's metrics refuse a batch of outputs and labels (their caller's fault, not the master's):
    rows that do not match, an output the model does not have, or a metric that fails on them."""


class MetricsAccumulator:
    """Aggregates one evaluation round's metrics over batches of (outputs, labels)."""

    def __init__(self, eval_metrics_fn: Callable[[], Mapping[str, Any]]) -> None:
        #: result name -> (output name or None for the whole output, metric)
        self._targets: dict[str, tuple[str | None, Any]] = {}
        for name, metric in eval_metrics_fn().items():
            if isinstance(metric, Mapping):
                for metric_name, output_metric in metric.items():
                    self._targets[f"{name}_{metric_name}"] = (str(name), output_metric)
            else:
                self._targets[str(name)] = (None, metric)
        self._metrics = {name: metric for name, (_, metric) in self._targets.items()}
        self._sums: dict[str, float] = dict.fromkeys(self._metrics, 0.0)
        self._counts: dict[str, int] = dict.fromkeys(self._metrics, 0)
        self.records = 0

    def update(self, outputs: Mapping[str, np.ndarray], labels: Mapping[str, np.ndarray]) -> None:
        """Add one batch: named outputs and labels (:func:`~edl_argo.model.outputs.named_arrays`).

        :class:`MetricsRefusedError` (one line naming the metric) if they do not have the same number of rows,
        a metric names an output the model does not have, a metric (the model's code) raises on them, or a
        plain function returns neither one value per record nor one for the batch. Any other exception is a
        bug of the master's.
        """
        count = len(next(iter(labels.values())))
        if any(len(array) != count for array in (*outputs.values(), *labels.values())):
            raise MetricsRefusedError("outputs and labels must have one row per record, as many of each")
        for name, (output, metric) in self._targets.items():
            if output is None:
                batch_outputs, batch_labels = as_given(outputs), as_given(labels)
            elif output not in outputs:
                raise MetricsRefusedError(
                    f"metric {name} is for output {output!r}; the model's are {sorted(outputs)}"
                )
            else:
                batch_outputs = outputs[output]
                batch_labels = labels[output] if output in labels else as_given(labels)
            try:  # the model's code, on the caller's outputs
                if hasattr(metric, "update_state"):
                    metric.update_state(batch_labels, batch_outputs)
                    continue
                values = np.asarray(metric(batch_labels, batch_outputs), dtype=np.float64).ravel()
            except Exception as error:
                first_line = (str(error).splitlines() or [""])[0]
                raise MetricsRefusedError(f"metric {name}: {type(error).__name__}: {first_line}") from error
            if values.size == count:
                self._sums[name] += float(values.sum())
            elif values.size == 1:  # a mean over the batch: weighted by its records
                self._sums[name] += float(values[0]) * count
            else:
                raise MetricsRefusedError(
                    f"metric {name} returned {values.size} values for {count} records: "
                    "return one per record, or one for the batch"
                )
            self._counts[name] += count
        self.records += count

    def state(self) -> dict[str, Any]:
        """What was aggregated so far, as JSON data (a Keras metric's variables as nested lists)."""
        return {
            "records": self.records,
            "sums": dict(self._sums),
            "counts": dict(self._counts),
            "variables": {
                name: [np.asarray(variable).tolist() for variable in metric.variables]
                for name, metric in self._metrics.items()
                if hasattr(metric, "update_state")
            },
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state` data; ValueError if it does not fit these metrics."""
        self.records = int(state["records"])
        self._sums.update({name: float(state["sums"][name]) for name in self._sums})
        self._counts.update({name: int(state["counts"][name]) for name in self._counts})
        for name, values in state["variables"].items():
            variables = self._metrics[name].variables
            if len(variables) != len(values):
                raise ValueError(f"metric {name} has {len(variables)} variables, the state {len(values)}")
            for variable, value in zip(variables, values, strict=True):
                variable.assign(np.asarray(value))

    def result(self) -> dict[str, float]:
        results = {}
        for name, metric in self._metrics.items():
            if hasattr(metric, "result"):
                results[name] = float(np.asarray(metric.result()))
            else:
                results[name] = self._sums[name] / self._counts[name] if self._counts[name] else float("nan")
        return results


@dataclass
class EvaluationRecord:
    """The metrics of one round: the model version evaluated and whether it was the final round."""

    model_version: int
    metrics: dict[str, float]
    records: int
    final: bool = False


@dataclass
class _Round:
    accumulator: MetricsAccumulator
    final: bool
    tasks_reported: set[int] = field(default_factory=set)


@dataclass
class EvaluationService:
    """Creates evaluation rounds on the dispatcher and aggregates their outputs.

    Wire :meth:`round_complete` as the dispatcher's ``on_evaluation_complete`` callback.
    """

    eval_metrics_fn: Callable[[], Mapping[str, Any]]
    validation_shards: Mapping[str, int]
    evaluation_steps: int
    dispatcher: TaskDispatcher | None = None
    history: list[EvaluationRecord] = field(default_factory=list)
    _rounds: dict[int, _Round] = field(default_factory=dict)
    _last_evaluated_step: int = 0
    _final_requested: bool = False
    _final_done: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def enabled(self) -> bool:
        return bool(self.validation_shards)

    def on_model_version(self, model_version: int) -> None:
        """A worker saw ``model_version``; start a round if ``evaluation_steps`` versions passed."""
        if not self.enabled or self.evaluation_steps <= 0:
            return
        with self._lock:
            if model_version - self._last_evaluated_step < self.evaluation_steps or self._final_requested:
                return
            self._last_evaluated_step = model_version
            created = self._register_round(model_version, final=False)
        if created:
            self._create_tasks(model_version)

    def start_final_round(self, model_version: int) -> bool:
        """Queue the final round once; False if it was already queued or there is nothing to evaluate."""
        with self._lock:
            if self._final_requested or not self.enabled:
                if not self.enabled:
                    self._final_done.set()
                return False
            self._final_requested = True
            done = next((r for r in self.history if r.model_version == model_version), None)
            if done is not None:  # this version was just evaluated: that round is the final one
                done.final = True
                self._final_done.set()
                return False
            created = self._register_round(model_version, final=True)
        if created:
            self._create_tasks(model_version)
        return True

    def _register_round(self, model_version: int, final: bool) -> bool:
        """With the lock held: open the round of ``model_version`` (True), or mark the open one final.

        The decision to evaluate and the open round it makes are one change to the state a snapshot sees:
        a snapshot taken before the round's tasks exist holds the round, which :meth:`restore` starts
        again (a requested final round without a round, restored, would be waited for forever)."""
        if model_version in self._rounds:
            self._rounds[model_version].final |= final
            return False
        self._rounds[model_version] = _Round(MetricsAccumulator(self.eval_metrics_fn), final)
        return True

    def _create_tasks(self, model_version: int) -> None:
        assert self.dispatcher is not None, "EvaluationService.dispatcher is set by the master"
        self.dispatcher.create_evaluation_tasks(self.validation_shards, model_version)

    def report_outputs(self, task_id: int, model_version: int, outputs: Any, labels: Any) -> bool:
        """Add one task's outputs to its round; a task re-run after a failure counts once."""
        with self._lock:
            current = self._rounds.get(model_version)
            if current is None or task_id in current.tasks_reported:
                return False
            current.tasks_reported.add(task_id)
            current.accumulator.update(outputs, labels)
            return True

    def round_complete(self, model_version: int) -> None:
        """The dispatcher completed the last task of the round of ``model_version``: record its metrics.

        The round leaves the open rounds and enters the history (and the final round sets
        :attr:`final_done`) in one step under the lock, so no snapshot sees it in neither."""
        with self._lock:
            current = self._rounds.pop(model_version, None)
            if current is None:
                return
            record = EvaluationRecord(
                model_version, current.accumulator.result(), current.accumulator.records, current.final
            )
            self.history.append(record)
            if current.final:
                self._final_done.set()
        shown = " ".join(f"{name}={value:.6g}" for name, value in sorted(record.metrics.items()))
        log.info(
            "evaluation_done",
            message=f"Evaluation of model version {model_version}: {shown}",  # found by `grep Evaluation`
            model_version=model_version,
            records=record.records,
            final=record.final,
            **{k: round(v, 6) for k, v in record.metrics.items()},
        )

    def snapshot(self) -> dict[str, Any]:
        """History, open rounds (with what they aggregated) and scheduling state, as JSON data.

        Take it *after* the dispatcher's snapshot: a task a worker reported done had its outputs
        reported before, so every evaluation task done in that dispatcher snapshot is in this one.
        """
        with self._lock:
            return {
                "history": [dataclasses.asdict(record) for record in self.history],
                "rounds": {
                    str(version): {
                        "final": current.final,
                        "tasks_reported": sorted(current.tasks_reported),
                        "accumulator": current.accumulator.state(),
                    }
                    for version, current in self._rounds.items()
                },
                "last_evaluated_step": self._last_evaluated_step,
                "final_requested": self._final_requested,
                "final_done": self._final_done.is_set(),
            }

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        """Continue from :meth:`snapshot` data, once :attr:`dispatcher` is the restored dispatcher.

        An open round whose tasks the dispatcher still has keeps what it aggregated (a task's outputs
        count once, by task id). An open round the dispatcher has no task of (its tasks were created
        after the dispatcher's snapshot, or all completed just before the evaluation's) is started
        again from scratch.

        The evaluation's snapshot may be newer than the dispatcher's (it is taken after, while workers go
        on). A final round requested, or done, when the restored dispatcher still has training to do
        evaluated a model that training will change again: the request is withdrawn (no round is final
        any more), and the final round is requested again when training ends. Raises KeyError,
        ValueError or TypeError on data that does not fit.
        """
        assert self.dispatcher is not None, "EvaluationService.dispatcher is set by the master"
        rounds = {int(version): data for version, data in snapshot["rounds"].items()}
        pending = {version for version in rounds if self.dispatcher.evaluation_pending(version)}
        trained, training_tasks = self.dispatcher.progress()
        final_valid = trained == training_tasks
        with self._lock:
            self.history = [EvaluationRecord(**record) for record in snapshot["history"]]
            self._last_evaluated_step = int(snapshot["last_evaluated_step"])
            self._final_requested = bool(snapshot["final_requested"]) and final_valid
            if snapshot["final_done"] and final_valid:
                self._final_done.set()
            if not final_valid:
                for record in self.history:
                    record.final = False
            self._rounds = {}
            for version in pending:
                accumulator = MetricsAccumulator(self.eval_metrics_fn)
                accumulator.load_state(rounds[version]["accumulator"])
                reported = {int(task_id) for task_id in rounds[version]["tasks_reported"]}
                final = bool(rounds[version]["final"]) and final_valid
                self._rounds[version] = _Round(accumulator, final, reported)
            restarted = sorted(set(rounds) - pending)
            created = [
                v for v in restarted if self._register_round(v, bool(rounds[v]["final"]) and final_valid)
            ]
        for version in created:
            log.info("evaluation_restarted", model_version=version)
            self._create_tasks(version)

    @property
    def final_done(self) -> bool:
        return self._final_done.is_set() or not self.enabled

    @property
    def final_metrics(self) -> dict[str, float]:
        finals = [r for r in self.history if r.final]
        return finals[-1].metrics if finals else {}
