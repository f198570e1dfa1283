"""``edl-argo pipeline run|render|submit FILE``: one pipeline file, three ways to use it.

``FILE`` is a Python file that builds a Hera ``Workflow`` named ``workflow`` (``examples/pipelines/``), or
the workflow's YAML. ``-p NAME=VALUE`` sets a workflow parameter, as with ``argo submit``.

* ``run``: run it on this machine (:mod:`edl_argo.pipeline.runner`); exit code 1 if a step failed.
* ``render``: print the Workflow YAML, for ``argo submit``.
* ``submit``: create it on the Argo Server named by ``ARGO_SERVER`` (:mod:`edl_argo.pipeline.submit`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from hera.workflows.models import Workflow as WorkflowModel

from edl_argo.errors import JobFailedError
from edl_argo.flags import positive_int
from edl_argo.pipeline.loader import load_workflow, parse_parameters, with_parameters
from edl_argo.storage import LocalStorage, open_reachable_storage, reached


def _workflow(args: argparse.Namespace) -> WorkflowModel:
    return with_parameters(load_workflow(Path(args.file)), parse_parameters(args.parameter))


def run_pipeline(args: argparse.Namespace) -> int:
    from edl_argo.pipeline.runner import LocalRunner
    from edl_argo.pipeline.summary import summary

    workflow = _workflow(args)
    reached(LocalStorage(args.workdir), "--workdir")  # a folder of this machine, not a storage URL
    if args.artifacts:
        open_reachable_storage(args.artifacts, "--artifacts")
    result = LocalRunner(workflow, Path(args.workdir), args.artifacts, parallelism=args.parallelism).run()
    print(summary(result))
    failed = result.failed
    if failed is not None:
        raise JobFailedError(f"pipeline {result.workflow}: step {failed.name} failed: {failed.message}")
    return 0


def render_pipeline(args: argparse.Namespace) -> int:
    from hera.workflows import Workflow

    manifest = _workflow(args).model_dump(by_alias=True, exclude_none=True, mode="json")
    print(Workflow.from_dict(manifest).to_yaml(), end="")
    return 0


def submit_pipeline(args: argparse.Namespace) -> int:
    from edl_argo.pipeline.submit import service_from_env, submit

    service = service_from_env(os.environ)
    name = submit(_workflow(args), service, args.namespace or os.environ.get("ARGO_NAMESPACE"))
    print(f"submitted workflow {name} to {service.host}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    pipeline = subparsers.add_parser("pipeline", help="run a pipeline here, render it, or submit it to Argo")
    commands = pipeline.add_subparsers(dest="pipeline_command", metavar="PIPELINE_COMMAND", required=True)
    for name, help_text, run in (
        ("run", "run the pipeline on this machine (no cluster needed)", run_pipeline),
        ("render", "print the pipeline's Workflow YAML (for argo submit)", render_pipeline),
        ("submit", "create the workflow on the Argo Server named by ARGO_SERVER", submit_pipeline),
    ):
        parser = commands.add_parser(name, help=help_text)
        parser.add_argument("file", metavar="FILE", help="a .py file defining `workflow`, or Workflow YAML")
        parser.add_argument(
            "-p",
            "--parameter",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help="a workflow parameter",
        )
        parser.set_defaults(run=run)
    commands.choices["run"].add_argument(
        "--workdir",
        default="out/pipelines",
        metavar="DIR",
        help="where runs keep their files (default: %(default)s)",
    )
    commands.choices["run"].add_argument(
        "--artifacts",
        default=None,
        metavar="URL",
        help="artifact repository: a folder or s3://bucket/prefix (default: WORKDIR/artifacts)",
    )
    commands.choices["run"].add_argument(
        "--parallelism",
        type=positive_int,
        default=None,
        metavar="N",
        help="run at most N tasks at once (default: the workflow's spec.parallelism, else no limit)",
    )
    commands.choices["submit"].add_argument(
        "--namespace", default="", help="default: $ARGO_NAMESPACE, else argo"
    )
