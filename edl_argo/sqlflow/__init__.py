"""SQLFlow statements: ``SELECT ... TO TRAIN|PREDICT|EVALUATE ...`` run as edl-argo jobs on SQL tables.

One concept per module: :mod:`~edl_argo.sqlflow.parser` (statements into dataclasses),
:mod:`~edl_argo.sqlflow.columns` (feature columns and their derivation), :mod:`~edl_argo.sqlflow.premade`
(premade models as model files of the model-zoo contract) and :mod:`~edl_argo.sqlflow.command`
(``edl-argo sql``).
"""
