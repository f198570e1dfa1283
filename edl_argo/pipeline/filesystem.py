"""Where a step's container paths are on this machine.

In a cluster each step has its own container filesystem; here steps are processes of one machine, so the
runner maps container paths to host paths, like volume mounts:

* The paths the template declares (input and output artifact paths, output parameter files), and every
  path below them or above them (``--output /tmp/edl-job`` when ``/tmp/edl-job/model`` is the declared
  artifact) live in the step's *sandbox* folder: container path ``/a/b`` is ``<sandbox>/a/b``.
* The image's copy of the edl-argo project, :data:`~edl_argo.hera.IMAGE_HOME` (``/opt/edl-argo``, where
  the model zoo is), is the project this runner comes from.

Any other argument is left alone: a URL, or a host path given as a parameter, means the same here as in
a cluster whose storage this machine is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edl_argo.errors import ConfigError
from edl_argo.hera import IMAGE_HOME


@dataclass(frozen=True)
class ContainerFilesystem:
    """The host locations of one step's container paths."""

    sandbox: Path
    """The step's own folder: container path ``/a/b`` is ``sandbox/a/b``."""
    declared: tuple[str, ...]
    """The container paths the step's template declares (absolute)."""
    image_home: Path
    """Where :data:`IMAGE_HOME` is on this machine."""

    def host_path(self, container_path: str) -> Path:
        """The host path of a declared container path (or one below or above it)."""
        return self.sandbox / container_path.lstrip("/")

    def localize(self, argument: str) -> str:
        """``argument`` with a container path in it replaced by its host path (also ``--flag=PATH``)."""
        flag, sep, value = argument.partition("=") if argument.startswith("--") else ("", "", argument)
        return flag + sep + self._localize_path(value)

    def _localize_path(self, value: str) -> str:
        if value == IMAGE_HOME or value.startswith(IMAGE_HOME + "/"):
            local = str(self.image_home) + value[len(IMAGE_HOME) :]
            if not Path(local.split(":", 1)[0]).exists():  # model files may end in :factory_name
                raise ConfigError(
                    f"{value} is in the image's copy of edl-argo ({IMAGE_HOME}); here that is"
                    f" {self.image_home}, which has no {local}"
                )
            return local
        if value.startswith("/") and any(_related(value.rstrip("/") or "/", path) for path in self.declared):
            return str(self.host_path(value))
        return value


def _related(path: str, declared: str) -> bool:
    """Whether ``path`` is ``declared``, below it, or above it (never the root itself)."""
    return path != "/" and (
        path == declared or path.startswith(declared + "/") or declared.startswith(path + "/")
    )


def source_root() -> Path:
    """The edl-argo project this runner comes from: the folder holding the ``edl_argo`` package."""
    import edl_argo

    return Path(edl_argo.__file__).resolve().parents[1]
