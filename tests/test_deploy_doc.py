"""docs/deploy.md: every manifest in it validates, and every command names files, make targets, edl-argo
flags, workflow parameters, WorkflowTemplates and labels that exist; and the doc, followed in its order,
runs against the Kubernetes stand-in where it can (the last test, which lists what does not run here and
why)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
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


# -- the doc run in order against the Kubernetes stand-in ------------------------------------------------

#: Commands of the doc that cannot run here, by their first words, and why. The static tests above check
#: them; ``argo submit`` is also checked where it stands in the run (:meth:`DocRun.check_submit`).
NOT_RUN = {
    ("make", "image"): "builds the image with docker, podman or buildah: no container engine runs here",
    ("docker", "push"): "pushes to the reader's registry",
    ("python", "-m", "pip", "install"): "would install over the test environment's own install of this"
    " clone, which is the CLI the later edl-argo commands run",
    ("aws", "s3", "cp"): "copies to the reader's bucket; the aws CLI is no dependency of the tests",
    ("argo", "submit"): "needs Argo's controller: what it names is checked where it stands instead",
    ("argo", "logs"): "needs a running workflow",
    ("argo", "delete"): "needs Argo's controller (the stand-in holds no workflow of the doc's)",
    ("kubectl", "logs"): "needs a running job",
}
#: Kinds that ``kubectl apply`` creates through the stand-in's API (it serves them), with the official
#: client: kubectl itself needs the API's discovery documents (/api, /apis, OpenAPI), which the stand-in
#: does not serve, and is no dependency of the tests.
APPLIED_KINDS = {"Secret", "ConfigMap", "NetworkPolicy", "WorkflowTemplate"}
#: Kinds of the doc's files the stand-in does not serve: RBAC is enforced from templates/rbac.yaml read
#: directly (tests/test_training_kubernetes.py), PriorityClasses are cluster-scoped and unused by it.
NOT_APPLIED_KINDS = {"ServiceAccount", "Role", "RoleBinding", "PriorityClass"}


def steps() -> list[tuple[str, Any]]:
    """The doc's steps in its order: ``("write", (name, text))`` for a manifest it has the reader save
    as ``name`` (the `name`: line before it), ``("run", words)`` for each command of its ``sh`` blocks."""
    found: list[tuple[str, Any]] = []
    for match in re.finditer(r"(?:`([\w.-]+)`:\n\n)?```(yaml|sh)\n(.*?)```", DOC.read_text(), re.S):
        name, language, text = match[1], match[2], match[3]
        if language == "yaml":
            if name:
                found.append(("write", (name, text)))
            continue
        for line in text.replace("\\\n", " ").splitlines():
            if line.strip():
                found.append(("run", shlex.split(line, comments=True)))
    return found


class _Kind:
    """create(namespace, body), read(namespace, name) and delete(namespace, name) of one kind, through the
    official client's calls for it."""

    def __init__(self, api: Any, kind: str) -> None:
        from kubernetes import client as k8s

        core, networking, custom = k8s.CoreV1Api(api), k8s.NetworkingV1Api(api), k8s.CustomObjectsApi(api)
        if kind == "WorkflowTemplate":
            where = ("argoproj.io", "v1alpha1")
            self.create = lambda ns, body: custom.create_namespaced_custom_object(
                *where, ns, "workflowtemplates", body
            )
            self.read = lambda ns, name: custom.get_namespaced_custom_object(
                *where, ns, "workflowtemplates", name
            )
            self.delete = lambda ns, name: custom.delete_namespaced_custom_object(
                *where, ns, "workflowtemplates", name
            )
            return
        api_object, suffix = {
            "Secret": (core, "secret"),
            "ConfigMap": (core, "config_map"),
            "NetworkPolicy": (networking, "network_policy"),
        }[kind]
        create = getattr(api_object, f"create_namespaced_{suffix}")
        read = getattr(api_object, f"read_namespaced_{suffix}")
        delete = getattr(api_object, f"delete_namespaced_{suffix}")
        self.create = lambda ns, body: create(ns, body)
        self.read = lambda ns, name: api.sanitize_for_serialization(read(name, ns))
        self.delete = lambda ns, name: delete(name, ns)


class DocRun:
    """Runs the doc's steps in order in ``folder`` (the reader's clone: the repository's files, and the
    files the reader writes) against the stand-in that ``api`` (an official-client ApiClient) reaches: see
    :func:`test_the_doc_runs_in_order_against_the_kubernetes_stand_in`."""

    def __init__(self, folder: Path, api: Any) -> None:
        self.folder, self.api = folder, api
        written = written_files()  # a reader's earlier run may have left them in this clone
        for entry in ROOT.iterdir():
            if entry.name not in (".git", ".venv", *written):
                (folder / entry.name).symlink_to(entry)
        self.namespaces = {"default"}
        self.applied: list[tuple[str, str, str]] = []  # (kind, namespace, name) in order
        self.not_applied: set[str] = set()
        self.ran: list[list[str]] = []
        self.not_run: list[list[str]] = []
        self.submits_checked = 0

    def write(self, name: str, text: str) -> None:
        assert not (self.folder / name).exists(), f"the doc writes {name} twice, or over a repository file"
        (self.folder / name).write_text(text)

    def run(self, words: list[str]) -> None:
        namespace = words[words.index("-n") + 1] if "-n" in words else "default"
        assert namespace in self.namespaces, f"{' '.join(words)}: namespace {namespace} not created yet"
        if words[:3] == ["kubectl", "create", "namespace"]:
            self.namespaces.add(words[3])  # the stand-in's namespaces exist once named
        elif words[:3] == ["kubectl", "delete", "namespace"]:
            self.namespaces.remove(words[3])
        elif words[:2] in (["kubectl", "apply"], ["kubectl", "delete"]):
            self.kubectl(words[1], namespace, self.folder / words[words.index("-f") + 1])
        elif words[0] == "edl-argo":
            self.edl_argo(words)
        else:
            reason = next(
                (why for start, why in NOT_RUN.items() if tuple(words[: len(start)]) == start), None
            )
            assert reason, f"{' '.join(words)}: neither run nor listed in NOT_RUN with a reason"
            if words[:2] == ["argo", "submit"]:
                self.check_submit(words, namespace)
            self.not_run.append(words)
            return
        self.ran.append(words)

    def documents(self, path: Path) -> list[dict[str, Any]]:
        """The objects of ``path``, a file or a folder of them (its .yaml files in name order, as kubectl)."""
        assert path.exists(), f"{path.name} does not exist yet"
        files = sorted(path.glob("*.yaml")) if path.is_dir() else [path]
        return [d for file in files for d in yaml.safe_load_all(file.read_text()) if d]

    def kubectl(self, verb: str, namespace: str, path: Path) -> None:
        for document in self.documents(path):
            kind, name = document["kind"], document["metadata"]["name"]
            if kind not in APPLIED_KINDS:
                self.not_applied.add(kind)
                continue
            calls = _Kind(self.api, kind)
            if verb == "apply":
                calls.create(namespace, document)
                assert calls.read(namespace, name)["metadata"]["name"] == name
                self.applied.append((kind, namespace, name))
            else:
                calls.delete(namespace, name)
                assert self.exists(kind, namespace, name) is False, (kind, name)

    def exists(self, kind: str, namespace: str, name: str) -> bool:
        from kubernetes.client.rest import ApiException

        try:
            _Kind(self.api, kind).read(namespace, name)
        except ApiException as error:
            assert error.status == 404, error
            return False
        return True

    def edl_argo(self, words: list[str]) -> None:
        """Run the installed ``edl-argo`` (this environment's) as the reader would, ``> file`` included."""
        argv, output = (
            (words[: words.index(">")], words[words.index(">") + 1]) if ">" in words else (words, "")
        )
        program = str(Path(sys.executable).parent / "edl-argo")
        done = subprocess.run(
            [program, *argv[1:]], cwd=self.folder, capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, f"{' '.join(words)}: exit {done.returncode}\n{done.stderr[-2000:]}"
        if output:
            self.write(output, done.stdout)

    def check_submit(self, words: list[str], namespace: str) -> None:
        """What ``argo submit`` (not run) needs at this point of the doc, read from the stand-in and the
        reader's folder: the workflow file (written by an earlier step) is a valid Workflow whose artifact
        repository and its Secret exist in the namespace; or the WorkflowTemplate of
        ``--from`` exists there; and each ``-p`` names a parameter of what is submitted."""
        given = {words[i + 1].split("=", 1)[0] for i, w in enumerate(words) if w == "-p"}
        if "--from" in words:
            kind, _, name = words[words.index("--from") + 1].partition("/")
            assert kind == "workflowtemplate" and self.exists("WorkflowTemplate", namespace, name), words
            spec = _Kind(self.api, "WorkflowTemplate").read(namespace, name)["spec"]
            (entry,) = [t for t in spec["templates"] if t["name"] == spec["entrypoint"]]
            names = {p["name"] for p in entry["inputs"]["parameters"]}
        else:
            (file,) = [w for w in words[2:] if w.endswith(".yaml")]
            assert (self.folder / file).exists(), f"{' '.join(words)}: no {file} written before"
            (workflow,) = self.documents(self.folder / file)
            validate(workflow)
            names = {p["name"] for p in workflow["spec"]["arguments"]["parameters"]}
            self.check_references(workflow, namespace)
        assert given and given <= names, (words, given - names)
        self.submits_checked += 1

    def check_references(self, workflow: dict[str, Any], namespace: str) -> None:
        """The workflow's artifact repository is a key of a ConfigMap in ``namespace``, whose S3 settings
        name keys of a Secret there. (The doc's pipeline embeds its templates: no templateRef to check.)"""
        assert not any("templateRef" in str(t) for t in workflow["spec"]["templates"])
        reference = workflow["spec"]["artifactRepositoryRef"]
        config_map = _Kind(self.api, "ConfigMap").read(namespace, reference["configMap"])
        repository = ArtifactRepository.model_validate(yaml.safe_load(config_map["data"][reference["key"]]))
        assert repository.s3 is not None and repository.s3.access_key_secret is not None
        secret = _Kind(self.api, "Secret").read(namespace, repository.s3.access_key_secret.name)
        for selector in (repository.s3.access_key_secret, repository.s3.secret_key_secret):
            assert selector is not None and selector.key in secret["data"], selector


def test_the_doc_runs_in_order_against_the_kubernetes_stand_in(tmp_path: Path) -> None:
    """deploy.md followed literally, step by step in its order, in a folder holding the clone's files:
    each manifest it shows is written where it says, and each command runs, or is checked where it stands.

    Run for real: ``kubectl create namespace`` (bookkeeping: the stand-in's namespaces exist once named;
    no command may use a namespace before it is created or after it is deleted), ``kubectl apply`` and
    ``kubectl delete`` of the kinds the stand-in serves (:data:`APPLIED_KINDS`, through its API with the
    official client; the other kinds, :data:`NOT_APPLIED_KINDS`, are not applied), and ``edl-argo``
    commands (this environment's CLI, its output redirected as the doc says). Not run (:data:`NOT_RUN`,
    with the reasons): ``make image``, ``docker push``, ``python -m pip install .``, ``aws s3 cp``,
    ``argo submit`` / ``logs`` / ``delete`` and ``kubectl logs``. Each ``argo submit`` is checked where it
    stands against what the earlier steps created: the file it submits exists and validates, its artifact
    repository's ConfigMap and Secret keys exist, the WorkflowTemplate of ``--from`` exists, and its
    ``-p`` parameters are the submitted workflow's or template's.

    Also: ``kubectl apply -f templates/`` creates the WorkflowTemplates the prose says it creates, and
    ``kubectl delete -f templates/`` removes them, while the namespace's storage Secret stays.
    """
    from tests.k8s_stand_in import KubernetesStandIn

    folder = tmp_path / "clone"
    folder.mkdir()
    with KubernetesStandIn(tmp_path / "k8s", echo_logs=False) as cluster, cluster.api_client() as api:
        run = DocRun(folder, api)
        prose = " ".join(DOC.read_text().split())
        claimed = re.search(r"This creates the WorkflowTemplates (.*?);", prose)
        assert claimed
        templates_applied = False
        for step, value in steps():
            if step == "write":
                run.write(*value)
                continue
            run.run(value)
            if value[:2] == ["kubectl", "apply"] and value[-1] == "templates/":
                held = [n for k, ns, n in run.applied if k == "WorkflowTemplate" and ns == "ml"]
                assert sorted(held) == sorted(re.findall(r"`([\w-]+)`", claimed[1]))
                templates_applied = True
            if value[:2] == ["kubectl", "delete"] and value[-1] == "templates/":
                assert not any(run.exists(k, ns, n) for k, ns, n in run.applied if k == "WorkflowTemplate")
                assert run.exists("Secret", "ml", STORAGE_SECRET)  # not one of templates/

    assert templates_applied and run.submits_checked == 2
    assert {kind for kind, _, _ in run.applied} == APPLIED_KINDS
    assert run.not_applied == NOT_APPLIED_KINDS
    assert "ml" not in run.namespaces  # removed at the end
    used = {start for start in NOT_RUN for words in run.not_run if tuple(words[: len(start)]) == start}
    assert used == set(NOT_RUN)  # every reason given is for a command of the doc
    ran = [" ".join(words[:3]) for words in run.ran]
    assert ran.count("kubectl apply -n") == 4 and "edl-argo pipeline render" in ran
