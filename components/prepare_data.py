"""Prepare datasets for edl-argo: write RecordIO shards to object storage with `edl-argo data` (the
digits and CTR example datasets, or a CSV file converted). Entrypoints: prepare-digits, prepare-ctr,
convert-csv."""

from edl_argo.hera import CONVERT_CSV, PREPARE_CTR, PREPARE_DIGITS, workflow_template

MANIFESTS = [workflow_template(PREPARE_DIGITS, PREPARE_CTR, CONVERT_CSV, description=__doc__)]
