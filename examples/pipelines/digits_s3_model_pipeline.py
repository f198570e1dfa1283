"""The digits pipeline with its model from S3: the model file is in no image, only in the object store.

    aws s3 cp examples/model_zoo/digits.py s3://my-bucket/models/digits.py          # or: mc cp ...
    edl-argo pipeline run examples/pipelines/digits_s3_model_pipeline.py \\
        -p data=s3://my-bucket/datasets/digits -p model-def=s3://my-bucket/models/digits.py
    python examples/pipelines/digits_s3_model_pipeline.py > digits-s3-model.yaml    # for `argo submit`

It is ``digits_pipeline.py`` with ``model-def`` defaulting to :data:`MODEL_URL`, and its artifacts (the
trained model, the metrics, the predictions) in the artifact repository :data:`ARTIFACT_REPOSITORY`
(``docs/deploy.md`` creates it). The master of the training step fetches the model once, checks it, and
stages it under the job's state (``<data>/jobs/<workflow>``) for its worker and PS pods, which all run
those bytes (their logs and the model's ``flags.json`` hold its digest).
"""

import runpy
from pathlib import Path

from hera.workflows import Parameter
from hera.workflows.models import ArtifactRepositoryRef

#: Where the model file is (``-p model-def=...`` names another).
MODEL_URL = "s3://my-bucket/models/digits.py"
#: The artifact repository the workflow uses: key ``edl-argo`` of the ConfigMap ``artifact-repositories``.
ARTIFACT_REPOSITORY = ArtifactRepositoryRef(config_map="artifact-repositories", key="edl-argo")

workflow = runpy.run_path(str(Path(__file__).with_name("digits_pipeline.py")))["workflow"]
workflow.generate_name = "digits-s3-model-"
workflow.artifact_repository_ref = ARTIFACT_REPOSITORY
workflow.arguments = [
    Parameter(name="model-def", value=MODEL_URL, description="the model file in S3")
    if argument.name == "model-def"
    else argument
    for argument in workflow.arguments
]

if __name__ == "__main__":
    print(workflow.to_yaml())
