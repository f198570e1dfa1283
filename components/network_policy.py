"""Ingress to edl-argo pods is closed by default: this NetworkPolicy selects every pod of an edl-argo job
(the worker and parameter-server pods, and any pod with the edl-argo/role label) and admits nothing. Each
job's master then creates the job's own NetworkPolicy, <job>-grpc, which admits the job's pods, and only
them, to the job's gRPC ports; NetworkPolicies add up, so that is the only way in. Pods stay closed before
their job's policy exists and after it is gone. Enforced by the cluster's network plugin (Calico, Cilium,
...); without one, NetworkPolicies change nothing."""

from kubernetes.client import (
    ApiClient,
    V1LabelSelector,
    V1LabelSelectorRequirement,
    V1NetworkPolicy,
    V1NetworkPolicySpec,
    V1ObjectMeta,
)

from edl_argo.hera.step import LABELS
from edl_argo.pods.manifests import APP, NAME_LABEL, ROLE_LABEL

MANIFESTS = ApiClient().sanitize_for_serialization(
    [
        V1NetworkPolicy(
            api_version="networking.k8s.io/v1",
            kind="NetworkPolicy",
            metadata=V1ObjectMeta(name="edl-argo-default-deny-ingress", labels=LABELS),
            spec=V1NetworkPolicySpec(
                pod_selector=V1LabelSelector(
                    match_labels={NAME_LABEL: APP},
                    match_expressions=[V1LabelSelectorRequirement(key=ROLE_LABEL, operator="Exists")],
                ),
                policy_types=["Ingress"],
            ),
        )
    ]
)
