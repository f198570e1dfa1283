"""evaluate: a trained model + shards -> metrics (``edl-argo evaluate``).

Outputs: the ``metrics`` parameter (a JSON object, ``{"accuracy": 0.975, "records": 360.0}``) and the
same JSON as the ``metrics`` artifact (``metrics.json``).
"""

from __future__ import annotations

from hera.workflows import Artifact, Container, Parameter
from hera.workflows.models import ValueFrom

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

WORKFLOW_TEMPLATE = "edl-argo-evaluate"
#: ``--output`` inside the container; ``edl-argo evaluate`` writes ``metrics.json`` there.
OUTPUT_DIR = "/tmp/evaluation"
METRICS_FILE = f"{OUTPUT_DIR}/metrics.json"


def evaluate(
    name: str = "evaluate",
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
    """Add a step computing ``model``'s metrics (those of ``model_def``) on ``data``; returns its task.

    ``model`` is a model artifact, e.g. ``train.get_artifact("model")``. ``task.get_parameter("metrics")``
    is the result as JSON. ``template_ref``: reference the installed WorkflowTemplate instead of
    embedding the template.
    """
    return EVALUATE.task(name, locals(), template_ref)


def _template(inputs: StepInputs) -> Container:
    return step_container(
        "evaluate",
        inputs,
        ["evaluate", "--model", MODEL_PATH, "--output", OUTPUT_DIR],
        artifacts=[MODEL_ARTIFACT],
        outputs=[
            Parameter(name="metrics", value_from=ValueFrom(path=METRICS_FILE)),
            Artifact(name="metrics", path=METRICS_FILE),
        ],
    )


EVALUATE = Step("evaluate", WORKFLOW_TEMPLATE, evaluate, _template)
