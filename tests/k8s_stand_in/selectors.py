"""TEST-ONLY: Kubernetes labels and label selectors for the stand-in: the query form
(``a=b,c!=d,e in (f,g),h notin (i),j,!k``, :func:`parse_selector`), the object form (a ``LabelSelector``
of ``matchLabels`` and ``matchExpressions``, :func:`selects`), and what the API server accepts as labels
(:func:`label_problems`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_SET = re.compile(r"^([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)$")
#: A label value, and the name part of a label key: at most 63 characters (Kubernetes' "qualified name").
_LABEL_NAME = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")
#: The prefix of a label key (``app.kubernetes.io/``): a DNS subdomain of at most 253 characters.
_LABEL_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
#: ``matchExpressions`` operators -> the query form's.
_OPERATORS = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!exists"}


@dataclass(frozen=True)
class Requirement:
    """One clause of a selector: ``key`` ``op`` ``values``, op one of = != in notin exists !exists."""

    key: str
    op: str
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        if self.op == "exists":
            return value is not None
        if self.op == "!exists":
            return value is None
        if self.op in ("=", "in"):
            return value in self.values
        return value not in self.values  # != and notin also match a missing label


def parse_selector(text: str | None) -> list[Requirement]:
    """The requirements of a label selector (all must match); ValueError if it is malformed."""
    requirements = []
    for clause in _split(text or ""):
        if m := _SET.match(clause):
            values = frozenset(v.strip() for v in m[3].split(",") if v.strip())
            requirements.append(Requirement(m[1], m[2], values))
        elif "!=" in clause:
            key, value = clause.split("!=", 1)
            requirements.append(Requirement(key.strip(), "!=", frozenset({value.strip()})))
        elif "=" in clause:
            key, value = clause.replace("==", "=", 1).split("=", 1)
            requirements.append(Requirement(key.strip(), "=", frozenset({value.strip()})))
        elif clause.startswith("!"):
            requirements.append(Requirement(clause[1:].strip(), "!exists"))
        elif re.fullmatch(r"[^\s()=!,]+", clause):
            requirements.append(Requirement(clause, "exists"))
        else:
            raise ValueError(f"cannot parse label selector clause {clause!r}")
    return requirements


def matches(requirements: list[Requirement], labels: Mapping[str, str] | None) -> bool:
    """Whether ``labels`` satisfy every requirement."""
    return all(r.matches(labels or {}) for r in requirements)


def _split(text: str) -> list[str]:
    """The comma-separated clauses of ``text``, commas inside parentheses kept."""
    clauses, depth, start = [], 0, 0
    for i, char in enumerate(text + ","):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            if text[start:i].strip():
                clauses.append(text[start:i].strip())
            start = i + 1
    return clauses


def selects(selector: Mapping[str, Any], labels: Mapping[str, str] | None) -> bool:
    """Whether a ``LabelSelector`` object (``matchLabels`` and ``matchExpressions``, as in a NetworkPolicy
    or a Deployment) selects ``labels``. The empty selector selects everything; an unknown operator or a
    set operator without values is a ValueError, as the API server refuses it."""
    requirements = [
        Requirement(k, "=", frozenset({v})) for k, v in (selector.get("matchLabels") or {}).items()
    ]
    for expression in selector.get("matchExpressions") or []:
        op = _OPERATORS.get(expression.get("operator", ""))
        values = frozenset(expression.get("values") or ())
        if op is None or (op in ("in", "notin")) != bool(values):
            raise ValueError(f"invalid matchExpressions entry {expression}")
        requirements.append(Requirement(expression["key"], op, values))
    return matches(requirements, labels)


def service_selects(service: Mapping[str, Any], labels: Mapping[str, str] | None) -> bool:
    """Whether a Service's ``spec.selector`` (a plain map) selects ``labels``; a Service without a
    selector selects no pod (its endpoints are managed by hand)."""
    selector = (service.get("spec") or {}).get("selector") or {}
    return bool(selector) and selects({"matchLabels": selector}, labels)


def label_problems(labels: Mapping[str, str] | None) -> list[str]:
    """What the API server would refuse in ``metadata.labels`` (empty: all valid): a key is an optional
    DNS-subdomain prefix and ``/`` and a name of at most 63 characters; a value is at most 63 characters of
    letters, digits, ``-``, ``_`` and ``.``, beginning and ending with a letter or digit, or empty."""
    problems = []
    for key, value in (labels or {}).items():
        prefix, _, name = key.rpartition("/")
        if (
            not name
            or not _LABEL_NAME.match(name)
            or (prefix and not (len(prefix) <= 253 and _LABEL_PREFIX.match(prefix)))
        ):
            problems.append(f"metadata.labels: Invalid value: {key!r}: not a qualified label key")
        if not isinstance(value, str) or not _LABEL_NAME.match(value):
            detail = (
                "must be no more than 63 characters"
                if isinstance(value, str) and len(value) > 63
                else (
                    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or"
                    " '.', and must start and end with an alphanumeric character"
                )
            )
            problems.append(f"metadata.labels: Invalid value: {value!r}: {detail}")
    return problems
