"""edl-argo: elastic, fault-tolerant TensorFlow training as an Argo Workflows step."""

#: The version of edl-argo, declared here only: the package metadata (pyproject.toml reads it), the default
#: image tag of the templates and of ``edl_argo.hera`` (``edl-argo:<version>``), ``make image`` and the
#: docs take it from here.
__version__ = "0.2.0"
