"""Models at a storage URL (``--model-def s3://...``): fetched once by the master, staged by content, and
run as the same bytes by every pod, without being in any image or working directory."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from edl_argo import cli, log
from edl_argo.errors import ConfigError
from edl_argo.master.job import TrainingJob
from edl_argo.model import load_model_spec
from edl_argo.model.source import (
    MAX_FILES,
    ModelSource,
    StagedModel,
    local_model_def,
    pack,
    parse_model_source,
    pin_model_def,
    stage_model_def,
)
from edl_argo.pipeline.loader import load_workflow, with_parameters
from edl_argo.pipeline.runner import LocalRunner
from edl_argo.pods.kubernetes import API_URL_ENV
from edl_argo.pods.kubernetes_config import KubernetesConfig, Owner
from edl_argo.storage import open_storage
from edl_argo.storage.trees import open_tree
from tests.engine_helpers import (
    DIGITS_ACCURACY_FLOOR,
    DIGITS_MODEL,
    JobThread,
    assert_no_record_lost,
    digits_config,
    master_port_turn,
    model_dir,
)
from tests.k8s_helpers import ROOT, job_selector, kubernetes_ps_port, role_rules
from tests.k8s_stand_in import KubernetesStandIn
from tests.s3_stand_in import S3StandIn

MODEL_BYTES = Path(DIGITS_MODEL).read_bytes()
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@pytest.mark.parametrize(
    ("model_def", "source"),
    [
        ("s3://b/models/m.py", ModelSource("s3://b/models/m.py", "", "")),
        ("s3://b/models/m.py:build", ModelSource("s3://b/models/m.py", "", "build")),
        ("s3://b/models/cnn/:main.py", ModelSource("s3://b/models/cnn/", "main.py", "")),
        ("file:///m/cnn/:pkg/main.py:build", ModelSource("file:///m/cnn/", "pkg/main.py", "build")),
        (
            f"s3://b/j/model-defs/sha256-{'a' * 64}.tar:m.py",
            ModelSource(f"s3://b/j/model-defs/sha256-{'a' * 64}.tar", "m.py", ""),
        ),
        ("examples/model_zoo/digits.py", None),
        ("my_package.my_model.build", None),
    ],
)
def test_model_def_forms(model_def: str, source: ModelSource | None) -> None:
    assert parse_model_source(model_def) == source


@pytest.mark.parametrize(
    "model_def", ["s3://b/models/", "s3://b/models/m.txt", "s3://b/x.tar", "s3://b/m.py:a.py"]
)
def test_a_url_that_names_no_model_is_refused(model_def: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(model_def)):
        parse_model_source(model_def)


def test_a_bundle_depends_on_names_and_contents_only() -> None:
    files = {"b.py": b"x = 1\n", "a.py": b"y = 2\n"}
    assert pack(files) == pack(dict(reversed(files.items())))
    assert pack(files) != pack({**files, "a.py": b"y = 3\n"})


def write_model(folder: Path, name: str = "digits.py", data: bytes = MODEL_BYTES) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
    return (folder / name).as_uri()


def test_staging_names_the_bundle_by_its_content_and_loads_the_same_bytes(tmp_path: Path) -> None:
    url = write_model(tmp_path / "models")
    staged = stage_model_def(url, str(tmp_path / "state"), shared=False)
    assert staged is not None and DIGEST.fullmatch(staged.digest)
    hex_digest = staged.digest.removeprefix("sha256:")
    bundle = tmp_path / "state" / "model-defs" / f"sha256-{hex_digest}.tar"
    assert bundle.is_file() and staged.pod_model_def == f"{bundle.as_uri()}:digits.py"
    spec = load_model_spec(staged.pod_model_def)
    assert spec.source == staged.pod_model_def and callable(spec.custom_model)
    # the same model staged again: the same object, not rewritten
    mtime = bundle.stat().st_mtime_ns
    assert stage_model_def(url, str(tmp_path / "state"), shared=False) == staged
    assert bundle.stat().st_mtime_ns == mtime


def test_a_bundle_whose_content_does_not_match_its_name_is_refused(tmp_path: Path) -> None:
    url = write_model(tmp_path / "models")
    staged = stage_model_def(url, str(tmp_path / "state"), shared=False)
    assert staged is not None
    tampered = pack({"digits.py": MODEL_BYTES + b"\nraise SystemExit('not the staged model')\n"})
    bundle_url = staged.pod_model_def.rsplit(":", 1)[0]
    forged = tmp_path / "forged" / bundle_url.rsplit("/", 1)[1]  # the staged bundle's name, other bytes
    forged.parent.mkdir()
    forged.write_bytes(tampered)
    with pytest.raises(ConfigError, match="the bundle's content has sha256:"):
        local_model_def(f"{forged.as_uri()}:digits.py")


def test_a_folder_of_modules_loads_its_entry_with_its_siblings(tmp_path: Path) -> None:
    folder = tmp_path / "models" / "digits_pkg"
    write_model(folder, "layers.py", b"UNITS = 10\n")
    entry = MODEL_BYTES.replace(
        b"import tensorflow as tf", b"import tensorflow as tf\nfrom layers import UNITS"
    )
    write_model(folder, "main.py", entry + b"\nassert UNITS == 10\n")
    staged = stage_model_def(f"{folder.as_uri()}/:main.py", str(tmp_path / "state"), shared=False)
    assert staged is not None and staged.pod_model_def.endswith(".tar:main.py")
    assert callable(load_model_spec(staged.pod_model_def).feed)


def test_missing_and_oversized_models_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--model-def file://.*/nothing\.py: no such file"):
        stage_model_def((tmp_path / "nothing.py").as_uri(), str(tmp_path / "state"), shared=False)
    folder = tmp_path / "many"
    for i in range(MAX_FILES + 1):
        write_model(folder, f"m{i}.py", b"")
    with pytest.raises(ConfigError, match=f"at most {MAX_FILES} files"):
        stage_model_def(f"{folder.as_uri()}/:m0.py", str(tmp_path / "state"), shared=False)
    write_model(tmp_path / "models")
    with pytest.raises(ConfigError, match=r"has no main\.py"):
        stage_model_def(f"{(tmp_path / 'models').as_uri()}/:main.py", str(tmp_path / "state"), shared=False)


def test_kubernetes_pods_need_a_shared_state_url(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "train", "--model-def", "s3://models/digits.py", "--training-data", str(tmp_path / "data"),
        "--output", str(tmp_path / "out"), "--backend", "kubernetes", "--image", "edl-argo:1",
    ]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--master-state" in err[0] and "s3://models/digits.py" in err[0], err


def test_a_continued_job_keeps_the_model_of_its_first_master(tmp_path: Path) -> None:
    url = write_model(tmp_path / "models")
    state = str(tmp_path / "state")
    first = stage_model_def(url, state, shared=False)
    assert first is not None
    assert pin_model_def(first, state, "job-a", continuing=False) == first
    write_model(tmp_path / "models", data=MODEL_BYTES + b"\n# changed while the job ran\n")
    second = stage_model_def(url, state, shared=False)
    assert second is not None and second.digest != first.digest
    assert pin_model_def(second, state, "job-a", continuing=True) == first  # a restarted master
    assert pin_model_def(second, state, "job-a", continuing=False) == second  # a new run
    assert isinstance(second, StagedModel)


# -- on the Kubernetes stand-in, from the S3 stand-in ---------------------------------------------------


@pytest.fixture
def cluster(tmp_path: Path, s3_server: S3StandIn, s3_env: str) -> Iterator[KubernetesStandIn]:
    pods_dir = tmp_path / "pods-cwd"
    pods_dir.mkdir()
    with KubernetesStandIn(pods_dir) as server:
        server.enforce_rules(role_rules())
        credentials = {k: v for k, v in s3_server.env().items() if k.startswith("AWS_")}
        server.create("secrets", {"metadata": {"name": "storage"}, "stringData": credentials})
        yield server


@pytest.mark.timeout(400)
def test_a_model_only_in_s3_trains_on_kubernetes_pods_that_all_run_the_same_bytes(
    cluster: KubernetesStandIn,
    s3_server: S3StandIn,
    s3_env: str,
    digits_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log.configure("INFO")
    monkeypatch.setenv(API_URL_ENV, cluster.url)
    model_url = f"{s3_env}/models/my_digits.py"
    storage = open_storage(s3_env)
    storage.write("models/my_digits.py", MODEL_BYTES)
    name = f"wf-{uuid.uuid4().hex[:6]}"
    workflow = cluster.create(
        "workflows", {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": {"name": name}}
    )
    settings = KubernetesConfig(
        image="edl-argo:test",
        storage_secret="storage",
        storage_endpoint=s3_server.endpoint,  # as config_from_args takes them from the master's environment
        storage_region=s3_server.region,
        workflow_name=name,
        owner=Owner("argoproj.io/v1alpha1", "Workflow", name, workflow["metadata"]["uid"]),
        ps_port=kubernetes_ps_port(),
    )
    config = digits_config(
        digits_data,
        tmp_path / "job",
        model_def=model_url,
        master_state=f"{s3_env}/jobs/{name}",
        job_name=f"digits-{name[3:]}",
        backend="kubernetes",
        kubernetes=settings,
    )
    job = TrainingJob.load(config)
    assert job.model is not None
    digest = job.model.digest
    # The file at the URL changes once the job started: its pods still get what the master checked.
    storage.write("models/my_digits.py", b"raise SystemExit('not the model the job started with')\n")
    metrics = JobThread(job).start().join(360)

    assert metrics["final_metrics"]["accuracy"] >= DIGITS_ACCURACY_FLOOR
    assert_no_record_lost(metrics)
    assert metrics["relaunches"]["worker"] == metrics["relaunches"]["ps"] == 0
    flags = json.loads((model_dir(tmp_path / "job") / "flags.json").read_text())
    assert flags["model_def"] == model_url and flags["model_def_digest"] == digest
    bundle = f"{s3_env}/jobs/{name}/model-defs/sha256-{digest.removeprefix('sha256:')}.tar"
    assert flags["model_def_bundle"] == f"{bundle}:my_digits.py"
    assert not list(cluster.workdir.glob("*.py"))  # the pods' working directory has no model file
    logs = {path.name: path.read_text() for path in (cluster.workdir / "logs").glob("*.log")}
    pods = [n for n in logs if "-worker-" in n or "-ps-" in n]
    assert len(pods) == 3, sorted(logs)  # 2 workers and a PS
    for pod in pods:
        fetched = re.findall(r"model_def_fetched url=(\S+) digest=(\S+)", logs[pod])
        assert fetched == [(bundle, digest)], (pod, logs[pod][-2000:])
    assert cluster.objects("pods", job_selector(config.job_name)) == []


@pytest.mark.slow  # the whole pipeline on S3; make test trains a model from S3 in the test above
def test_the_digits_pipeline_variant_trains_its_model_from_s3(s3_env: str, tmp_path: Path) -> None:
    """``examples/pipelines/digits_s3_model_pipeline.py``, run here, with its model only in S3."""
    open_storage(s3_env).write("models/digits.py", MODEL_BYTES)
    parameters = {"data": f"{s3_env}/digits", "model-def": f"{s3_env}/models/digits.py"}
    workflow = with_parameters(
        load_workflow(ROOT / "examples" / "pipelines" / "digits_s3_model_pipeline.py"), parameters
    )
    assert workflow.spec.artifact_repository_ref is not None
    with master_port_turn():
        result = LocalRunner(workflow, tmp_path / "run", f"{s3_env}/artifacts").run()
    assert result.failed is None, f"step {result.failed.name} failed: {result.failed.message}"
    evaluation = json.loads(result.step("evaluate").parameters["metrics"])
    assert evaluation["accuracy"] >= DIGITS_ACCURACY_FLOOR and evaluation["records"] == 360
    model = open_storage(result.step("elastic-train").artifacts["model"])
    flags = json.loads(model.read(open_tree(model, "").file_key("flags.json")))  # the version published
    assert flags["model_def"] == parameters["model-def"]
    assert (
        flags["model_def_digest"] == "sha256:" + hashlib.sha256(pack({"digits.py": MODEL_BYTES})).hexdigest()
    )
