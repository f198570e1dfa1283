"""The master's accounting of what workers trained (edl_argo/master/ledger.py), without processes."""

from __future__ import annotations

from edl_argo.errors import NAMED_CAUSES
from edl_argo.master.ledger import FOLD_AFTER_SECONDS, PsReport, TrainingLedger, accounting_failure
from edl_argo.master.task_dispatcher import Accounting, Task, TaskType


def task(task_id: int, records: int, epoch: int = 0) -> Task:
    return Task(task_id, TaskType.TRAINING, "shard-0", 0, records, epoch)


def accounting(records_trained_twice: int = 0, requeues: int = 0, epochs: int = 1) -> Accounting:
    return Accounting(
        records_per_epoch=100,
        records_done_per_epoch=dict.fromkeys(range(epochs), 100),
        records_trained_twice=records_trained_twice,
        requeues={"worker_died": requeues, "timeout": 0, "failed": 0, "master_restarted": 0},
        tasks_done=2,
        tasks_total=2,
    )


def report(ps_id: int, version: int, restored: int = -1, accepted: int | None = None) -> PsReport:
    return PsReport(ps_id, version, pushes_refused=0, restored_version=restored, pushes_accepted=accepted)


def test_a_task_adds_up_only_with_all_its_records_in_all_its_minibatches() -> None:
    ledger = TrainingLedger(minibatch_size=32)
    assert ledger.check(task(1, 100), {"records": 100, "steps": 4}) is None
    assert ledger.check(task(1, 100), {"records": 100, "steps": 3, "nan_batches_skipped": 1}) is None
    skipped = ledger.check(task(1, 100), {"records": 100, "steps": 3})
    assert (
        skipped is not None and "training task 1 (shard shard-0" in skipped and "in 3 minibatches" in skipped
    )
    assert ledger.check(task(1, 100), {"records": 96, "steps": 3}) is not None  # a record short
    assert ledger.check(task(1, 100), {"steps": 4}) is not None  # an old worker: no records counted


def test_epochs_and_ps_versions_are_checked_against_the_reports() -> None:
    ledger = TrainingLedger(minibatch_size=10, grads_to_wait=3)
    ledger.add(task(1, 60), {"records": 60, "steps": 6})
    ledger.add(task(2, 40), {"records": 40, "steps": 4})
    ledger.add(task(2, 40), {"records": 40, "steps": 4})  # counted again after a master restart: once
    assert ledger.epoch_problems(accounting()) == []
    assert ledger.epoch_problems(accounting(epochs=2)) == [
        "accounting: epoch 1: workers reported 0 records trained, the dataset has 100"
    ]
    # 10 minibatches, 3 per step: 4 updates, the last of one minibatch.
    section, problems = ledger.ps_updates(accounting(), [report(0, 4), report(1, 4)])
    assert problems == [] and section["minibatches_trained"] == 10
    assert [p["updates_expected"] for p in section["parameter_servers"]] == [4, 4]
    _, problems = ledger.ps_updates(accounting(), [report(0, 5), report(1, 3)])
    assert len(problems) == 2 and "applied some twice" in problems[0] and "updates were lost" in problems[1]
    # PS 1 restarted from its checkpoint at version 1 and ended 2 updates short: lost to the rollback.
    section, problems = ledger.ps_updates(accounting(), [report(0, 4), report(1, 2, restored=1)])
    assert problems == [] and section["updates_lost_to_rollback"] == 2
    assert section["parameter_servers"][1]["updates_lost_to_rollback"] == 2


def test_attempts_that_ended_unreported_widen_the_expected_updates_to_a_range() -> None:
    ledger = TrainingLedger(minibatch_size=10)
    ledger.add(task(1, 100), {"records": 100, "steps": 10})
    ledger.add_failed_attempt({"steps": 2})
    # A worker died holding a task of 30 records: it may have pushed up to 3 of its minibatches.
    twice = accounting(records_trained_twice=30, requeues=1)
    section, problems = ledger.ps_updates(twice, [report(0, 12), report(1, 15)])
    assert problems == [] and section["parameter_servers"][0]["updates_expected"] == [12, 16]
    _, problems = ledger.ps_updates(twice, [report(0, 17)])
    assert problems and "applied some twice" in problems[0]


def test_an_ignored_report_of_a_trained_task_counts_once_and_a_resent_one_not_at_all() -> None:
    ledger = TrainingLedger(minibatch_size=10)
    ledger.add(task(1, 100), {"records": 100, "steps": 10}, worker_id=0)
    ledger.add_ignored(1, 0, {"records": 100, "steps": 10})  # worker 0 sent its report again: counted already
    ledger.add_ignored(1, 2, {"records": 100, "steps": 10})  # worker 2 trained the same records too
    ledger.add_ignored(1, 2, {"records": 100, "steps": 10})  # ... and sent that report again
    ledger.add_ignored(5, 0, {})  # an evaluation task: nothing trained
    section, problems = ledger.ps_updates(accounting(), [report(0, 20)])
    assert problems == [] and section["minibatches_of_ignored_reports"] == 10
    restored = TrainingLedger(minibatch_size=10)
    restored.restore(ledger.snapshot())
    restored.add_ignored(1, 0, {"records": 100, "steps": 10})
    assert restored.ps_updates(accounting(), [report(0, 20)]) == (section, [])


def test_a_ledger_saved_before_reporters_were_saved_restores_and_counts_no_resent_report() -> None:
    older = {"tasks": {"1": [0, 100, 10]}, "failed_steps": 2}
    ledger = TrainingLedger(minibatch_size=10)
    ledger.restore(older)
    ledger.add_ignored(1, 3, {"records": 100, "steps": 10})  # its reporter is unknown: taken as a resend
    section, problems = ledger.ps_updates(accounting(), [report(0, 12)])
    assert problems == [] and section["minibatches_trained"] == 10
    assert section["minibatches_of_ignored_reports"] == 0


def test_pushes_accepted_see_a_duplicate_that_the_version_count_cannot() -> None:
    """With --grads-to-wait 3, 10 minibatches make 4 updates, and so do 11 or 12: a minibatch applied twice
    leaves the version right. Every PS also counts the pushes it accepted, which must be the minibatches."""
    ledger = TrainingLedger(minibatch_size=10, grads_to_wait=3)
    ledger.add(task(1, 100), {"records": 100, "steps": 10})
    both = [report(0, 4, accepted=10), report(1, 4, accepted=10)]
    section, problems = ledger.ps_updates(accounting(), both)
    assert problems == [] and [p["pushes_accepted"] for p in section["parameter_servers"]] == [10, 10]
    _, problems = ledger.ps_updates(accounting(), [report(0, 4, accepted=11), report(1, 4, accepted=9)])
    assert len(problems) == 2
    assert (
        "PS 0 accepted 11 pushes, but the workers trained 10 minibatches: it took some twice" in (problems[0])
    )
    assert "PS 1 accepted 9 pushes, but the workers trained 10 minibatches" in problems[1]
    # A worker died holding a task of 30 records: up to 3 more pushes, and one per requeue for rounding;
    # a restarted PS counts only the pushes since it restarted.
    twice = accounting(records_trained_twice=30, requeues=1)
    fits = [report(0, 5, accepted=13), report(1, 5, restored=2, accepted=4)]
    assert ledger.ps_updates(twice, fits)[1] == []
    too_many = [report(0, 5, accepted=15), report(1, 5, restored=2, accepted=15)]
    _, problems = ledger.ps_updates(twice, too_many)
    assert len(problems) == 2 and all("took some twice" in problem for problem in problems)


def test_an_epoch_done_long_enough_ago_keeps_only_its_totals() -> None:
    ledger = TrainingLedger(minibatch_size=4)
    tasks = [Task(i, TaskType.TRAINING, "s", 8 * (i % 3), 8 * (i % 3) + 8, epoch=i // 3) for i in range(6)]
    for task in tasks:
        ledger.add(task, {"records": 8, "steps": 2}, worker_id=1)
    accounting = Accounting(24, {0: 24, 1: 16}, 0, {}, 5, 6)  # epoch 0 done, epoch 1 not
    before = (ledger.records_per_epoch(), ledger.minibatches)
    assert ledger.fold_complete_epochs(accounting, now=100.0) == []  # first seen complete now
    assert ledger.fold_complete_epochs(accounting, now=100.0 + FOLD_AFTER_SECONDS) == [0]
    assert (ledger.records_per_epoch(), ledger.minibatches) == before
    saved = ledger.snapshot()
    assert sum(len(bucket) for bucket in saved["task_buckets"].values()) == 3  # epoch 1's tasks only
    ledger.add(tasks[0], {"records": 8, "steps": 2}, worker_id=2)  # a late report of a folded task
    ledger.remove(tasks[0])
    assert (ledger.records_per_epoch(), ledger.minibatches) == before
    restored = TrainingLedger(minibatch_size=4)
    restored.restore(saved)
    assert (restored.records_per_epoch(), restored.minibatches) == before


def test_a_job_failed_by_its_accounting_says_the_first_problems_and_how_many_more_in_one_line() -> None:
    """A job whose every epoch went untrained has one problem per epoch: its error stays one short line."""
    ledger = TrainingLedger(minibatch_size=10)
    ledger.add(task(1, 100), {"records": 100, "steps": 10})
    problems = ledger.epoch_problems(accounting(epochs=100_000))
    assert len(problems) == 99_999
    message = accounting_failure(problems)
    assert message.startswith(
        "accounting: epoch 1: workers reported 0 records trained, the dataset has 100; "
    )
    assert message.endswith("; and 99,994 more problems of the same accounting"), message[-200:]
    assert message.count("accounting: epoch") == NAMED_CAUSES == 5
    assert "\n" not in message and len(message) < 1_000
    assert accounting_failure(problems[:2]) == "; ".join(problems[:2])
