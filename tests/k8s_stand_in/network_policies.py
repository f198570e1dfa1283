"""TEST-ONLY: how Kubernetes decides whether a NetworkPolicy lets one pod reach another, for tests that
check the policies a job creates (the stand-in stores policies but does not enforce them: its pods share
the loopback address).

Only what edl-argo's policies use is modelled: ingress rules whose peers are ``podSelector`` s of the
policy's own namespace, and ports by number or by container-port name. A peer with a ``namespaceSelector``
or an ``ipBlock``, or an ``Egress`` policy, is a ValueError rather than a guess.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tests.k8s_stand_in.selectors import selects

Json = Mapping[str, Any]


def isolates(policy: Json, pod: Json) -> bool:
    """Whether ``policy`` applies to ``pod``'s ingress: same namespace, and its ``podSelector`` selects the
    pod. A pod some policy isolates gets only the traffic some policy admits."""
    spec = policy["spec"]
    types = spec.get("policyTypes") or ["Ingress"]
    if "Egress" in types:
        raise ValueError(f"{policy['metadata']['name']}: Egress policies are not modelled")
    return (
        "Ingress" in types
        and _namespace(policy) == _namespace(pod)
        and selects(spec["podSelector"], pod["metadata"].get("labels"))
    )


def admits(policy: Json, source: Json, destination: Json, port: int, protocol: str = "TCP") -> bool:
    """Whether ``policy`` admits a connection from pod ``source`` to pod ``destination``'s ``port``."""
    if not isolates(policy, destination):
        return False
    return any(
        _peer_matches(rule, policy, source) and _port_matches(rule, destination, port, protocol)
        for rule in policy["spec"].get("ingress") or []
    )


def ingress_allowed(
    policies: Iterable[Json], source: Json, destination: Json, port: int, protocol: str = "TCP"
) -> bool:
    """Whether a connection is allowed under all of ``policies`` (they add up): yes if none isolates the
    destination, else if one of them admits it."""
    policies = list(policies)
    if not any(isolates(p, destination) for p in policies):
        return True
    return any(admits(p, source, destination, port, protocol) for p in policies)


def _peer_matches(rule: Json, policy: Json, source: Json) -> bool:
    peers = rule.get("from")
    if not peers:
        return True  # no "from": every source
    for peer in peers:
        if set(peer) != {"podSelector"}:
            raise ValueError(f"peer {peer} is not modelled (only podSelector)")
    return _namespace(source) == _namespace(policy) and any(
        selects(peer["podSelector"], source["metadata"].get("labels")) for peer in peers
    )


def _port_matches(rule: Json, destination: Json, port: int, protocol: str) -> bool:
    ports = rule.get("ports")
    if not ports:
        return True  # no "ports": every port
    declared = [p for c in destination["spec"]["containers"] for p in c.get("ports") or [] if p.get("name")]
    for entry in ports:
        if entry.get("protocol", "TCP") != protocol:
            continue
        wanted = entry.get("port")
        if wanted is None:
            return True
        if isinstance(wanted, int):
            if wanted <= port <= int(entry.get("endPort", wanted)):
                return True
        elif any(
            p["name"] == wanted and p["containerPort"] == port and p.get("protocol", "TCP") == protocol
            for p in declared
        ):
            return True
    return False


def _namespace(obj: Json) -> str:
    return str(obj["metadata"].get("namespace") or "default")
