"""The service account the elastic-train step runs under (`edl-argo-master`), and what it may do in its
namespace: start, watch and remove the job's worker and parameter-server pods and their Services, read
their logs, create and remove the job's NetworkPolicy (only the job's own pods reach its gRPC ports) and its
credentials Secret (which it never reads through the API), and report the step's outputs to Argo
(workflowtaskresults, as every Argo step does)."""

from kubernetes.client import (
    ApiClient,
    RbacV1Subject,
    V1ObjectMeta,
    V1PolicyRule,
    V1Role,
    V1RoleBinding,
    V1RoleRef,
    V1ServiceAccount,
)

from edl_argo.hera.elastic_train import SERVICE_ACCOUNT
from edl_argo.hera.step import LABELS

METADATA = V1ObjectMeta(name=SERVICE_ACCOUNT, labels=LABELS)
RULES = [
    V1PolicyRule(
        api_groups=[""], resources=["pods", "services"], verbs=["create", "get", "list", "watch", "delete"]
    ),
    # The master labels its own pod with its job (the step cannot: the name may be too long for a label).
    V1PolicyRule(api_groups=[""], resources=["pods"], verbs=["patch"]),
    V1PolicyRule(api_groups=[""], resources=["pods/log"], verbs=["get"]),
    V1PolicyRule(api_groups=["networking.k8s.io"], resources=["networkpolicies"], verbs=["create", "delete"]),
    # The job's own credentials Secret <job>-auth: created, a worker's token added per pod, deleted. Never
    # get, list or watch: the master reads no Secret through the API (other jobs' and teams' credentials
    # live in the namespace); a restarted master reads its job's Secret from its pod's volume of it.
    V1PolicyRule(api_groups=[""], resources=["secrets"], verbs=["create", "patch", "delete"]),
    V1PolicyRule(api_groups=["argoproj.io"], resources=["workflowtaskresults"], verbs=["create", "patch"]),
]

MANIFESTS = ApiClient().sanitize_for_serialization(
    [
        V1ServiceAccount(api_version="v1", kind="ServiceAccount", metadata=METADATA),
        V1Role(api_version="rbac.authorization.k8s.io/v1", kind="Role", metadata=METADATA, rules=RULES),
        V1RoleBinding(
            api_version="rbac.authorization.k8s.io/v1",
            kind="RoleBinding",
            metadata=METADATA,
            role_ref=V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name=SERVICE_ACCOUNT),
            # No namespace: a RoleBinding's service accounts are those of its own namespace.
            subjects=[RbacV1Subject(kind="ServiceAccount", name=SERVICE_ACCOUNT)],
        ),
    ]
)
