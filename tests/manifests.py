"""Checks of rendered manifests: Argo's JSON schema per kind, Kubernetes' own models for core kinds.

Argo kinds (Workflow, WorkflowTemplate, ...) are validated against the definition of their kind in Argo's
schema (vendored in ``tests/argo_schema/``), with one known quirk patched in memory: ``IntOrString`` is
typed as a string only there, so an integer ``retryStrategy.limit`` would fail. Core Kubernetes kinds (RBAC,
Secret, ...) are not in that schema: they must survive a round trip through the official client's models,
which drops every field the API does not know.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from kubernetes.client import ApiClient

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_FILE = ROOT / "tests" / "argo_schema" / "workflow-schema-v4.0.10.json"
ARGO = "io.argoproj.workflow.v1alpha1"
#: Core kinds -> the kubernetes client model that must represent them exactly.
KUBERNETES_MODELS = {
    "ServiceAccount": "V1ServiceAccount",
    "Role": "V1Role",
    "RoleBinding": "V1RoleBinding",
    "PriorityClass": "V1PriorityClass",
    "ConfigMap": "V1ConfigMap",
    "Secret": "V1Secret",
    "NetworkPolicy": "V1NetworkPolicy",
}


@functools.cache
def _definitions() -> dict[str, Any]:
    if not SCHEMA_FILE.is_file():
        pytest.fail(
            f"Argo's JSON schema is missing: {SCHEMA_FILE} (see tests/argo_schema/README.md)", pytrace=False
        )
    definitions = copy.deepcopy(json.loads(SCHEMA_FILE.read_text())["definitions"])
    definitions["io.k8s.apimachinery.pkg.util.intstr.IntOrString"] = {"type": ["string", "integer"]}
    return definitions


@functools.cache
def validator(definition: str) -> jsonschema.Draft202012Validator:
    """A validator of one definition of Argo's schema (``io.argoproj.workflow.v1alpha1.Workflow``)."""
    return jsonschema.Draft202012Validator(
        {"$ref": f"#/definitions/{definition}", "definitions": _definitions()}
    )


def schema_errors(document: Any, definition: str) -> list[str]:
    """Every violation of ``definition`` in ``document``, as ``path: message``."""
    errors = sorted(validator(definition).iter_errors(document), key=lambda e: list(e.absolute_path))
    return [
        f"{'.'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}" for error in errors
    ]


def validate(manifest: dict[str, Any]) -> None:
    """Fail unless ``manifest`` is a valid object of its kind (see the module docstring)."""
    kind = manifest.get("kind", "")
    if kind in KUBERNETES_MODELS:
        client = ApiClient()
        model = client.deserialize(_Response(manifest), KUBERNETES_MODELS[kind])
        assert client.sanitize_for_serialization(model) == manifest, (
            f"{kind} has fields Kubernetes does not know"
        )
        return
    errors = schema_errors(manifest, f"{ARGO}.{kind}")
    assert not errors, f"{kind} {manifest.get('metadata', {}).get('name')}:\n" + "\n".join(errors)


def load_documents(path: Path) -> list[dict[str, Any]]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


class _Response:
    """What ``ApiClient.deserialize`` reads a body from."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.data = json.dumps(document)
