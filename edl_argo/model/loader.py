"""Load and check a model definition named by ``--model-def`` (and ElasticDL's other model flags,
:class:`~edl_argo.model.contract.ModelOptions`).

Accepted forms: ``path/to/file.py`` (function ``custom_model``), ``path/to/file.py:factory_name``, a
dotted ``package.module.factory_name`` importable from ``sys.path``, a model in storage
(``s3://bucket/models/file.py[:factory_name]``, see :mod:`edl_argo.model.source`), or with ``--model-zoo
DIR`` a dotted ``module.path.factory_name`` naming ``DIR/module/path.py`` (ElasticDL's form; ``DIR`` is put
on ``sys.path`` so the file can import its neighbours). Every required function is checked at load time,
and so is an optional one (``callbacks``, ``PredictionOutputsProcessor``) that a flag names, and
``--model-params`` against the factory's signature, so that a missing or misspelt name fails before any
worker or PS starts. A model file's ElasticDL data reader (``custom_data_reader``, or the function
``--custom-data-reader`` names) is found here too (:attr:`ModelSpec.custom_data_reader`); the job's data
is then read by it (:mod:`edl_argo.readers.custom`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from edl_argo.errors import ConfigError
from edl_argo.model.callbacks import Schedule, checked_rate, learning_rate_schedule
from edl_argo.model.contract import INPUT_FUNCTION_NAMES, ModelOptions, parse_model_params
from edl_argo.model.user_code import model_function

#: The function a model file defines to read its own data (ElasticDL's default name).
DEFAULT_DATA_READER = "custom_data_reader"
#: The roles a model file may leave out (fields of :class:`ModelOptions`): looked up by their default name
#: when their flag is not given, and required, as every other function, under the name a flag gives them.
OPTIONAL_ROLES = ("callbacks", "prediction_outputs_processor")


@dataclass(frozen=True)
class ModelSpec:
    """The functions of one model definition, checked to exist and be callable; each marks what it raises
    as a model error naming ``source`` and its name (:mod:`edl_argo.model.user_code`)."""

    source: str
    module: ModuleType
    custom_model: Callable[[], Any]
    """The model function with ``--model-params`` bound."""
    feed: Callable[..., Any]
    loss: Callable[..., Any]
    optimizer: Callable[[], Any]
    eval_metrics_fn: Callable[[], dict[str, Any]]
    callbacks: Callable[[], list[Any]] | None
    prediction_outputs_processor: type | None
    learning_rate_schedule: Schedule | None = None
    custom_data_reader: str = ""
    """The name of the model's ElasticDL data reader factory (``--custom-data-reader``, else
    ``custom_data_reader`` when the file defines it); empty: the data is read by its format's reader."""
    #: The contract's roles (``custom_model``, ``feed``, ``loss``, ...) -> their names in the model file.
    names: Mapping[str, str] = field(default_factory=dict)
    """From a :class:`~edl_argo.model.callbacks.LearningRateScheduler` that ``callbacks()`` returned:
    ``schedule(model_version)`` is the learning rate of the update from that version."""

    @property
    def learning_rate_at(self) -> Callable[[int], float] | None:
        """The checked learning rate of the update from a version (:class:`ConfigError` for a rate that is
        not finite and >= 0), or None when the model has no schedule."""
        schedule = self.learning_rate_schedule
        if schedule is None:
            return None
        return functools.partial(checked_rate, schedule, source=self.source)


def load_model_spec(model_def: str, options: ModelOptions | None = None) -> ModelSpec:
    """Import the model definition and check the contract; :class:`ConfigError` names what is wrong."""
    from edl_argo.model.optimizer import model_optimizer_factory  # Keras: the model file imports it too
    from edl_argo.model.source import local_model_def

    options = options or ModelOptions()
    module, factory_name = _import(local_model_def(model_def), options.model_zoo)
    reader_name = options.custom_data_reader
    if reader_name and not callable(_lookup(module, reader_name, options)):
        raise ConfigError(
            f"--custom-data-reader {reader_name}: model definition {model_def} has no function of that name"
        )
    if not reader_name and callable(getattr(module, DEFAULT_DATA_READER, None)):
        reader_name = DEFAULT_DATA_READER
    feed_names = (options.feed,) if options.feed else INPUT_FUNCTION_NAMES
    feed_name = next((n for n in feed_names if callable(_lookup(module, n, options))), feed_names[0])
    names = {
        "custom_model": factory_name,
        "feed": feed_name,
        "loss": options.loss,
        "optimizer": options.optimizer,
        "eval_metrics_fn": options.eval_metrics_fn,
    }
    optional = {role: getattr(options, role) for role in OPTIONAL_ROLES}
    found = {role: _lookup(module, name, options) for role, name in {**names, **optional}.items()}
    defaults = ModelOptions()
    named_by_flag = {role: name for role, name in optional.items() if name != getattr(defaults, role)}
    required = {**names, **named_by_flag}
    missing = [f"{name!r} ({_flag_of(role)})" for role, name in required.items() if not callable(found[role])]
    if missing:
        raise ConfigError(
            f"model definition {model_def} lacks {', '.join(missing)}; it must define "
            f"{factory_name}(), feed(dataset, mode, metadata) (or dataset_fn), loss(labels, predictions), "
            "optimizer(), eval_metrics_fn() and what a flag names; the flags --feed, --loss, --optimizer, "
            "--eval-metrics-fn, --callbacks and --prediction-outputs-processor rename them"
        )
    callbacks, processor = found["callbacks"], found["prediction_outputs_processor"]
    if processor is not None and not isinstance(processor, type):
        raise ConfigError(
            f"model definition {model_def}: {options.prediction_outputs_processor} must be a class"
        )
    found["custom_model"] = _bind_model_params(found["custom_model"], factory_name, options.model_params)
    functions = {role: model_function(found[role], model_def, names[role]) for role in names}
    functions["optimizer"] = model_optimizer_factory(functions["optimizer"], model_def, names["optimizer"])
    schedule = learning_rate_schedule(callbacks() if callable(callbacks) else None, model_def)
    if schedule is not None:
        _check_schedulable(functions["optimizer"], model_def)
    return ModelSpec(
        source=model_def,
        module=module,
        **functions,
        callbacks=callbacks if callable(callbacks) else None,
        prediction_outputs_processor=processor,
        learning_rate_schedule=schedule,
        names=names,
        custom_data_reader=reader_name,
    )


def _flag_of(role: str) -> str:
    """The flag that names the function of ``role``: a field of :class:`ModelOptions`, or ``custom_model``."""
    return "--model-def" if role == "custom_model" else "--" + role.replace("_", "-")


def load_model_function(model_def: str, name: str, model_zoo: str = "") -> Callable[..., Any]:
    """The function ``name`` of the model definition ``model_def`` (with ``--model-zoo`` ``model_zoo``),
    found as :func:`load_model_spec` finds the contract's functions, without checking the contract:
    how a worker loads the model's custom data reader. ConfigError if it is not there."""
    from edl_argo.model.source import local_model_def

    options = ModelOptions(model_zoo=model_zoo)
    module, _ = _import(local_model_def(model_def), model_zoo)
    function = _lookup(module, name, options)
    if not callable(function):
        raise ConfigError(f"model definition {model_def} has no function {name!r}")
    return function


def _check_schedulable(optimizer: Callable[[], Any], model_def: str) -> None:
    """A learning rate by model version replaces the optimizer's float learning rate; :class:`ConfigError`
    when ``optimizer()`` has a schedule instead (``optimizer``: the checked factory of the model file)."""
    from edl_argo.model.optimizer import has_float_learning_rate

    if not has_float_learning_rate(optimizer()):
        raise ConfigError(
            f"model definition {model_def}: callbacks() sets the learning rate by model version "
            "(LearningRateScheduler), so optimizer() must have a float learning_rate, not a schedule"
        )


def _bind_model_params(factory: Callable[..., Any], name: str, model_params: str) -> Callable[[], Any]:
    """``factory`` with ``--model-params`` bound; :class:`ConfigError` if its signature does not take them."""
    params = parse_model_params(model_params)
    if not params:
        return factory
    try:
        inspect.signature(factory).bind(**params)
    except TypeError as error:
        raise ConfigError(f"--model-params {model_params!r}: {name}() does not take them: {error}") from None
    except ValueError:  # no signature to check (a builtin): the call will tell
        pass
    return functools.partial(factory, **params)


def _lookup(module: ModuleType, name: str, options: ModelOptions) -> Any:
    """The object ``name`` names (None if absent): an attribute of the model definition's module, or with
    a dot, ``attribute`` of ``module`` in the model zoo (or on ``sys.path``), as ElasticDL resolves them."""
    module_name, dot, attribute = name.rpartition(".")
    if not dot:
        return getattr(module, name, None)
    if options.model_zoo:
        path = Path(options.model_zoo, *module_name.split(".")).with_suffix(".py")
        return getattr(_import_file(path, f"model function {name}"), attribute, None)
    try:
        return getattr(importlib.import_module(module_name), attribute, None)
    except ImportError as error:
        raise ConfigError(f"model function {name}: cannot import {module_name}: {error}") from None


def check_model_file(model_def: str, model_zoo: str = "") -> None:
    """:class:`ConfigError` if ``model_def`` is a ``path/to/file.py[:function]`` that names no file: what
    :func:`load_model_spec` would say, without importing anything (a command says it before it imports
    TensorFlow)."""
    named = None if model_zoo else _named_file(model_def)
    if named is not None:
        _require_file(named[0], f"--model-def {model_def}")


def _named_file(model_def: str) -> tuple[Path, str] | None:
    """The file and function of a ``path/to/file.py[:function]`` model definition; None for a module's."""
    path_part, _, factory = model_def.partition(":")
    if path_part.endswith(".py") or "/" in path_part:
        return Path(path_part), factory or "custom_model"
    return None


def _require_file(path: Path, what: str) -> None:
    if not path.is_file():
        raise ConfigError(f"{what}: no such file {path}")


def _import(model_def: str, model_zoo: str = "") -> tuple[ModuleType, str]:
    if model_zoo:
        return _import_from_zoo(model_def, model_zoo)
    if (named := _named_file(model_def)) is not None:
        return _import_file(named[0], f"--model-def {model_def}"), named[1]
    module_name, _, factory = model_def.rpartition(".")
    if not module_name:
        raise ConfigError(
            f"--model-def {model_def!r}: use path/to/file.py, path/to/file.py:function "
            "or package.module.function"
        )
    try:
        return importlib.import_module(module_name), factory
    except ImportError as error:
        raise ConfigError(f"--model-def {model_def}: cannot import {module_name}: {error}") from None
    except Exception as error:  # the user's module raised while importing
        raise ConfigError(_describe_import_error(model_def, error)) from None


def _import_from_zoo(model_def: str, model_zoo: str) -> tuple[ModuleType, str]:
    """ElasticDL's form: ``--model-def module.path.function`` is ``function`` of ``ZOO/module/path.py``."""
    zoo = Path(model_zoo)
    if not zoo.is_dir():
        raise ConfigError(f"--model-zoo {model_zoo}: no such folder")
    module_name, dot, factory = model_def.rpartition(".")
    if not dot or not module_name or "/" in model_def or ":" in model_def:
        raise ConfigError(
            f"--model-def {model_def!r} with --model-zoo: use module.path.function (e.g. "
            "mnist.mnist_functional_api.custom_model for ZOO/mnist/mnist_functional_api.py)"
        )
    if str(zoo.resolve()) not in sys.path:
        sys.path.append(str(zoo.resolve()))  # the zoo's files import their neighbours, as in ElasticDL
    path = zoo.joinpath(*module_name.split(".")).with_suffix(".py")
    return _import_file(path, f"--model-def {model_def} in --model-zoo {model_zoo}"), factory


def _import_file(path: Path, what: str) -> ModuleType:
    """The module of the file at ``path``; ``what`` names it in messages (e.g. ``--model-def X``)."""
    _require_file(path, what)
    name = f"edl_argo_model_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{what}: {path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        del sys.modules[name]
        raise ConfigError(f"model definition {path} line {error.lineno}: {error.msg}") from None
    except Exception as error:
        del sys.modules[name]
        raise ConfigError(_describe_import_error(str(path), error)) from None
    return module


def _describe_import_error(source: str, error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    where = next((f for f in reversed(frames) if f.filename.endswith(source.split(":")[0])), None)
    line = f" line {where.lineno}" if where else ""
    return f"model definition {source}{line} raised {type(error).__name__}: {error}"
