"""Compute a trained model's metrics on a dataset (`edl-argo evaluate`)."""

from edl_argo.hera import EVALUATE, workflow_template

MANIFESTS = [workflow_template(EVALUATE, description=__doc__)]
