"""TEST-ONLY: a stand-in Kubernetes cluster for edl-argo's tests. Never use it for anything else.

An HTTP server on 127.0.0.1 speaking the part of the core/v1 API the master uses (pods, services, secrets;
create, get, list with label selectors, watch with resourceVersion and 410 Gone, graceful delete, status,
logs), networking.k8s.io NetworkPolicies (stored, not enforced), plus minimal argoproj.io Workflows as
owners, and WorkflowTemplates and ConfigMaps stored only (what a deploy guide creates). Each pod's
container command runs as a local process; owner references cascade; tests can hold pods Pending (no
capacity), evict (preempt) them, kill them, expire watches, inject API refusals and enforce a Role. See
:class:`KubernetesStandIn`.
"""

from tests.k8s_stand_in.server import ApiCall, KubernetesStandIn, rules_allow

__all__ = ["ApiCall", "KubernetesStandIn", "rules_allow"]
