"""Scheduling priorities of a training job's pods, the defaults of the elastic-train step: the master and
the parameter servers (which hold the model) get edl-argo-high; workers get edl-argo-low, below pods
without a priority class, so the cluster preempts workers first and the elastic job carries on with
fewer of them. Workers a job adds beyond its --num-workers as it grows into free room get
edl-argo-opportunistic, the lowest: other jobs' workers preempt them (edl-argo-low may preempt, and
nothing but opportunistic workers is below it), taking back the room the job grew into."""

from kubernetes.client import ApiClient, V1ObjectMeta, V1PriorityClass

from edl_argo.hera.step import LABELS

MANIFESTS = ApiClient().sanitize_for_serialization(
    [
        V1PriorityClass(
            api_version="scheduling.k8s.io/v1",
            kind="PriorityClass",
            metadata=V1ObjectMeta(name="edl-argo-high", labels=LABELS),
            value=1000,
            description="edl-argo masters and parameter servers: losing one stalls the whole job",
        ),
        V1PriorityClass(
            api_version="scheduling.k8s.io/v1",
            kind="PriorityClass",
            metadata=V1ObjectMeta(name="edl-argo-low", labels=LABELS),
            value=-100,
            preemption_policy="PreemptLowerPriority",
            description="edl-argo workers: preempted first, the job goes on with fewer workers; they preempt"
            " only opportunistic workers",
        ),
        V1PriorityClass(
            api_version="scheduling.k8s.io/v1",
            kind="PriorityClass",
            metadata=V1ObjectMeta(name="edl-argo-opportunistic", labels=LABELS),
            value=-200,
            preemption_policy="Never",
            description="edl-argo workers a job added beyond --num-workers: first to give their room back",
        ),
    ]
)
