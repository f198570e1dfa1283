"""The model-definition contract (ElasticDL's model zoo) and its loader.

A model file defines ``custom_model()``, ``feed(dataset, mode, metadata)``, ``loss(labels, predictions)``,
``optimizer()``, ``eval_metrics_fn()`` and optionally ``callbacks()`` (a
:class:`~edl_argo.model.callbacks.LearningRateScheduler`) and ``PredictionOutputsProcessor``.
A file written for ElasticDL needs only its imports changed: ``Mode`` and
``BasePredictionOutputsProcessor`` come from here.
"""

from edl_argo.model.callbacks import LearningRateScheduler
from edl_argo.model.contract import BasePredictionOutputsProcessor, Mode
from edl_argo.model.loader import ModelSpec, load_model_spec

__all__ = ["BasePredictionOutputsProcessor", "LearningRateScheduler", "Mode", "ModelSpec", "load_model_spec"]
