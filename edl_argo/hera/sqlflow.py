"""sql: one SQLFlow statement, ``edl-argo sql "<statement>" --db URL --models URL``.

``SELECT ... TO TRAIN <model> ... INTO name`` trains a premade model on the SELECT's rows and publishes it
under ``<models>/name``; ``TO PREDICT table.column USING name`` writes a new table of predictions;
``TO EVALUATE name ... INTO table`` writes a row of metrics (:mod:`edl_argo.sqlflow.command`). Models are
a URL (a folder or ``s3://...``, with the ``storage-secret``'s settings), not an artifact: the training
job's processes write it, and a later statement names it.

A TO TRAIN runs its job in the step's pod: the master there, its workers and parameter servers as
processes beside it (``edl-argo train``'s local backend; ``train-flags`` adds flags such as
``--num-workers 2``), hence the pod's ``cpu`` and ``memory`` requests.

The database password is ``EDL_DB_PASSWORD``, from the key ``password`` of the ``db-secret`` Secret
(optional: SQLite and databases without a password need none); it never appears in the step's arguments.
"""

from __future__ import annotations

from typing import Annotated

from hera.workflows import Container
from hera.workflows.models import ResourceRequirements

from edl_argo.hera.container import (
    DB_SECRET,
    IMAGE,
    STORAGE_SECRET,
    Database,
    DbSecret,
    Image,
    StorageSecret,
    step_container,
)
from edl_argo.hera.inputs import Input, StepInputs, Text
from edl_argo.hera.step import Step, StepTask

WORKFLOW_TEMPLATE = "edl-argo-sqlflow"


def sql(
    name: str = "sql",
    *,
    statement: Annotated[
        Text, Input("the statement: SELECT ... TO TRAIN|TO PREDICT|TO EVALUATE ...", flag=False)
    ],
    db: Database,
    models: Annotated[Text, Input("folder or s3:// prefix of the models TO TRAIN writes and USING reads")],
    train_flags: Annotated[
        Text, Input("more `edl-argo train` flags for TO TRAIN, e.g. '--num-workers 2'", flag=False)
    ] = "",
    cpu: Annotated[
        Text, Input("CPU request of the step's pod (a TO TRAIN job runs in it)", flag=False)
    ] = "1",
    memory: Annotated[Text, Input("memory request of the step's pod", flag=False)] = "2Gi",
    db_secret: DbSecret = DB_SECRET,
    image: Image = IMAGE,
    storage_secret: StorageSecret = STORAGE_SECRET,
    template_ref: bool = False,
) -> StepTask:
    """Add a step running the SQLFlow ``statement`` against the database ``db``; returns its task.

    Order statements with ``>>`` (a TO PREDICT after the TO TRAIN whose model it uses): they share
    ``models`` and ``db``, not artifacts. ``template_ref``: reference the installed WorkflowTemplate
    instead of embedding the template.
    """
    return SQL.task(name, locals(), template_ref)


def _template(inputs: StepInputs) -> Container:
    return step_container(
        "sql",
        inputs,
        # The statement is the positional argument; --train-flags=... keeps flags in its value (--num-workers)
        # from being read as flags of `edl-argo sql`.
        ["sql", inputs.ref("statement"), f"--train-flags={inputs.ref('train-flags')}"],
        resources=ResourceRequirements(requests={"cpu": inputs.ref("cpu"), "memory": inputs.ref("memory")}),
    )


SQL = Step("sql", WORKFLOW_TEMPLATE, sql, _template)
