"""edl-argo: elastic, fault-tolerant TensorFlow training as an Argo Workflows step."""

__version__ = "0.1.0"
