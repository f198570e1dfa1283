"""Pipelines of edl-argo steps: run one here (no cluster), render its YAML, or submit it to an Argo Server."""
