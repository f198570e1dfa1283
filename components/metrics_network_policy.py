"""Prometheus may scrape the masters: this NetworkPolicy admits any pod of any namespace to the container
port named metrics of every edl-argo master (the elastic-train step's pod, labelled edl-argo/role=master),
where the master serves its live metrics over plain HTTP, read-only. NetworkPolicies add up: the
default-deny-ingress of network-policy.yaml keeps every other port closed. To admit only your Prometheus,
narrow the namespaceSelector (and add a podSelector)."""

from kubernetes.client import (
    ApiClient,
    V1LabelSelector,
    V1NetworkPolicy,
    V1NetworkPolicyIngressRule,
    V1NetworkPolicyPeer,
    V1NetworkPolicyPort,
    V1NetworkPolicySpec,
    V1ObjectMeta,
)

from edl_argo.hera.elastic_train import METRICS_PORT_NAME
from edl_argo.hera.step import LABELS
from edl_argo.pods.manifests import MASTER_POD_LABELS

MANIFESTS = ApiClient().sanitize_for_serialization(
    [
        V1NetworkPolicy(
            api_version="networking.k8s.io/v1",
            kind="NetworkPolicy",
            metadata=V1ObjectMeta(name="edl-argo-master-metrics", labels=LABELS),
            spec=V1NetworkPolicySpec(
                pod_selector=V1LabelSelector(match_labels=dict(MASTER_POD_LABELS)),
                policy_types=["Ingress"],
                ingress=[
                    V1NetworkPolicyIngressRule(
                        _from=[V1NetworkPolicyPeer(namespace_selector=V1LabelSelector())],
                        ports=[V1NetworkPolicyPort(protocol="TCP", port=METRICS_PORT_NAME)],
                    )
                ],
            ),
        )
    ]
)
