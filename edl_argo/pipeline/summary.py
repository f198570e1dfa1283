"""The end of ``edl-argo pipeline run``: every step's status and time, its outputs, where artifacts are."""

from __future__ import annotations

import json

from edl_argo.pipeline.runner import Phase, RunResult

#: Output parameter values (other than metrics) longer than this are cut (with "...").
VALUE_CHARS = 100


def summary(result: RunResult) -> str:
    """A few lines for people: the outcome, then one line per step and one per output."""
    failed = result.failed
    outcome = "succeeded" if failed is None else f"failed: step {failed.name} failed"
    lines = [f"pipeline {result.workflow} {outcome} ({_duration(result.seconds)}; files in {result.folder})"]
    width = max(len(step.name) for step in result.steps)
    for step in result.steps:
        note = f"  {step.message}" if step.phase is not Phase.SUCCEEDED else ""
        lines.append(f"  {step.name:<{width}}  {step.phase.value:<9}  {_duration(step.seconds):>7}{note}")
        lines += [f"      parameter {name}: {_display(value)}" for name, value in step.parameters.items()]
        lines += [f"      artifact  {name}: {url}" for name, url in step.artifacts.items()]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest:02d}s" if minutes else f"{seconds:.1f}s"


def _display(value: str) -> str:
    """Metrics (a JSON object of numbers) as ``name=value`` pairs; anything else on one line, cut."""
    try:
        document = json.loads(value)
    except ValueError:
        document = None
    if isinstance(document, dict) and document and all(_is_number(v) for v in document.values()):
        return " ".join(f"{k}={v:.4g}" for k, v in document.items())
    value = " ".join(value.split())
    return value if len(value) <= VALUE_CHARS else value[: VALUE_CHARS - 3] + "..."


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
