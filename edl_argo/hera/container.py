"""What every edl-argo step container has in common: the image, its model zoo, and the storage Secret.

**Model definitions live in the image or in storage.** The master passes ``--model-def`` on to every
worker and parameter-server pod it starts, so every one of them must reach the model, not only the step's
container: an input artifact would reach the master alone. The edl-argo image holds the project under
:data:`IMAGE_HOME` (``/opt/edl-argo``), with the model zoo at :data:`MODEL_ZOO`. A model of your own needs
no image of its own: give its storage URL (``s3://bucket/models/my_model.py``; the master stages it for
its pods, :mod:`edl_argo.model.source`); or build an image ``FROM`` this one
(``COPY my_model.py /opt/edl-argo/models/``), or install it there as a module
(``--model-def my_package.my_model``).

**Storage settings come from a Secret.** Data and models live in MinIO or another S3 endpoint; each step
gets ``EDL_S3_ENDPOINT``, ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` from the Secret named by
its ``storage-secret`` parameter (``envFrom``, optional, so that steps that use no object storage run
without one). Steps that open a database (``sql``, ``prepare-census``) get its password, ``EDL_DB_PASSWORD``,
from the key ``password`` of the Secret named by their ``db-secret`` parameter (optional too: a database
without a password, such as SQLite, needs no Secret). Neither ever appears in a step's arguments.

**Steps run as non-root.** Every step's pod runs as uid/gid 1000 with the runtime's default seccomp
profile, and its container without privilege escalation or Linux capabilities: the same security contexts
as the worker and parameter-server pods (:data:`edl_argo.pods.manifests.POD_SECURITY_CONTEXT`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from hera.workflows import Artifact, Container, Parameter, SecretEnv, SecretEnvFrom
from hera.workflows.models import PodSecurityContext, SecurityContext

from edl_argo.hera.inputs import Input, StepInputs, Text
from edl_argo.pods.manifests import CONTAINER_SECURITY_CONTEXT, POD_SECURITY_CONTEXT
from edl_argo.readers.credentials import DEFAULT_SECRET, PASSWORD_ENV, SECRET_KEY
from edl_argo.settings.table import STEP_IMAGE, STEP_STORAGE_SECRET

#: The default image of every step (built from this repository).
IMAGE = STEP_IMAGE
#: Where the image holds the edl-argo project (its ``examples/`` included).
IMAGE_HOME = "/opt/edl-argo"
#: The model zoo in the image: ``f"{MODEL_ZOO}/digits.py"``.
MODEL_ZOO = f"{IMAGE_HOME}/examples/model_zoo"
#: The default Secret with the S3 settings (``examples/cluster/minio.yaml`` holds an example).
STORAGE_SECRET = STEP_STORAGE_SECRET

#: The ``image`` argument of every step function.
Image = Annotated[
    Text, Input("container image with edl-argo and the model zoo under /opt/edl-argo", flag=False)
]
#: The ``storage_secret`` argument of every step function.
StorageSecret = Annotated[
    Text,
    Input("Secret holding EDL_S3_ENDPOINT, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY", flag=False),
]
#: The default Secret with the database password (its key :data:`DB_PASSWORD_KEY`).
DB_SECRET = DEFAULT_SECRET
DB_PASSWORD_KEY = SECRET_KEY
#: The ``db_secret`` argument of the steps that open a database.
DbSecret = Annotated[
    Text,
    Input(
        f"Secret whose key '{DB_PASSWORD_KEY}' is the database password ({PASSWORD_ENV}; optional: none for"
        " a database without one)",
        flag=False,
    ),
]
#: The ``db`` argument of the steps that open a database.
Database = Annotated[
    Text, Input("SQLAlchemy URL of the database, without its password (postgresql://user@host/db)")
]
#: The ``model_def`` argument of the steps that load a model.
ModelDef = Annotated[
    Text,
    Input(
        f"model definition: a file in the image such as {MODEL_ZOO}/digits.py, package.module, or a file"
        " in storage (s3://bucket/models/model.py)"
    ),
]
#: The ``model_zoo`` argument of the steps that load a model (ElasticDL's ``--model_zoo``).
ModelZoo = Annotated[
    Text,
    Input("folder of model files in the image; model-def is then module.path.function inside it"),
]


def step_container(
    name: str,
    inputs: StepInputs,
    command: Sequence[str],
    *,
    artifacts: Sequence[Artifact] = (),
    outputs: Sequence[Artifact | Parameter] = (),
    **template: Any,
) -> Container:
    """The template of an edl-argo step: ``edl-argo <command> <the step's flags>`` in the image of its
    ``image`` parameter, with its input parameters (and input ``artifacts``), its ``outputs``, and the S3
    settings of its ``storage-secret`` and the database password of its ``db-secret`` (if it has them).
    ``template``: further fields of the template
    (``env``, ...)."""
    secret = None
    if "storage-secret" in inputs:
        secret = [SecretEnvFrom(name=inputs.ref("storage-secret"), optional=True)]
    if "db-secret" in inputs:
        password = SecretEnv(
            name=PASSWORD_ENV, secret_name=inputs.ref("db-secret"), secret_key=DB_PASSWORD_KEY, optional=True
        )
        template["env"] = [*template.get("env", []), password]
    return Container(
        name=name,
        image=inputs.ref("image"),
        command=["edl-argo", *command, *inputs.flags()],
        inputs=[*inputs.declarations(), *artifacts],
        outputs=list(outputs) or None,
        env_from=secret,
        pod_security_context=PodSecurityContext.model_validate(POD_SECURITY_CONTEXT),
        security_context=SecurityContext.model_validate(CONTAINER_SECURITY_CONTEXT),
        **template,
    )
