"""Field numbers of the parameter-server messages that :mod:`edl_argo.rpc.wire` encodes or splits by hand.

The PS encodes its answers and a worker its pushes piece by piece, and each reads the other's tensor fields
as views of the received bytes; both sides take the numbers from here, and these from ``ps.proto``.
"""

from __future__ import annotations

from edl_argo.proto import ps_pb2

#: ``PullDenseParametersResponse.dense_parameters``: the dense parameters of a pull's answer.
ANSWER_PARAMETERS = ps_pb2.PullDenseParametersResponse.DESCRIPTOR.fields_by_name["dense_parameters"].number
#: ``PullDenseParametersResponse.packed_parameters``: the small dense parameters of a pull's answer, packed.
ANSWER_PACKED = ps_pb2.PullDenseParametersResponse.DESCRIPTOR.fields_by_name["packed_parameters"].number
#: ``PushGradientsResponse.parameters``: the pull answer a push's reply carries.
REPLY_PARAMETERS = ps_pb2.PushGradientsResponse.DESCRIPTOR.fields_by_name["parameters"].number
#: ``PushGradientsRequest.gradients``: the ``Model`` a push carries.
PUSH_GRADIENTS = ps_pb2.PushGradientsRequest.DESCRIPTOR.fields_by_name["gradients"].number
#: ``Model``'s fields by name.
MODEL_FIELDS = {field.name: field.number for field in ps_pb2.Model.DESCRIPTOR.fields}
#: The service of the streaming twins of the calls whose messages scale with the model
#: (:mod:`edl_argo.rpc.chunked`).
CHUNKED_SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServerChunks"].full_name
#: The methods a PS's tensor port serves (:mod:`edl_argo.rpc.tensor_port`), each by its number: its index here
#: plus one.
TENSOR_PORT_METHODS = ("PushGradients", "PullDenseParameters")
