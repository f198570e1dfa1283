"""predict: a trained model + shards -> predictions (``edl-argo predict``).

Output: the ``predictions`` artifact: one ``<shard>.jsonl`` per input shard, one JSON line per record
(``{"shard", "record", "output"}``), plus ``predictions.json`` and ``_COMPLETE`` (:mod:`edl_argo.inference`).
"""

from __future__ import annotations

from hera.workflows import Artifact, Container

from edl_argo.hera.container import (
    IMAGE,
    STORAGE_SECRET,
    Image,
    ModelDef,
    ModelZoo,
    StorageSecret,
    step_container,
)
from edl_argo.hera.inputs import StepInputs
from edl_argo.hera.model_input import (
    MODEL_ARTIFACT,
    MODEL_PATH,
    Data,
    DataFormat,
    DataOptions,
    MinibatchSize,
)
from edl_argo.hera.step import Step, StepTask

WORKFLOW_TEMPLATE = "edl-argo-predict"
#: ``--output`` inside the container: the ``predictions`` artifact.
PREDICTIONS_DIR = "/tmp/predictions"


def predict(
    name: str = "predict",
    *,
    model: Artifact,
    model_def: ModelDef,
    model_zoo: ModelZoo = "",
    data: Data,
    data_format: DataFormat = "",
    data_options: DataOptions = "",
    minibatch_size: MinibatchSize = 256,
    image: Image = IMAGE,
    storage_secret: StorageSecret = STORAGE_SECRET,
    template_ref: bool = False,
) -> StepTask:
    """Add a step writing ``model``'s predictions for every record of ``data``; returns its task.

    ``task.get_artifact("predictions")`` is the result. ``template_ref``: reference the installed
    WorkflowTemplate instead of embedding the template.
    """
    return PREDICT.task(name, locals(), template_ref)


def _template(inputs: StepInputs) -> Container:
    return step_container(
        "predict",
        inputs,
        ["predict", "--model", MODEL_PATH, "--output", PREDICTIONS_DIR],
        artifacts=[MODEL_ARTIFACT],
        outputs=[Artifact(name="predictions", path=PREDICTIONS_DIR)],
    )


PREDICT = Step("predict", WORKFLOW_TEMPLATE, predict, _template)
