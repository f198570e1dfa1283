"""Names a model file uses (the ``mode`` passed to ``feed``, the prediction-outputs base class), and the
flags that say where a model definition's functions are (:class:`ModelOptions`)."""

from __future__ import annotations

import abc
import argparse
import ast
import dataclasses
from typing import Any

from edl_argo.errors import ConfigError
from edl_argo.settings import add_model_settings, table
from edl_argo.settings.schema import settings_dataclass


class Mode:
    """The ``mode`` argument of ``feed``: what the records are being read for."""

    TRAINING = "training"
    EVALUATION = "evaluation"
    PREDICTION = "prediction"


class BasePredictionOutputsProcessor(abc.ABC):
    """Receives the model's outputs for each prediction task a worker runs.

    A model file may define a subclass named ``PredictionOutputsProcessor``; without one, predictions are
    written to the job's output location.
    """

    @abc.abstractmethod
    def process(self, predictions: Any, worker_id: int) -> None:
        """Handle the outputs of one batch (a numpy array, or a dict of them for multi-output models)."""


#: The input function's names, in the order a model file is searched for them: ElasticDL's model zoo at
#: HEAD calls it ``feed``; files written before its rename (#2320) call it ``dataset_fn``.
INPUT_FUNCTION_NAMES = ("feed", "dataset_fn")


class _ModelOptionsDoc:
    """Where a model definition's functions are found: ElasticDL's model flags other than ``--model-def``.

    ``model_zoo``: a folder; ``--model-def`` is then ``module.path.function`` inside it (ElasticDL's
    ``--model_zoo DIR --model_def mnist.mnist_functional_api.custom_model`` reads
    ``DIR/mnist/mnist_functional_api.py``). ``model_params``: ``"k=v;..."`` passed as keyword arguments to
    the model function, each value a Python literal (else the text itself), as ElasticDL parses them.
    The other fields rename a contract function (``""`` for ``feed``: ``feed``, else ``dataset_fn``); a
    dotted name ``module.function`` is looked up in ``module`` of the model zoo (or on ``sys.path``).
    """


#: One field per setting of section ``model`` (:mod:`edl_argo.settings.table`), default from there.
ModelOptions = settings_dataclass(
    "ModelOptions", table.SETTINGS, "model", base=_ModelOptionsDoc, module=__name__
)


def add_model_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--model-def`` and ElasticDL's flags that say where its functions are (see :class:`ModelOptions`)."""
    add_model_settings(parser)


def model_options_from_args(args: argparse.Namespace) -> ModelOptions:
    """The :class:`ModelOptions` of parsed :func:`add_model_flags`."""
    return ModelOptions(**{item.name: getattr(args, item.name) for item in dataclasses.fields(ModelOptions)})


def parse_model_params(text: str) -> dict[str, Any]:
    """``"k=v;..."`` as keyword arguments, each value a Python literal or else the text itself (as
    ElasticDL's ``get_dict_from_params_str``, without ``eval``); :class:`ConfigError` names a bad item."""
    params: dict[str, Any] = {}
    for item in text.split(";"):
        if not item.strip():
            continue
        key, equals, value = item.strip().partition("=")
        key = key.strip()
        if not equals or not key.isidentifier():
            raise ConfigError(f"--model-params {text!r}: {item.strip()!r} is not name=value")
        try:
            params[key] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            params[key] = value.strip()
    return params
