"""docs/deploy.md: every manifest in it validates, and every command names files, make targets, edl-argo
flags, workflow parameters, WorkflowTemplates and labels that exist."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from hera.workflows.models import ArtifactRepository

from edl_argo import __version__, cli
from edl_argo.hera import STORAGE_SECRET
from edl_argo.pipeline.loader import load_workflow
from edl_argo.pods import manifests
from tests.manifests import ROOT, load_documents, validate

DOC = ROOT / "docs" / "deploy.md"
IMAGE = f"registry.example.com/ml/edl-argo:{__version__}"
#: Subcommands of kubectl and argo the doc may use, with the flags each may take (their real flags).
KUBECTL = {
    "create": {"-n"},
    "apply": {"-n", "-f"},
    "delete": {"-n", "-f"},
    "logs": {"-n", "-l", "--prefix", "--tail"},
}
ARGO = {
    "submit": {"-n", "--watch", "-p", "--from"},
    "logs": {"-n", "-l", "--follow"},
    "delete": {"-n", "--all"},
}


def blocks(language: str) -> Iterator[tuple[str | None, str]]:
    """(the file the text before it names as `name`:, text) of every fenced block of ``language``."""
    text = DOC.read_text()
    for match in re.finditer(rf"(?:`([\w.-]+)`:\n\n)?```{language}\n(.*?)```", text, re.S):
        yield match[1], match[2]


def commands() -> list[list[str]]:
    lines = [line for _, text in blocks("sh") for line in text.replace("\\\n", " ").splitlines()]
    return [shlex.split(line, comments=True) for line in lines if line.strip()]


def written_files() -> set[str]:
    """The files the doc has the reader write: manifests it shows, and outputs of ``> file``."""
    named = {name for name, _ in blocks("yaml") if name}
    redirected = {words[words.index(">") + 1] for words in commands() if ">" in words}
    return named | redirected


def test_the_doc_has_the_steps_of_the_issue() -> None:
    words = [" ".join(c[:2]) for c in commands()]
    for expected in (
        "make image",
        "docker push",
        "kubectl create",
        "kubectl apply",
        "argo submit",
        "argo logs",
    ):
        assert expected in words, expected
    assert ["kubectl", "apply", "-n", "ml", "-f", "templates/"] in commands()
    assert (
        any(c[:2] == ["argo", "delete"] for c in commands())
        and ["kubectl", "delete", "namespace", "ml"] in commands()
    )
    assert "artifactRepositoryRef" in DOC.read_text()


def manifest_blocks() -> list[tuple[str | None, list[dict[str, Any]]]]:
    return [(name, [d for d in yaml.safe_load_all(text) if d]) for name, text in blocks("yaml")]


def test_every_manifest_validates() -> None:
    documents = [(name, d) for name, docs in manifest_blocks() for d in docs if name]
    assert {d["kind"] for _, d in documents} == {"Role", "RoleBinding", "Secret", "ConfigMap"}
    for _, document in documents:
        validate(document)
    # the fragment: a Workflow's spec with the artifactRepositoryRef
    (fragment,) = [docs[0] for name, docs in manifest_blocks() if name is None]
    workflow = load_workflow(ROOT / "examples" / "pipelines" / "digits_pipeline.py").model_dump(
        by_alias=True, exclude_none=True, mode="json"
    )
    workflow["spec"].update(fragment)
    validate(workflow)


def documents_of(kind: str) -> list[dict[str, Any]]:
    return [d for _, docs in manifest_blocks() for d in docs if d.get("kind") == kind]


def test_the_storage_secret_is_the_one_the_steps_and_pods_read() -> None:
    (secret,) = documents_of("Secret")
    assert secret["metadata"]["name"] == STORAGE_SECRET
    assert set(secret["stringData"]) == {"EDL_S3_ENDPOINT", *manifests.SECRET_KEYS} - {"AWS_SESSION_TOKEN"}
    (repositories,) = documents_of("ConfigMap")
    from examples.pipelines.digits_s3_model_pipeline import ARTIFACT_REPOSITORY

    key = ARTIFACT_REPOSITORY.key
    assert repositories["metadata"]["name"] == ARTIFACT_REPOSITORY.config_map
    repository = ArtifactRepository.model_validate(yaml.safe_load(repositories["data"][key]))
    assert repository.s3 is not None
    for selector in (repository.s3.access_key_secret, repository.s3.secret_key_secret):
        assert (
            selector is not None and selector.name == STORAGE_SECRET and selector.key in secret["stringData"]
        )
    annotation = repositories["metadata"]["annotations"]["workflows.argoproj.io/default-artifact-repository"]
    assert annotation == key
    # the executor Role is what templates/README.md says every step needs
    (role,) = documents_of("Role")
    assert role["rules"] == [
        {"apiGroups": ["argoproj.io"], "resources": ["workflowtaskresults"], "verbs": ["create", "patch"]}
    ]


def test_every_file_the_commands_name_exists() -> None:
    written = written_files()
    checked = 0
    for words in commands():
        for i, word in enumerate(words):
            if word == ">":
                break
            path = (
                word if words[i - 1] == "-f" else word if re.fullmatch(r"[\w./-]+\.(py|yaml)", word) else ""
            )
            if not path or path.startswith("/opt/edl-argo/"):
                continue
            assert path in written or (ROOT / path).exists(), f"{' '.join(words)}: no file {path}"
            checked += 1
    assert checked >= 8


@pytest.mark.parametrize("tool, allowed", [("kubectl", KUBECTL), ("argo", ARGO)])
def test_kubectl_and_argo_use_known_subcommands_and_flags(tool: str, allowed: dict[str, set[str]]) -> None:
    used = [c for c in commands() if c[0] == tool]
    assert used
    for words in used:
        assert words[1] in allowed, words
        flags = {w.split("=")[0] for w in words[2:] if w.startswith("-")}
        assert flags <= allowed[words[1]], (words, flags - allowed[words[1]])


def test_edl_argo_and_make_commands_parse() -> None:
    edl_argo = [c for c in commands() if c[0] == "edl-argo"]
    assert edl_argo
    parser = cli.build_parser()
    for words in edl_argo:
        arguments = words[1 : words.index(">")] if ">" in words else words[1:]
        parser.parse_args(arguments)  # exits (fails the test) on an unknown flag or command
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for words in (c for c in commands() if c[0] == "make"):
        assert words[1] in targets
        assert words[2:] == [f"IMAGE={IMAGE}"]
    pushes = [c for c in commands() if c[1:2] == ["push"]]
    assert pushes and all(c[2] == IMAGE for c in pushes)


def test_argo_submit_parameters_and_templates_exist() -> None:
    rendered = {
        words[words.index(">") + 1]: ROOT / words[words.index("render") + 1]
        for words in commands()
        if words[:3] == ["edl-argo", "pipeline", "render"]
    }
    templates = {
        d["metadata"]["name"]: d
        for path in (ROOT / "templates").glob("*.yaml")
        for d in load_documents(path)
        if d["kind"] == "WorkflowTemplate"
    }
    submits = [c for c in commands() if c[:2] == ["argo", "submit"]]
    assert len(submits) == 2
    for words in submits:
        if "--from" in words:
            kind, _, name = words[words.index("--from") + 1].partition("/")
            assert kind == "workflowtemplate" and name in templates
            spec = templates[name]["spec"]
            names = {p["name"] for t in spec["templates"] for p in t.get("inputs", {}).get("parameters", [])}
        else:
            (file,) = [w for w in words if w in rendered]
            workflow = load_workflow(rendered[file])
            names = {p.name for p in workflow.spec.arguments.parameters}
        given = [words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "-p"]
        assert given and {name for name, _ in given} <= names, (words, names)
        assert dict(given)["image"] == IMAGE


def test_argo_logs_selects_the_job_pods_by_their_labels() -> None:
    selectors = [c[c.index("-l") + 1] for c in commands() if "-l" in c]
    assert {"edl-argo/role=worker", "edl-argo/role=ps"} <= set(selectors)
    for selector in selectors:
        key, _, value = selector.partition("=")
        assert key == manifests.ROLE_LABEL and value in ("worker", "ps")
    assert manifests.WORKFLOW_LABEL == "workflows.argoproj.io/workflow"  # what `argo logs` selects by
    assert manifests.CONTAINER == "main"  # the container `argo logs` reads by default


#: Repository paths in the prose of a doc: `templates/x.yaml`, `examples/cluster/`, `tests/...`.
_PROSE_PATH = re.compile(r"`((?:templates|examples|docs|tests|components|edl_argo)/[\w./-]*)`")


@pytest.mark.parametrize("doc", [DOC, ROOT / "templates" / "README.md"], ids=lambda p: p.parent.name)
def test_every_repository_path_the_prose_names_exists(doc: Any) -> None:
    named = _PROSE_PATH.findall(doc.read_text())
    assert named
    assert [path for path in named if not (ROOT / path).exists()] == []


def test_the_cli_is_installed_before_the_first_edl_argo_command() -> None:
    listed = commands()
    first_edl_argo = next(i for i, words in enumerate(listed) if words[0] == "edl-argo")
    installs = [i for i, words in enumerate(listed) if words[:4] == ["python", "-m", "pip", "install"]]
    assert installs and installs[0] < first_edl_argo
    assert listed[installs[0]][4:] == ["."]  # this clone: the CLI of the templates it renders


def test_the_doc_covers_cluster_wide_and_namespaced_argo_installs() -> None:
    text = " ".join(DOC.read_text().split())
    assert "namespace install" in text and "--server-side" in text


def test_every_argo_submit_of_the_templates_readme_names_the_image() -> None:
    """The default image (edl-argo:VERSION) is on no registry: a submit without -p image= cannot pull it."""
    text = (ROOT / "templates" / "README.md").read_text()
    submits = [
        shlex.split(line, comments=True)
        for block in re.findall(r"```sh\n(.*?)```", text, re.S)
        for line in block.replace("\\\n", " ").splitlines()
        if line.startswith("argo submit")
    ]
    assert len(submits) >= 2
    assert [s for s in submits if not any(w.startswith("image=") for w in s)] == []
