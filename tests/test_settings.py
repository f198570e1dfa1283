"""The settings table (edl_argo/settings/table.py) and every path generated from it agree.

Each setting must appear, with its one default, in each place it should: the flags of the roles that take
it, the configuration that holds it, the command lines the master gives its pods (round trip: what the
master sends, the pod parses back), the Hera ``elastic_train`` step's inputs and the rendered template
(round trip: the template's defaults, filled in as Argo would, parse back to the step's defaults).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from hera.workflows import DAG, Workflow

from edl_argo import cli
from edl_argo.hera import ELASTIC_TRAIN, elastic_train
from edl_argo.hera.inputs import argument_text
from edl_argo.master.config import TrainConfig, config_from_args
from edl_argo.master.pod_commands import ps_command, worker_command
from edl_argo.model.contract import ModelOptions
from edl_argo.pipeline.variables import substitute
from edl_argo.settings import Setting, parse_bool, settings_of, table
from edl_argo.settings.schema import ROLES, Argo
from tests.argo_steps import argo_pod, training_tasks

ROOT = Path(__file__).resolve().parents[1]
#: The train settings the elastic-train step does not expose: those it sets itself (the workflow's
#: namespace), a dry run, and --custom-data-reader (a model file's custom_data_reader is used without it).
NOT_ON_THE_STEP = {
    "--backend",
    "--output",
    "--metrics-output",
    "--master-port",
    "--metrics-port",
    "--namespace",
}
NOT_ON_THE_STEP |= {"--yaml", "--custom-data-reader"}
#: A local job's TLS folder: the step's master names a Secret (tls-secret) instead.
NOT_ON_THE_STEP |= {"--tls-dir"}
STEP_REQUIRED = {
    "model-def": "/opt/edl-argo/examples/model_zoo/digits.py",
    "training-data": "s3://data/train",
}
WORKFLOW = {"workflow.name": "wf-1", "workflow.uid": "u-1", "node.name": "wf-1.elastic-train"}


def parser_actions(role: str) -> dict[str, Any]:
    """dest -> the argparse action of ``edl-argo ROLE`` that sets it (the positive one of a boolean)."""
    parser = cli.build_parser([role])
    command = next(a for a in parser._actions if a.dest == "command").choices[role]
    actions: dict[str, Any] = {}
    for action in command._actions:
        if action.dest != "help" and not any(o.startswith("--no-") for o in action.option_strings):
            actions[action.dest] = action
    return actions


def parse(role: str, argv: list[str]) -> Any:
    return cli.build_parser([role]).parse_args([role, *argv])


def sample(setting: Setting) -> Any:
    """A value of ``setting`` other than its default."""
    if setting.type is bool:
        return True
    if setting.choices:
        return next(c for c in reversed(setting.choices) if c != setting.default)
    if setting.repeated:
        return ("a", "b")
    if setting.type is int:
        return int(setting.default) + 3
    return f"x-{setting.name}"


def typed(setting: Setting, text: str) -> Any:
    """What ``edl-argo train`` makes of the Argo text ``text`` for ``setting``."""
    if setting.type is bool:
        return parse_bool(text)
    if setting.repeated:
        return [part for part in text.split(";") if part]
    return setting.type(text)


def sample_config(strategy: str) -> Any:
    job = {
        s.dest: sample(s)
        for s in table.SETTINGS
        if "train" in s.roles and s.section == "job" and not s.required
    }
    model = {s.dest: sample(s) for s in table.SETTINGS if s.section == "model"}
    job.update(distribution_strategy=strategy, checkpoint_steps=5)
    return TrainConfig(
        model_def="m.py", training_data="d", output="out", model_options=ModelOptions(**model), **job
    )


def test_each_role_takes_exactly_its_settings_with_their_defaults() -> None:
    for role in ROLES:
        actions = parser_actions(role)
        expected = settings_of(table.SETTINGS, role)
        assert sorted(actions) == sorted(s.dest for s in expected), role
        for setting in expected:
            action = actions[setting.dest]
            assert set(setting.spellings()) <= set(action.option_strings), (role, setting.flag)
            assert action.required == (role in setting.required), (role, setting.flag)
            if not action.required:
                default = list(setting.default) if setting.repeated else setting.default
                assert action.default == default, (role, setting.flag)


def test_the_configurations_hold_every_train_setting_with_its_default() -> None:
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    options = {f.name: f for f in dataclasses.fields(ModelOptions)}
    for setting in settings_of(table.SETTINGS, "train"):
        where = {"job": fields, "model": options}.get(setting.section)
        if where is None:
            assert setting.dest not in fields and setting.dest not in options, setting.flag
            continue
        field = where[setting.dest]
        if "train" not in setting.required:
            assert field.default == (tuple(setting.default) if setting.repeated else setting.default)


@pytest.mark.parametrize("strategy", table.STRATEGIES)
def test_what_the_master_gives_its_pods_they_parse_back(strategy: str) -> None:
    config = sample_config(strategy)
    allreduce = strategy == table.ALLREDUCE
    given = {
        "ps": ps_command(config, 1, port=2300, master_address="m:1", model_def="staged.py", tensor_port=2400),
        "worker": worker_command(
            config,
            4,
            master_address="m:1",
            model_def="staged.py",
            ps_addresses="p:1,p:2",
            collective_port=2230,
            training_data_spec='{"format":"csv"}',
        ),
    }
    own = {
        "ps": {
            "ps_id": 1,
            "port": 2300,
            "tensor_port": 2400,
            "master_addr": "m:1",
            "host": "",
            "checkpoint_dir": config.checkpoints_url,
            "max_workers": config.worker_limit,  # the job's resolved limit, not its flag
        },
        "worker": {
            "worker_id": 4,
            "master_addr": "m:1",
            "ps_addrs": "" if allreduce else "p:1,p:2",
            "collective_port": 2230 if allreduce else 0,
            "training_data_spec": '{"format":"csv"}',
            "prediction_output": "",
            "checkpoint_dir": config.checkpoints_url if allreduce else "",
            "checkpoint_steps": 5 if allreduce else 0,
        },
    }
    for role, command in given.items():
        assert command[:2] == ["edl-argo", role]
        args = parse(role, command[2:])
        for setting in settings_of(table.SETTINGS, role):
            if setting.dest in own[role]:
                expected = own[role][setting.dest]
            elif setting.dest == "model_def":
                expected = "staged.py"
            elif setting.section == "model":
                expected = getattr(config.model_options, setting.dest)
            elif setting.section == "command":
                expected = setting.default  # read by train alone
            else:
                expected = getattr(config, setting.dest)
            assert getattr(args, setting.dest) == expected, (role, setting.flag)
            if setting.section == "job" and not setting.from_master and setting.dest not in own[role]:
                # the sample differs from the default, so the flag was really sent
                assert expected != setting.default or setting.dest == "distribution_strategy", setting.flag


def test_every_train_setting_but_the_steps_own_is_an_input_of_the_elastic_train_step() -> None:
    train = {s.flag for s in settings_of(table.SETTINGS, "train")}
    exposed = {s.flag for s in table.SETTINGS if s.argo is not None}
    assert exposed <= train
    assert train - exposed == NOT_ON_THE_STEP
    inputs = ELASTIC_TRAIN.inputs
    for setting in table.SETTINGS:
        if setting.argo is None:
            assert setting.name not in inputs, setting.flag
            continue
        parameter = inputs[setting.name]
        assert parameter.flag, setting.flag
        assert parameter.argument == setting.dest
        default = None if "train" in setting.required else argument_text(setting.argo_default)
        assert parameter.default == default, setting.flag
        assert set(parameter.enum) == ({"true", "false"} if setting.type is bool else set(setting.choices))


def test_the_rendered_template_passes_every_input_and_its_defaults_parse_back() -> None:
    documents = list(yaml.safe_load_all((ROOT / "templates" / "elastic-train.yaml").read_text()))
    template = next(t for t in documents[0]["spec"]["templates"] if t["name"] == "elastic-train")
    declared = {p["name"]: p.get("default") for p in template["inputs"]["parameters"]}
    command = template["container"]["command"]
    scope = {
        **WORKFLOW,
        **{
            f"inputs.parameters.{k}": substitute(v, WORKFLOW, "test") if v is not None else STEP_REQUIRED[k]
            for k, v in declared.items()
        },
    }
    args = parse("train", substitute(command, scope, "test")[2:])
    for setting in table.SETTINGS:
        if setting.argo is None:
            assert setting.name not in declared, setting.flag
            continue
        assert declared[setting.name] == ELASTIC_TRAIN.inputs[setting.name].default, setting.flag
        i = command.index(setting.flag)
        assert command[i + 1] == f"{{{{inputs.parameters.{setting.name}}}}}", setting.flag
        if "train" not in setting.required:
            text = substitute(argument_text(setting.argo_default), WORKFLOW, "test")
            assert getattr(args, setting.dest) == typed(setting, text), setting.flag
    assert args.shuffle is True  # the step shuffles unless told not to, as it always has


def test_a_pipeline_can_ask_for_asynchronous_sgd_without_shuffling() -> None:
    with Workflow(name="async") as workflow, DAG(name="main"):
        elastic_train(
            model_def=STEP_REQUIRED["model-def"],
            training_data=STEP_REQUIRED["training-data"],
            use_async=True,
            lr_staleness_modulation=True,
            shuffle=False,
            toleration=["gpu:NoSchedule", "pool=ml:NoExecute"],
            seed=7,
        )
    manifest = workflow.to_dict()
    task = next(t for t in manifest["spec"]["templates"] if "dag" in t)["dag"]["tasks"][0]
    given = {p["name"]: p["value"] for p in task["arguments"]["parameters"]}
    assert given["use-async"] == "true" and given["shuffle"] == "false"
    ((task, template),) = training_tasks(manifest)
    args = parse("train", argo_pod(task, template, WORKFLOW)["argv"][2:])  # filled in as Argo does
    config = config_from_args(args)
    assert config.use_async and config.lr_staleness_modulation and not config.shuffle and config.seed == 7
    assert config.kubernetes is not None
    assert [t.key for t in config.kubernetes.tolerations] == ["gpu", "pool"]


def test_booleans_take_every_spelling() -> None:
    common = ["--model-def", "m.py", "--training-data", "d", "--output", "o"]
    assert parse("train", [*common, "--shuffle"]).shuffle is True
    assert parse("train", [*common, "--shuffle", "false"]).shuffle is False
    assert parse("train", [*common, "--shuffle=True"]).shuffle is True
    assert parse("train", [*common, "--shuffle", "--no-shuffle"]).shuffle is False
    assert parse("train", [*common, "--use_async", "True"]).use_async is True  # ElasticDL's spelling
    with pytest.raises(SystemExit):
        parse("train", [*common, "--shuffle", "maybe"])


def test_a_repeated_setting_takes_several_values_in_one_text_or_several_flags() -> None:
    common = ["--model-def", "m.py", "--training-data", "d", "--output", "o"]
    args = parse(
        "train", [*common, "--toleration", "a:NoSchedule;b", "--toleration", "", "--toleration", "c"]
    )
    assert args.toleration == ["a:NoSchedule", "b", "c"]


EXERCISE = textwrap.dedent(
    """
    import json, sys
    from edl_argo.settings import table
    from edl_argo.settings.schema import Argo, Setting

    # The exercise: one entry in the table, nothing else.
    knob = Setting("--exercise-knob", int, 7, "a setting added as an exercise", roles=("train", "worker"),
                   argo=Argo())
    table.SETTINGS = (*table.SETTINGS, knob)

    from edl_argo import cli
    from edl_argo.hera import ELASTIC_TRAIN, ELASTIC_TRAIN_CLEANUP, workflow_template
    from edl_argo.master.config import config_from_args
    from edl_argo.master.pod_commands import worker_command

    def parse(role, argv):
        return cli.build_parser([role]).parse_args([role, *argv])

    args = parse("train", ["--model-def", "m.py", "--training-data", "d", "--output", "o",
                           "--exercise_knob", "9"])
    config = config_from_args(args)
    command = worker_command(config, 0, master_address="m:1", model_def="m.py", ps_addresses="p:1",
                             collective_port=None)
    rendered = workflow_template(ELASTIC_TRAIN, ELASTIC_TRAIN_CLEANUP, description="x").to_dict()
    train = rendered["spec"]["templates"][0]
    json.dump({
        "config": config.exercise_knob,
        "worker_command": command[command.index("--exercise-knob"):][:2],
        "worker_parses": parse("worker", command[2:]).exercise_knob,
        "ps_has_it": "--exercise-knob" in " ".join(cli.build_parser(["ps"]).format_help()),
        "input": {p["name"]: p.get("default") for p in train["inputs"]["parameters"]}.get("exercise-knob"),
        "command": train["container"]["command"][train["container"]["command"].index("--exercise-knob") + 1],
    }, sys.stdout)
    """
)


def test_adding_a_setting_is_one_entry_in_the_table() -> None:
    """A setting added to the table alone reaches the train flags, the configuration, the worker pods'
    command lines and the worker's flags, and the Argo step's inputs and command."""
    done = subprocess.run(
        [sys.executable, "-c", EXERCISE], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {
        "config": 9,
        "worker_command": ["--exercise-knob", "9"],
        "worker_parses": 9,
        "ps_has_it": False,
        "input": "7",
        "command": "{{inputs.parameters.exercise-knob}}",
    }


def test_a_setting_is_declared_consistently() -> None:
    with pytest.raises(ValueError, match="dash-form"):
        Setting("--bad_name", int, 0, "x")
    with pytest.raises(ValueError, match="boolean"):
        Setting("--flagged", bool, True, "x", argo=Argo())
    flags = [spelling for s in table.SETTINGS for spelling in s.spellings()]
    for role in ("train", "worker", "ps"):
        names = [n for s in settings_of(table.SETTINGS, role) for n in s.spellings()]
        assert len(names) == len(set(names)), role
    assert len(set(s.flag for s in table.SETTINGS)) == len(table.SETTINGS) and flags
