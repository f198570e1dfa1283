"""TEST-ONLY: Kubernetes label selectors (``a=b,c!=d,e in (f,g),h notin (i),j,!k``) for the stand-in."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

_SET = re.compile(r"^([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)$")


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
