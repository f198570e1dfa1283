"""TEST-ONLY: a stand-in Kubernetes cluster for edl-argo's tests. Never use it for anything else.

An HTTP server on 127.0.0.1 speaking the part of the core/v1 API the master uses (pods, services, secrets;
create, get, list with label selectors, watch with resourceVersion and 410 Gone, graceful delete, status,
logs), networking.k8s.io NetworkPolicies (stored, not enforced), plus minimal argoproj.io Workflows as
owners, and WorkflowTemplates and ConfigMaps stored only (what a deploy guide creates). Each pod's
container command runs as a local process; owner references cascade; tests can hold pods Pending (no
capacity), evict (preempt) them, kill them, expire watches, inject API refusals and enforce a Role. See
:class:`KubernetesStandIn`.

For issue 32 it also schedules as kube-scheduler does: nodes with cpu and memory capacity
(:class:`StandInNode`, read-only ``nodes``), pods placed by their requests, PriorityClasses
(scheduling.k8s.io/v1) resolved into pod priorities at admission, pods that fit nowhere left Pending
(``PodScheduled=False``/``Unschedulable``) and retried in queue order as capacity frees, preemption of
lower-priority pods, a minimal Deployment controller (apps/v1), and a recorder of requested over allocatable
CPU (:class:`~tests.k8s_stand_in.utilization.UtilizationRecorder`). Without ``nodes`` there is one node of
unlimited capacity, as before.
"""

from tests.k8s_stand_in.scheduler import StandInNode
from tests.k8s_stand_in.server import ApiCall, KubernetesStandIn, rules_allow

__all__ = ["ApiCall", "KubernetesStandIn", "StandInNode", "rules_allow"]
