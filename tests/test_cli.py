"""The command line: one-line errors naming the culprit, non-zero exits, no tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edl_argo import cli
from edl_argo.data.commands import digits_records, write_dataset
from edl_argo.recordio import Compressor
from edl_argo.storage import LocalStorage
from tests.engine_helpers import DIGITS_MODEL, python_lines, run_python


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def error_lines(err: str) -> list[str]:
    """The lines of stderr that are not structured log events."""
    return [line for line in err.splitlines() if line and not line[:4].isdigit()]


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    train, test = digits_records(0.2, 0)
    storage = LocalStorage(tmp_path / "data")
    write_dataset(storage, "train", train[:200], 2, Compressor.NONE, overwrite=False)
    write_dataset(storage, "test", test[:50], 1, Compressor.NONE, overwrite=False)
    return tmp_path / "data"


def train_args(dataset: Path, output: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--model-def", DIGITS_MODEL,
        "--training-data", str(dataset / "train"),
        "--output", str(output),
        *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "culprit"),
    [
        (["--num-workers", "0"], "--num-workers"),
        (["--minibatch-size", "x"], "--minibatch-size"),
        (["--use-async", "--grads-to-wait", "2"], "--grads-to-wait"),
        (["--evaluation-steps", "5"], "--validation-data"),
        (["--backend", "mesos"], "--backend"),
    ],
)
def test_invalid_train_flags_fail_with_one_line(
    capsys, dataset: Path, tmp_path: Path, flags, culprit
) -> None:
    code, _, err = run_cli(capsys, *train_args(dataset, tmp_path / "out", *flags))
    assert code == 2
    lines = error_lines(err)
    assert len(lines) == 1 and culprit in lines[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flag", "command"),
    [
        ("--output", "train"),
        ("--checkpoint-dir", "train"),
        ("--metrics-output", "train"),
        ("--output", "evaluate"),
        ("--output", "predict"),
    ],
)
def test_an_output_below_a_regular_file_fails_before_the_work_naming_its_flag(
    capsys, dataset: Path, tmp_path: Path, flag: str, command: str
) -> None:
    """Caught before anything runs: train starts no job (its --output stays empty), evaluate and predict
    fail before they look for their model (a missing one here)."""
    (tmp_path / "afile").write_text("mine")
    below = str(tmp_path / "afile" / "x")
    if command == "train":
        extra = ["--checkpoint-steps", "5"] if flag == "--checkpoint-dir" else []
        argv = train_args(dataset, tmp_path / "out", *extra, flag, below)
    else:
        argv = [command, "--model", str(tmp_path / "no-model"), "--model-def", DIGITS_MODEL]
        argv += ["--data", str(dataset / "test"), "--output", below]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    (line,) = error_lines(err)
    assert f"{flag} {below}" in line and f"{tmp_path / 'afile'} is a file, not a folder" in line, line
    assert not (tmp_path / "out").exists()
    assert (tmp_path / "afile").read_text() == "mine"


def test_model_file_missing_function_is_named(capsys, dataset: Path, tmp_path: Path) -> None:
    model = tmp_path / "broken_model.py"
    model.write_text(Path(DIGITS_MODEL).read_text().replace("def loss(", "def lost("))
    code, _, err = run_cli(capsys, *train_args(dataset, tmp_path / "out", "--model-def", str(model)))
    assert code == 2
    (line,) = error_lines(err)
    assert "broken_model.py" in line and "'loss'" in line


def test_model_file_syntax_error_is_named(capsys, dataset: Path, tmp_path: Path) -> None:
    model = tmp_path / "typo.py"
    model.write_text("def custom_model(:\n    pass\n")
    code, _, err = run_cli(capsys, *train_args(dataset, tmp_path / "out", "--model-def", str(model)))
    assert code == 2
    (line,) = error_lines(err)
    assert "typo.py line 1" in line


def test_missing_training_data_is_named(capsys, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    code, _, err = run_cli(capsys, *train_args(tmp_path, tmp_path / "out", "--training-data", str(missing)))
    assert code == 2
    (line,) = error_lines(err)
    assert "--training-data" in line and str(missing) in line and "no data there" in line, line


def test_inspecting_a_path_with_nothing_there_says_so_and_prints_no_table(capsys, tmp_path: Path) -> None:
    (tmp_path / "one-file").write_bytes(b"not a dataset folder")
    for url in (tmp_path / "nowhere", tmp_path / "one-file"):
        code, out, err = run_cli(capsys, "data", "inspect", str(url))
        assert code == 2 and out == ""
        (line,) = error_lines(err)
        assert f"{url}: no data there" in line, line


def test_convert_csv_and_label_errors(capsys, tmp_path: Path) -> None:
    csv_file = tmp_path / "rows.csv"
    csv_file.write_text("a,b,label\n1,x,0\n2.5,y,1\n3,z,1\n")
    code, out, _ = run_cli(
        capsys, "data", "convert", "--from", str(csv_file), "--label-column", "label",
        "--output", str(tmp_path / "ds"), "--shards", "2",
    )  # fmt: skip
    assert code == 0 and "wrote 3 records" in out
    code, out, _ = run_cli(capsys, "data", "inspect", str(tmp_path / "ds"))
    assert code == 0 and "total (2 shards)" in out

    code, _, err = run_cli(
        capsys, "data", "convert", "--from", str(csv_file), "--label-column", "clicked",
        "--output", str(tmp_path / "other"),
    )  # fmt: skip
    assert code == 2
    (line,) = error_lines(err)
    assert "'clicked'" in line and "rows.csv" in line and "a, b, label" in line


def test_digits_refuses_to_mix_with_an_existing_dataset(capsys, tmp_path: Path) -> None:
    assert run_cli(capsys, "data", "digits", "--output", str(tmp_path))[0] == 0
    code, _, err = run_cli(capsys, "data", "digits", "--output", str(tmp_path))
    assert code == 2 and "--overwrite" in error_lines(err)[0]
    assert (
        run_cli(capsys, "data", "digits", "--output", str(tmp_path), "--overwrite", "--shards", "2")[0] == 0
    )
    assert sorted(p.name for p in (tmp_path / "train").glob("*/*") if ".edl-index" not in p.name) == [
        "data-00000",
        "data-00001",
    ]


def test_inspect_names_the_corrupt_shard_and_chunk(capsys, dataset: Path) -> None:
    (shard,) = (dataset / "train").glob("v-*/data-00001")
    data = bytearray(shard.read_bytes())
    data[40] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, _, err = run_cli(capsys, "data", "inspect", str(dataset / "train"))
    assert code != 0
    (line,) = error_lines(err)
    assert "data-00001" in line and "chunk 0" in line


def test_a_real_process_prints_no_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "edl_argo.cli", "data", "inspect", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(error_lines(result.stderr)) == 1


#: Runs the program's entry point with an ``atexit`` handler, as the ``edl-argo`` script does.
_ENTRY = (
    "import atexit, sys\n"
    "from edl_argo import cli\n"
    "atexit.register(lambda: print('interpreter teardown ran', flush=True))\n"
    "sys.argv = ['edl-argo', *sys.argv[1:]]\n"
    "cli.entry_point()\n"
)


@pytest.mark.parametrize("command", ["worker", "ps", "data"])
def test_a_pod_command_ends_without_the_interpreter_teardown(command: str, tmp_path: Path) -> None:
    """Pod commands skip the teardown (1.5-2 s with TensorFlow loaded) once their output is flushed; the
    others exit as any program does."""
    absent = str(tmp_path / "absent")
    pod = ["--model-def", "m.py", "--tls-dir", absent]
    flags = {
        "worker": ["worker", "--worker-id", "0", "--master-addr", "127.0.0.1:1", *pod],
        "ps": ["ps", *pod],
        "data": ["data", "inspect", absent],
    }[command]
    done = run_python(_ENTRY, *flags)
    assert done.returncode == 2, done.stderr
    assert len(error_lines(done.stderr)) == 1  # the error line was flushed before the process ended
    assert ("interpreter teardown ran" in done.stdout) is (command not in cli.POD_COMMANDS)


_POD_IMPORT = (
    "import sys\n"
    "from edl_argo.tensorflow_import import import_tensorflow\n"
    "import_tensorflow()\n"
    "loaded = [m for m in ('sklearn', 'sklearn.base', 'scipy.stats') if m in sys.modules]\n"
    "print('with tensorflow:', loaded)\n"
    "import sklearn.base\n"
    "print('then:', sklearn.base.BaseEstimator.__name__)\n"
)


def test_a_pod_imports_tensorflow_without_scikit_learn_and_its_model_file_can_still_import_it() -> None:
    """Keras loads scikit-learn (and SciPy's statistics) for wrappers no pod uses: 1.2 s of every pod's
    start-up. A pod hides it while TensorFlow loads, and a model file importing it afterwards gets it."""
    assert python_lines(_POD_IMPORT) == ["with tensorflow: []", "then: BaseEstimator"]


_COLLECTOR_DURING_IMPORT = (
    "import gc, json, sys\n"
    "from edl_argo.tensorflow_import import import_tensorflow\n"
    "if sys.argv[1] == 'off':\n"
    "    gc.disable()\n"
    "before = [generation['collections'] for generation in gc.get_stats()]\n"
    "import_tensorflow()\n"
    "after = [generation['collections'] for generation in gc.get_stats()]\n"
    "collections = [b - a for a, b in zip(before, after)]\n"
    "frozen, objects = gc.get_freeze_count(), len(gc.get_objects())\n"
    "print(json.dumps({'collections': collections, 'frozen': frozen, 'objects': objects,\n"
    "                  'enabled': gc.isenabled()}))\n"
)


@pytest.mark.parametrize("collector", ["on", "off"])
def test_tensorflows_import_runs_no_collection_and_leaves_its_objects_out_of_later_ones(
    collector: str,
) -> None:
    """TensorFlow's import makes about 450,000 objects that live as long as the process. Python's cyclic
    collector ran 600-660 times during the import (0.4-0.5 s of its 2.2-2.3 s here), and every later full
    collection walked them again. The import runs with the collector paused and leaves what
    it made in the permanent generation (``gc.freeze``); the collector is then as the caller had it."""
    seen = json.loads(python_lines(_COLLECTOR_DURING_IMPORT, collector)[-1])
    assert seen["collections"] == [0, 0, 0]
    assert seen["frozen"] > 100_000 and seen["objects"] < seen["frozen"] / 10, seen
    assert seen["enabled"] is (collector == "on")


def test_the_master_loads_its_model_file_without_scikit_learn(digits_data: Path, tmp_path: Path) -> None:
    """The master imports TensorFlow through the model file while its pods start: it too spares the 1.2 s
    of scikit-learn (measured by ``python -m tests.bench.pod_start``)."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from edl_argo.master.job_parts import load_job_parts\n"
        "from tests.engine_helpers import digits_config\n"
        f"load_job_parts(digits_config(Path({str(digits_data)!r}), Path({str(tmp_path / 'out')!r})))\n"
        "print([m for m in ('tensorflow', 'sklearn', 'scipy.stats') if m in sys.modules])\n"
    )
    assert python_lines(code)[-1] == "['tensorflow']"


@pytest.mark.parametrize("command", ["evaluate", "predict"])
def test_evaluate_and_predict_load_their_model_file_without_scikit_learn(
    command: str, tmp_path: Path
) -> None:
    """An evaluate or predict step imports TensorFlow as a pod does (:func:`import_tensorflow`): without
    scikit-learn, and with the collector paused (frozen objects are the sign)."""
    flags = [command, "--model-def", DIGITS_MODEL, "--model", str(tmp_path), "--data", str(tmp_path)]
    flags += ["--output", str(tmp_path / "out")]
    code = (
        "import gc, sys\n"
        "from edl_argo import cli\n"
        "from edl_argo.inference import load_step_model\n"
        f"load_step_model(cli.build_parser([{command!r}]).parse_args({flags!r}))\n"
        "print([m for m in ('tensorflow', 'sklearn', 'scipy.stats') if m in sys.modules], "
        "gc.get_freeze_count() > 100_000)\n"
    )
    assert python_lines(code)[-1] == "['tensorflow'] True"


def test_train_starts_a_local_jobs_pod_template_before_importing_the_masters_modules(tmp_path: Path) -> None:
    """The template's import of TensorFlow is the longest wait before a local job's first step: ``edl-argo
    train`` starts it right after parsing its command line, and imports the master's own modules (0.2-0.25
    s) while it runs."""
    argv = ["train", "--model-def", DIGITS_MODEL, "--training-data", str(tmp_path), "--output", str(tmp_path)]
    code = (
        "import sys\n"
        "from edl_argo import cli\n"
        "import edl_argo.master.command as command\n"
        "class Started(Exception):\n"
        "    pass\n"
        "def started(config):\n"
        "    print('master modules imported:', 'edl_argo.master.job' in sys.modules, config.backend)\n"
        "    raise Started\n"
        "command.early_pod_template = started\n"
        "try:\n"
        f"    cli.main({argv!r})\n"
        "except Started:\n"
        "    pass\n"
    )
    assert python_lines(code) == ["master modules imported: False local"]
