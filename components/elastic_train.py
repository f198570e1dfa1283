"""Elastic, fault-tolerant distributed training: this step is the job's master (`edl-argo train
--backend kubernetes`); it runs the worker and parameter-server pods and outputs the trained model. Its
exit hook, elastic-train-cleanup, deletes the job's pods, Services and NetworkPolicy when the step is over:
a task's hook in a pipeline, the workflow's exit handler (onExit) when this template is submitted alone."""

from edl_argo.hera import ELASTIC_TRAIN, ELASTIC_TRAIN_CLEANUP, workflow_template

MANIFESTS = [
    workflow_template(
        ELASTIC_TRAIN, ELASTIC_TRAIN_CLEANUP, description=__doc__, on_exit=ELASTIC_TRAIN_CLEANUP
    )
]
