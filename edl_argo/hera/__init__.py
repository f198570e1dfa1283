"""edl-argo's steps for your own Hera workflows.

Call these inside a Hera ``DAG``; each adds its step and returns the task. Tasks whose outputs you pass as
arguments become dependencies by themselves; order the others with ``>>``::

    from hera.workflows import DAG, Workflow
    from edl_argo.hera import MODEL_ZOO, elastic_train, evaluate, prepare_digits

    MODEL, DATA = f"{MODEL_ZOO}/digits.py", "s3://my-bucket/digits"

    with Workflow(generate_name="digits-", entrypoint="main") as workflow, DAG(name="main"):
        data = prepare_digits(output=DATA)
        train = elastic_train(model_def=MODEL, training_data=f"{DATA}/train", num_workers=4, num_ps=2)
        data >> train
        evaluate(model=train.get_artifact("model"), model_def=MODEL, data=f"{DATA}/test")

Each step's template is embedded in the workflow, unless ``template_ref=True``: then the task references
the WorkflowTemplate installed from ``templates/`` (``kubectl apply -f templates/``).
"""

from edl_argo.hera.container import DB_SECRET, IMAGE, IMAGE_HOME, MODEL_ZOO, STORAGE_SECRET
from edl_argo.hera.elastic_train import ELASTIC_TRAIN, ELASTIC_TRAIN_CLEANUP, elastic_train
from edl_argo.hera.evaluate import EVALUATE, evaluate
from edl_argo.hera.predict import PREDICT, predict
from edl_argo.hera.prepare_data import (
    CONVERT_CSV,
    PREPARE_CENSUS,
    PREPARE_CTR,
    PREPARE_DIGITS,
    convert_csv,
    prepare_census,
    prepare_ctr,
    prepare_digits,
)
from edl_argo.hera.sqlflow import SQL, sql
from edl_argo.hera.step import Step, StepTask, workflow_template

#: Every step edl-argo provides.
STEPS: tuple[Step, ...] = (
    PREPARE_DIGITS,
    PREPARE_CTR,
    CONVERT_CSV,
    PREPARE_CENSUS,
    ELASTIC_TRAIN,
    ELASTIC_TRAIN_CLEANUP,
    EVALUATE,
    PREDICT,
    SQL,
)

__all__ = [
    "DB_SECRET",
    "IMAGE",
    "IMAGE_HOME",
    "MODEL_ZOO",
    "STEPS",
    "STORAGE_SECRET",
    "Step",
    "StepTask",
    "convert_csv",
    "elastic_train",
    "evaluate",
    "predict",
    "prepare_census",
    "prepare_ctr",
    "prepare_digits",
    "sql",
    "workflow_template",
]
