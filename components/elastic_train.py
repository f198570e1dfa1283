"""Elastic, fault-tolerant distributed training: this step is the job's master (`edl-argo train
--backend kubernetes`); it runs the worker and parameter-server pods and outputs the trained model."""

from edl_argo.hera import ELASTIC_TRAIN, workflow_template

MANIFESTS = [workflow_template(ELASTIC_TRAIN, description=__doc__)]
