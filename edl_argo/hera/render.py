"""``edl-argo templates render``: ``components/*.py`` -> ``templates/*.yaml`` (``make templates``).

Each component file defines ``MANIFESTS``, a list of Kubernetes objects: Hera objects (rendered with
their ``to_yaml``) or plain dicts, and optionally ``WARNING``, text written as comments at the top of the
file. ``components/elastic_train.py`` becomes ``templates/elastic-train.yaml``, its manifests separated by
``---``. ``examples/cluster/`` (cluster settings that are only examples) is rendered the same way.
Rendering is deterministic, so ``--check`` can tell whether ``templates/`` is stale: it writes nothing and
fails, naming the files that differ.
"""

from __future__ import annotations

import argparse
import runpy
from pathlib import Path
from typing import Any

import yaml

from edl_argo.errors import ConfigError, JobFailedError
from edl_argo.log import get_logger

log = get_logger(__name__)

HEADER = "# Generated from {source} by `make templates` (edl-argo templates render); do not edit.\n"


def render(components: Path) -> dict[str, str]:
    """File name -> YAML text of every manifest file that ``components`` defines."""
    sources = sorted(p for p in components.glob("*.py") if not p.name.startswith("_"))
    if not sources:
        raise ConfigError(f"--components {components}: no component files (*.py) there")
    rendered = {}
    for source in sources:
        defined = runpy.run_path(str(source))
        manifests = defined.get("MANIFESTS")
        if not isinstance(manifests, list) or not manifests:
            raise ConfigError(f"{source}: defines no MANIFESTS (a non-empty list of manifests)")
        warning = str(defined.get("WARNING", ""))
        documents = [_to_yaml(manifest, source) for manifest in manifests]
        name = source.stem.replace("_", "-") + ".yaml"
        header = HEADER.format(source=f"{components.name}/{source.name}")
        header += "".join(f"# {line}".rstrip() + "\n" for line in warning.splitlines())
        rendered[name] = header + "---\n".join(documents)
    return rendered


def stale_files(rendered: dict[str, str], output: Path) -> list[str]:
    """Names of the files of ``output`` that differ from ``rendered``, are missing, or are left over."""
    existing = {p.name for p in output.glob("*.yaml") if p.read_text().startswith(HEADER.split("{", 1)[0])}
    differing = {name for name, text in rendered.items() if _read(output / name) != text}
    return sorted(differing | (existing - rendered.keys()))


def write(rendered: dict[str, str], output: Path) -> list[str]:
    """Bring ``output`` in line with ``rendered``; returns the names of the files it wrote or removed."""
    changed = stale_files(rendered, output)
    output.mkdir(parents=True, exist_ok=True)
    for name in changed:
        if name in rendered:
            (output / name).write_text(rendered[name])
        else:
            (output / name).unlink()
    return changed


def _to_yaml(manifest: Any, source: Path) -> str:
    if hasattr(manifest, "to_yaml"):
        return str(manifest.to_yaml())
    if isinstance(manifest, dict):
        return yaml.safe_dump(manifest, sort_keys=False)
    raise ConfigError(f"{source}: MANIFESTS holds a {type(manifest).__name__}, not a Hera object or a dict")


def _read(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


def run_render(args: argparse.Namespace) -> int:
    rendered = render(Path(args.components))
    output = Path(args.output)
    if args.check:
        stale = stale_files(rendered, output)
        if stale:
            raise JobFailedError(
                f"{output} is stale against {args.components}: {', '.join(stale)}; run `make templates`"
            )
        print(f"{output} is up to date ({len(rendered)} files)")
        return 0
    for name in write(rendered, output):
        log.info("template_written" if name in rendered else "template_removed", file=str(output / name))
    print(f"{output}: {len(rendered)} files from {args.components}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    templates = subparsers.add_parser("templates", help="render templates/ from components/")
    commands = templates.add_subparsers(dest="templates_command", metavar="TEMPLATES_COMMAND", required=True)
    render_parser = commands.add_parser("render", help="write the manifests that components/ defines")
    render_parser.add_argument("--components", default="components", metavar="DIR", help="component files")
    render_parser.add_argument("--output", default="templates", metavar="DIR", help="where the YAML goes")
    render_parser.add_argument(
        "--check", action="store_true", help="write nothing; fail if the output differs from a fresh render"
    )
    render_parser.set_defaults(run=run_render)
