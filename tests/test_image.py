"""The image (Dockerfile), checked without building it: these machines have no container builder.

What the templates and the pods the master creates rely on: the user they run as, the paths they name
(in the image's layout, as the Dockerfile's COPY instructions make it), the ``edl-argo`` program, and
the dependencies (exactly ``pyproject.toml``'s, pinned by ``requirements.lock``). And ``make image``:
it picks a builder that works, or says in one line that there is none.
"""

from __future__ import annotations

import fnmatch
import importlib
import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import edl_argo
from edl_argo import cli
from edl_argo.hera import IMAGE, IMAGE_HOME, MODEL_ZOO
from edl_argo.pods.manifests import RUN_AS_ID
from tests.manifests import ROOT
from tests.test_argo_templates import container_templates, rendered_documents
from tools.requirements_lock import read_lock

DOCKERFILE = ROOT / "Dockerfile"
LOCK = ROOT / "requirements.lock"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VENV = "/opt/venv"


@dataclass(frozen=True)
class Instruction:
    stage: int
    keyword: str
    arguments: str


def instructions() -> list[Instruction]:
    """The Dockerfile's instructions (continuation lines joined, comments dropped), with their stage."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result, stage = [], -1
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, arguments = line.partition(" ")
        stage += keyword.upper() == "FROM"
        result.append(Instruction(stage, keyword.upper(), arguments.strip()))
    return result


def final_stage() -> list[Instruction]:
    all_instructions = instructions()
    last = max(i.stage for i in all_instructions)
    return [i for i in all_instructions if i.stage == last]


def arg_default(name: str, stage: list[Instruction]) -> str:
    (value,) = [
        i.arguments.split("=", 1)[1]
        for i in stage
        if i.keyword == "ARG" and i.arguments.startswith(f"{name}=")
    ]
    return value


def copies() -> Iterator[tuple[int, str | None, list[str], str]]:
    """(stage, --from stage or None for the build context, sources, destination) of every COPY."""
    for instruction in instructions():
        if instruction.keyword != "COPY":
            continue
        words = shlex.split(instruction.arguments)
        options = [w for w in words if w.startswith("--")]
        paths = [w for w in words if not w.startswith("--")]
        source = next((o.split("=", 1)[1] for o in options if o.startswith("--from=")), None)
        yield instruction.stage, source, paths[:-1], paths[-1]


def image_layout() -> dict[str, Path]:
    """Absolute image path -> the file or folder of the build context it comes from, in the final image.

    A stage copied with ``COPY --from=<stage> <path>`` brings what that stage's COPYs put under it."""
    names = {
        i.arguments.split()[-1]: i.stage
        for i in instructions()
        if i.keyword == "FROM" and " AS " in i.arguments
    }
    by_stage: dict[int, dict[str, Path]] = {}
    for stage, source, sources, destination in copies():
        layout = by_stage.setdefault(stage, {})
        if source is None:
            for path in sources:
                target = (
                    destination.rstrip("/") + "/" + Path(path).name
                    if destination.endswith("/")
                    else destination
                )
                layout[target] = ROOT / path
        else:
            (path,) = sources
            for image_path, context_path in by_stage[names[source]].items():
                if image_path == path or image_path.startswith(path.rstrip("/") + "/"):
                    layout[destination.rstrip("/") + image_path[len(path.rstrip("/")) :]] = context_path
    return by_stage[max(by_stage)]


def context_path(image_path: str) -> Path | None:
    """Where ``image_path`` of the final image comes from in the build context (None: not copied)."""
    layout = image_layout()
    for copied, source in layout.items():
        if image_path == copied or image_path.startswith(copied + "/"):
            return source / image_path[len(copied) :].lstrip("/")
    if any(copied.startswith(image_path + "/") for copied in layout):
        return ROOT  # a folder the copies create (/opt/edl-argo)
    return None


def dockerignored(path: Path) -> bool:
    """Whether .dockerignore keeps ``path`` (of the build context) out of the context."""
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [p for p in patterns if p and not p.startswith("#")]
    assert not any(p.startswith("!") for p in patterns), "exceptions are not modelled here"
    relative = path.relative_to(ROOT).as_posix()
    prefixes = [relative.rsplit("/", n)[0] for n in range(relative.count("/") + 1)]
    return any(
        fnmatch.fnmatchcase(prefix, pattern)
        or (pattern.startswith("**/") and fnmatch.fnmatchcase(prefix.rsplit("/", 1)[-1], pattern[3:]))
        for pattern in patterns
        for prefix in prefixes
    )


def walk(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for item in value.values():
            yield from walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from walk(item)
    else:
        yield value


def volume_mounts(value: Any) -> Iterator[dict[str, Any]]:
    """Every entry of a ``volumeMounts`` list anywhere in ``value``."""
    if isinstance(value, dict):
        yield from value.get("volumeMounts", [])
        for item in value.values():
            yield from volume_mounts(item)
    elif isinstance(value, list):
        for item in value:
            yield from volume_mounts(item)


def training_pod_manifests() -> list[dict[str, Any]]:
    """The Pods the elastic-train step's master would create for the template's default model."""
    argv = [
        "train", "--model-def", f"{MODEL_ZOO}/digits.py", "--training-data", "s3://data/train",
        "--output", "s3://data/out", "--backend", "kubernetes", "--image", IMAGE, "--yaml",
    ]  # fmt: skip
    parser = cli.build_parser(["train"])
    args = parser.parse_args(argv)
    from edl_argo.master.config import config_from_args
    from edl_argo.master.dry_run import render_train_manifests

    documents = yaml.safe_load_all(render_train_manifests(config_from_args(args)))
    return [d for d in documents if d["kind"] == "Pod"]


def all_manifests() -> list[dict[str, Any]]:
    return [document for _, document in rendered_documents()] + training_pod_manifests()


# -- the user -------------------------------------------------------------------------------------------


def test_the_image_runs_as_the_user_of_every_step_and_pod() -> None:
    stage = final_stage()
    run_as = arg_default("RUN_AS_ID", stage)
    assert run_as == str(RUN_AS_ID)
    (user,) = [i.arguments for i in stage if i.keyword == "USER"]
    assert user == "${RUN_AS_ID}:${RUN_AS_ID}"  # numeric: runAsNonRoot can check it
    (create,) = [i.arguments for i in stage if i.keyword == "RUN" and "useradd" in i.arguments]
    assert (
        "groupadd --gid ${RUN_AS_ID}" in create and "useradd --uid ${RUN_AS_ID} --gid ${RUN_AS_ID}" in create
    )
    contexts = [value for manifest in all_manifests() for value in _security_contexts(manifest)]
    assert len(contexts) >= 10
    assert all(c["runAsUser"] == c["runAsGroup"] == c["fsGroup"] == RUN_AS_ID for c in contexts), contexts


def _security_contexts(value: Any) -> Iterator[dict[str, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "securityContext" and isinstance(item, dict) and "runAsUser" in item:
                yield item
            else:
                yield from _security_contexts(item)
    elif isinstance(value, list):
        for item in value:
            yield from _security_contexts(item)


def test_tmp_and_home_are_writable_for_that_user() -> None:
    stage = final_stage()
    assert any(i.keyword == "RUN" and "chmod 1777 /tmp" in i.arguments for i in stage)
    env = " ".join(i.arguments for i in stage if i.keyword == "ENV")
    assert "HOME=/home/edl" in env
    assert any(i.keyword == "RUN" and "--home-dir /home/edl --create-home" in i.arguments for i in stage)


# -- the paths ------------------------------------------------------------------------------------------


def test_every_path_the_templates_and_pods_name_exists_in_the_image() -> None:
    paths = {
        match
        for manifest in all_manifests()
        for value in walk(manifest)
        if isinstance(value, str)
        for match in re.findall(r"(?<![\w:/.])/(?:opt|tmp|home|usr|var|etc|data|mnt)(?:/[\w.-]+)*", value)
    }
    in_project = sorted(p for p in paths if p == IMAGE_HOME or p.startswith(IMAGE_HOME + "/"))
    # The kubelet makes a volume's mount path (and a folder holding only mounts): not the image's business.
    mounts = {m["mountPath"] for manifest in all_manifests() for m in volume_mounts(manifest)}
    mounted = {p for p in paths for m in mounts if m == p or m.startswith(p + "/") or p.startswith(m + "/")}
    elsewhere = sorted(p for p in paths if p not in in_project and p not in mounted)
    assert f"{MODEL_ZOO}/digits.py" in in_project
    assert elsewhere and all(p.startswith("/tmp/") for p in elsewhere), elsewhere  # /tmp is writable
    for path in in_project:
        source = context_path(path)
        assert source is not None and source.exists(), f"{path}: the Dockerfile copies nothing there"
        assert not dockerignored(source), f"{path}: .dockerignore leaves {source} out of the build context"


def test_the_model_zoo_and_the_project_are_in_the_image() -> None:
    for image_path in (
        f"{MODEL_ZOO}/digits.py",
        f"{MODEL_ZOO}/ctr.py",
        f"{IMAGE_HOME}/examples/pipelines/digits_pipeline.py",
        f"{IMAGE_HOME}/templates/elastic-train.yaml",
        f"{IMAGE_HOME}/components/elastic_train.py",
        f"{IMAGE_HOME}/edl_argo/cli.py",
        f"{IMAGE_HOME}/requirements.lock",
    ):
        source = context_path(image_path)
        assert source is not None and source.is_file(), image_path
        assert not dockerignored(source), image_path
    assert context_path("/opt/edl-argo/tests") is None  # the tests stay out


def test_nothing_the_dockerfile_copies_is_ignored() -> None:
    for _, source, sources, _ in copies():
        if source is None:
            for path in sources:
                assert (ROOT / path).exists(), path
                assert not dockerignored(ROOT / path), path
    assert dockerignored(ROOT / ".git" / "HEAD") and dockerignored(ROOT / "tests" / "conftest.py")
    assert dockerignored(ROOT / "edl_argo" / "__pycache__" / "cli.cpython-311.pyc")


# -- the program ----------------------------------------------------------------------------------------


def test_the_entrypoint_is_the_installed_edl_argo_program() -> None:
    stage = final_stage()
    (entrypoint,) = [i.arguments for i in stage if i.keyword == "ENTRYPOINT"]
    assert yaml.safe_load(entrypoint) == ["edl-argo"]
    env = " ".join(i.arguments for i in stage if i.keyword == "ENV")
    assert f"PATH={VENV}/bin:$PATH" in env
    module, _, function = PYPROJECT["project"]["scripts"]["edl-argo"].partition(":")
    assert getattr(importlib.import_module(module), function) is cli.entry_point
    # every step and every pod runs it by that name
    commands = [t["container"]["command"] for t in container_templates()]
    commands += [c["command"] for pod in training_pod_manifests() for c in pod["spec"]["containers"]]
    assert len(commands) >= 6 and {command[0] for command in commands} == {"edl-argo"}


def test_the_package_goes_into_the_venv_on_the_path_without_build_tools_in_the_final_image() -> None:
    builds = [i for i in instructions() if i.keyword == "RUN" and "-m pip" in i.arguments]
    assert builds and all(f"--python {VENV}/bin/python" in i.arguments for i in builds)
    assert all(i.stage < max(j.stage for j in instructions()) for i in builds)  # pip runs in the build stage
    final = final_stage()
    assert final[0].arguments == "${PYTHON_IMAGE}"  # a fresh base, not the build stage
    assert not any(
        i.keyword == "RUN" and re.search(r"\b(pip|apt-get|gcc|make)\b", i.arguments) for i in final
    )
    assert any(i.keyword == "RUN" and f"venv --without-pip {VENV}" in i.arguments for i in instructions())


def test_the_bytecode_of_every_module_is_compiled_in_the_image() -> None:
    """The image runs with PYTHONDONTWRITEBYTECODE: what is not compiled at build time is compiled at every
    start of every step and pod."""
    compiles = [i for i in instructions() if i.keyword == "RUN" and "-m compileall" in i.arguments]
    assert any(
        f"{VENV}/bin/python -m compileall" in i.arguments and f"{VENV}/lib" in i.arguments for i in compiles
    )
    assert all(i.stage < max(j.stage for j in instructions()) for i in compiles)  # copied with the venv
    env = " ".join(i.arguments for i in final_stage() if i.keyword == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env


# -- the dependencies -----------------------------------------------------------------------------------


def test_the_dockerfile_installs_exactly_the_locked_dependency_set() -> None:
    runs = " && ".join(i.arguments for i in instructions() if i.keyword == "RUN")
    assert re.search(
        r"pip --python \S+ install --no-deps --requirement /opt/edl-argo/requirements\.lock", runs
    )
    assert re.search(r"pip --python \S+ install --no-deps /opt/edl-argo\b", runs)  # edl-argo itself
    assert re.search(r"pip --python \S+ check", runs)  # the lock is complete: nothing missing or in conflict
    assert context_path("/opt/edl-argo/requirements.lock") == LOCK


def test_the_lock_pins_exactly_the_dependencies_of_pyproject() -> None:
    pins = read_lock(LOCK)
    roots = [Requirement(text) for text in PYPROJECT["project"]["dependencies"]]
    via = {
        canonicalize_name(line.split("==")[0]): {v.strip() for v in line.split("# via ", 1)[1].split(",")}
        for line in LOCK.read_text().splitlines()
        if line and not line.startswith("#")
    }
    direct = {name for name, parents in via.items() if "edl-argo" in parents}
    assert direct == {canonicalize_name(r.name) for r in roots}
    for requirement in roots:
        version = pins[canonicalize_name(requirement.name)]
        assert requirement.specifier.contains(version, prereleases=True), (str(requirement), version)
    # nothing else: every other pin is needed by a pinned distribution
    assert all(parents <= set(pins) | {"edl-argo"} for parents in via.values())
    assert all(re.fullmatch(r"[\w.+!-]+", version) for version in pins.values())


# -- the version ----------------------------------------------------------------------------------------


def test_the_image_tag_defaults_to_the_one_declared_version() -> None:
    version = edl_argo.__version__
    assert PYPROJECT["project"]["dynamic"] == ["version"] and "version" not in PYPROJECT["project"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "edl_argo.__version__"}
    assert f"edl-argo:{version}" == IMAGE
    defaults = [
        parameter.get("default", parameter.get("value"))
        for _, document in rendered_documents()
        for template in document.get("spec", {}).get("templates", [])
        for parameter in template.get("inputs", {}).get("parameters", [])
        if parameter["name"] == "image"
    ]
    assert defaults and set(defaults) == {IMAGE}
    dry_run = subprocess.run(["make", "-n", "image"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert f"tools/build-image.sh '{IMAGE}'" in dry_run.stdout
    for doc in (ROOT / "README.md", ROOT / "templates" / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        tags = set(re.findall(r"edl-argo:(\d+\.\d+\.\d+)", doc.read_text()))
        assert tags <= {version}, f"{doc.name} names edl-argo:{tags - {version}}, not the version {version}"


# -- make image -----------------------------------------------------------------------------------------


def stub_builders(folder: Path, working: str | None) -> Path:
    """Fake docker, podman and buildah in ``folder``: only ``working`` passes its self-check; a build
    records its arguments in ``folder/built``."""
    folder.mkdir()
    for name in ("docker", "podman", "buildah"):
        check = "info" if name != "buildah" else "version"
        status = 0 if name == working else 1
        script = folder / name
        script.write_text(
            f'#!/bin/sh\nif [ "$1" = {check} ]; then exit {status}; fi\necho {name} "$@" > "{folder}/built"\n'
        )
        script.chmod(0o755)
    return folder


def make_image(folder: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    # Run as a top-level make even under `make test`: without MAKELEVEL/MAKEFLAGS its messages read
    # "make: ..." rather than "make[1]: ...".
    inherited = {"IMAGE", "MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES"}
    env = {key: value for key, value in os.environ.items() if key not in inherited}
    env["PATH"] = f"{folder}:{os.environ['PATH']}"
    return subprocess.run(
        ["make", "--no-print-directory", "-s", "image", *arguments],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_make_image_without_a_working_builder_says_so_in_one_line(tmp_path: Path) -> None:
    result = make_image(stub_builders(tmp_path / "bin", working=None), "IMAGE=registry.example/edl-argo:1")
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if not line.startswith("make:")]
    assert len(ours) == 1 and "no container builder" in ours[0] and "docker" in ours[0], result.stderr
    assert not (tmp_path / "bin" / "built").exists()


@pytest.mark.parametrize("builder", ["docker", "podman", "buildah"])
def test_make_image_builds_with_the_builder_that_works(tmp_path: Path, builder: str) -> None:
    folder = stub_builders(tmp_path / "bin", working=builder)
    result = make_image(folder, "IMAGE=registry.example/edl-argo:1")
    assert result.returncode == 0, result.stderr
    build = "bud" if builder == "buildah" else "build"
    assert (folder / "built").read_text().split() == [
        builder,
        build,
        "--tag",
        "registry.example/edl-argo:1",
        "--file",
        "Dockerfile",
        ".",
    ]
    default = make_image(folder)
    assert default.returncode == 0 and f"--tag {IMAGE} " in (folder / "built").read_text()
