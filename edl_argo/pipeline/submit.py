"""``edl-argo pipeline submit``: create the workflow on an Argo Server, as ``argo submit`` does.

Through Hera's ``WorkflowsService`` (the server's REST API, ``POST /api/v1/workflows/{namespace}``). The
server and the credentials come from the environment, under the names the ``argo`` CLI reads:

=============================  ==================================================================
``ARGO_SERVER``                ``host:port`` of the Argo Server (or a URL with its scheme)
``ARGO_SECURE``                ``false``: plain HTTP (default ``true``: HTTPS)
``ARGO_INSECURE_SKIP_VERIFY``  ``true``: do not verify the server's TLS certificate
``ARGO_TOKEN``                 the bearer token (``argo auth token``); never logged
``ARGO_NAMESPACE``             namespace of the workflow (default: the workflow's, else ``argo``)
=============================  ==================================================================
"""

from __future__ import annotations

from collections.abc import Mapping

import requests
from hera.exceptions import HeraException
from hera.workflows import WorkflowsService
from hera.workflows.models import Workflow as WorkflowModel
from hera.workflows.models import WorkflowCreateRequest

from edl_argo.errors import ConfigError, JobFailedError

DEFAULT_NAMESPACE = "argo"


def service_from_env(env: Mapping[str, str]) -> WorkflowsService:
    """A ``WorkflowsService`` for the Argo Server the environment names."""
    server = env.get("ARGO_SERVER", "").strip()
    if not server:
        raise ConfigError("ARGO_SERVER is not set: export ARGO_SERVER=host:port of your Argo Server")
    if "://" not in server:
        secure = env.get("ARGO_SECURE", "true").lower() != "false"
        server = f"{'https' if secure else 'http'}://{server}"
    return WorkflowsService(
        host=server,
        token=env.get("ARGO_TOKEN") or None,
        verify_ssl=env.get("ARGO_INSECURE_SKIP_VERIFY", "false").lower() != "true",
    )


def submit(workflow: WorkflowModel, service: WorkflowsService, namespace: str | None) -> str:
    """Create ``workflow`` in ``namespace`` (default: its own, else ``argo``); returns its name."""
    namespace = namespace or workflow.metadata.namespace or DEFAULT_NAMESPACE
    try:
        created = service.create_workflow(WorkflowCreateRequest(workflow=workflow), namespace=namespace)
    except HeraException as error:
        raise JobFailedError(f"the Argo Server at {service.host} refused the workflow: {error}") from None
    except requests.RequestException as error:
        raise JobFailedError(
            f"cannot reach the Argo Server at {service.host}: {type(error).__name__}"
        ) from None
    return created.metadata.name or "?"
