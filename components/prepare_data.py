"""Prepare datasets for edl-argo with `edl-argo data`: the digits example dataset (RecordIO shards, or
TFRecord, CSV, Parquet or PNG files), the CTR example dataset, a CSV file converted to shards, or a
generated census table in a database (for the SQLFlow example). Entrypoints: prepare-digits,
prepare-ctr, convert-csv, prepare-census."""

from edl_argo.hera import CONVERT_CSV, PREPARE_CENSUS, PREPARE_CTR, PREPARE_DIGITS, workflow_template

MANIFESTS = [workflow_template(PREPARE_DIGITS, PREPARE_CTR, CONVERT_CSV, PREPARE_CENSUS, description=__doc__)]
