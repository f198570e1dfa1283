"""Write a trained model's predictions for every record of a dataset (`edl-argo predict`)."""

from edl_argo.hera import PREDICT, workflow_template

MANIFESTS = [workflow_template(PREDICT, description=__doc__)]
