"""prepare-data: ``edl-argo data ...`` writes a dataset of RecordIO shards to object storage.

Four steps share the WorkflowTemplate ``edl-argo-prepare-data``: :func:`prepare_digits` and
:func:`prepare_ctr` generate the example datasets (``prepare_digits`` in any file format: ``format``),
:func:`convert_csv` converts a CSV file (an input artifact) into shards, and :func:`prepare_census` writes
a generated census table into a database (for the SQLFlow example). A dataset written to ``URL`` has
``URL/train`` and ``URL/test`` (digits, ctr) or its shards right under ``URL`` (convert). Datasets are
URLs, not artifacts, because the training job's worker pods read them directly; every step passes
``--overwrite``, so a retried or re-run step replaces the dataset (or table) it wrote before.
"""

from __future__ import annotations

from typing import Annotated

from hera.workflows import Artifact

from edl_argo.data.file_writers import DIGITS_FORMATS
from edl_argo.hera.container import (
    DB_SECRET,
    IMAGE,
    STORAGE_SECRET,
    Database,
    DbSecret,
    Image,
    StorageSecret,
    step_container,
)
from edl_argo.hera.inputs import Float, Input, Int, Text
from edl_argo.hera.step import Step, StepTask

WORKFLOW_TEMPLATE = "edl-argo-prepare-data"
#: Where :func:`convert_csv`'s input artifact lands in its container.
CSV_PATH = "/tmp/input.csv"

Output = Annotated[Text, Input("where the dataset goes: s3://bucket/prefix (or a folder)")]
Shards = Annotated[Int, Input("shards per split")]
Seed = Annotated[Int, Input("random seed")]


def prepare_digits(
    name: str = "prepare-digits",
    *,
    output: Output,
    shards: Shards = 4,
    test_fraction: Annotated[Float, Input("share of the records that go to test/")] = 0.2,
    seed: Seed = 0,
    format: Annotated[
        Text,
        Input(
            "file format: recordio (shards and a manifest), tfrecord, csv, parquet or images (PNG files in"
            " class folders)",
            enum=DIGITS_FORMATS,
        ),
    ] = "recordio",
    image: Image = IMAGE,
    storage_secret: StorageSecret = STORAGE_SECRET,
    template_ref: bool = False,
) -> StepTask:
    """Add a step writing scikit-learn's 8x8 digits to ``output``/train and ``output``/test, in ``format``.

    ``template_ref``: reference the installed WorkflowTemplate instead of embedding the template.
    """
    return PREPARE_DIGITS.task(name, locals(), template_ref)


def prepare_ctr(
    name: str = "prepare-ctr",
    *,
    output: Output,
    records: Annotated[Int, Input("training records (test/ gets a fifth as many)")] = 20_000,
    vocabulary: Annotated[Int, Input("ids per categorical feature")] = 100_000,
    shards: Shards = 4,
    seed: Seed = 0,
    image: Image = IMAGE,
    storage_secret: StorageSecret = STORAGE_SECRET,
    template_ref: bool = False,
) -> StepTask:
    """Add a step writing synthetic click-through data (for ``ctr.py``) to ``output``/train and /test."""
    return PREPARE_CTR.task(name, locals(), template_ref)


def convert_csv(
    name: str = "convert-csv",
    *,
    csv: Artifact,
    label_column: Annotated[Text, Input("name of the label column")],
    output: Output,
    shards: Shards = 4,
    fill_missing: Annotated[
        Text, Input("stands for every empty value (default empty: an empty value fails the step)")
    ] = "",
    image: Image = IMAGE,
    storage_secret: StorageSecret = STORAGE_SECRET,
    template_ref: bool = False,
) -> StepTask:
    """Add a step converting the CSV file ``csv`` (an artifact, with a header row) to shards at ``output``."""
    return CONVERT_CSV.task(name, locals(), template_ref)


def prepare_census(
    name: str = "prepare-census",
    *,
    db: Database,
    table: Annotated[Text, Input("the table to write (replaced if it exists)")],
    rows: Annotated[Int, Input("rows to generate")] = 2000,
    seed: Seed = 11,
    db_secret: DbSecret = DB_SECRET,
    image: Image = IMAGE,
    template_ref: bool = False,
) -> StepTask:
    """Add a step writing a generated census table (age, workclass, education, hours_per_week and an
    income label that depends on them) into the database ``db``: ``edl-argo data census``."""
    return PREPARE_CENSUS.task(name, locals(), template_ref)


PREPARE_DIGITS = Step(
    "prepare-digits",
    WORKFLOW_TEMPLATE,
    prepare_digits,
    lambda inputs: step_container("prepare-digits", inputs, ["data", "digits", "--overwrite"]),
)
PREPARE_CTR = Step(
    "prepare-ctr",
    WORKFLOW_TEMPLATE,
    prepare_ctr,
    lambda inputs: step_container("prepare-ctr", inputs, ["data", "ctr", "--overwrite"]),
)
CONVERT_CSV = Step(
    "convert-csv",
    WORKFLOW_TEMPLATE,
    convert_csv,
    lambda inputs: step_container(
        "convert-csv",
        inputs,
        ["data", "convert", "--from", CSV_PATH, "--overwrite"],
        artifacts=[Artifact(name="csv", path=CSV_PATH)],
    ),
)
PREPARE_CENSUS = Step(
    "prepare-census",
    WORKFLOW_TEMPLATE,
    prepare_census,
    lambda inputs: step_container("prepare-census", inputs, ["data", "census", "--overwrite"]),
)
