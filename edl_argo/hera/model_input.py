"""The trained model as a step's input: the ``model`` artifact of :func:`~edl_argo.hera.elastic_train`.

It lands at :data:`MODEL_PATH` in the container, where ``edl-argo evaluate|predict --model`` reads it.
"""

from __future__ import annotations

from typing import Annotated

from hera.workflows import Artifact

from edl_argo.hera.inputs import Input, Int, Text
from edl_argo.hera.setting_inputs import setting_input
from edl_argo.settings import table

#: Where the ``model`` input artifact lands in the container.
MODEL_PATH = "/tmp/model"
#: The ``model`` input artifact of evaluate and predict.
MODEL_ARTIFACT = Artifact(name="model", path=MODEL_PATH)

#: The ``data`` argument of evaluate and predict.
Data = Annotated[
    Text, Input("URL of the data to read, in the forms --training-data takes (s3://bucket/prefix, db#table)")
]
#: The ``data_format`` and ``data_options`` arguments of evaluate and predict: the train settings of the
#: same names (:mod:`edl_argo.settings.table`), so the steps read ``data`` as the training step does.
DataFormat, DataOptions = (setting_input(s) for s in table.SETTINGS if s.group == table.DATA)
#: The ``minibatch_size`` argument of evaluate and predict.
MinibatchSize = Annotated[Int, Input("records per model call")]
