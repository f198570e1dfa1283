"""Load and check a model definition named by ``--model-def``.

Accepted forms: ``path/to/file.py`` (function ``custom_model``), ``path/to/file.py:factory_name``, a
dotted ``package.module.factory_name`` importable from ``sys.path``, or a model in storage
(``s3://bucket/models/file.py[:factory_name]``, see :mod:`edl_argo.model.source`). Every required
function is checked at load time so that a missing or misspelt name fails before any worker or PS starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from edl_argo.errors import ConfigError

REQUIRED_FUNCTIONS = ("feed", "loss", "optimizer", "eval_metrics_fn")


@dataclass(frozen=True)
class ModelSpec:
    """The functions of one model definition, checked to exist and be callable."""

    source: str
    module: ModuleType
    custom_model: Callable[[], Any]
    feed: Callable[..., Any]
    loss: Callable[..., Any]
    optimizer: Callable[[], Any]
    eval_metrics_fn: Callable[[], dict[str, Any]]
    callbacks: Callable[[], list[Any]] | None
    prediction_outputs_processor: type | None


def load_model_spec(model_def: str) -> ModelSpec:
    """Import the model definition and check the contract; :class:`ConfigError` names what is wrong."""
    from edl_argo.model.source import local_model_def

    module, factory_name = _import(local_model_def(model_def))
    missing = [n for n in (factory_name, *REQUIRED_FUNCTIONS) if not callable(getattr(module, n, None))]
    if missing:
        raise ConfigError(
            f"model definition {model_def} lacks {', '.join(repr(n) for n in missing)}; it must define "
            f"{factory_name}(), feed(dataset, mode, metadata), loss(labels, predictions), optimizer() "
            "and eval_metrics_fn()"
        )
    callbacks = getattr(module, "callbacks", None)
    processor = getattr(module, "PredictionOutputsProcessor", None)
    if processor is not None and not isinstance(processor, type):
        raise ConfigError(f"model definition {model_def}: PredictionOutputsProcessor must be a class")
    return ModelSpec(
        source=model_def,
        module=module,
        custom_model=getattr(module, factory_name),
        feed=module.feed,
        loss=module.loss,
        optimizer=module.optimizer,
        eval_metrics_fn=module.eval_metrics_fn,
        callbacks=callbacks if callable(callbacks) else None,
        prediction_outputs_processor=processor,
    )


def _import(model_def: str) -> tuple[ModuleType, str]:
    path_part, _, factory = model_def.partition(":")
    if path_part.endswith(".py") or "/" in path_part:
        return _import_file(Path(path_part), model_def), factory or "custom_model"
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


def _import_file(path: Path, model_def: str) -> ModuleType:
    if not path.is_file():
        raise ConfigError(f"--model-def {model_def}: no such file {path}")
    name = f"edl_argo_model_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"--model-def {model_def}: {path} is not a Python file")
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
