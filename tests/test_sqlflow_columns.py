"""SQLFlow feature columns (edl_argo/sqlflow/columns.py) and premade models (edl_argo/sqlflow/premade.py)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from contract_training import train_in_process

from edl_argo.errors import ConfigError
from edl_argo.model import Mode, load_model_spec
from edl_argo.sqlflow import columns as fc
from edl_argo.sqlflow.parser import parse
from edl_argo.sqlflow.premade import PremadeModel, model_file_text

SCHEMA = {"age": "int64", "hours": "float64", "workclass": "string", "education": "string", "income": "int64"}
SAMPLE = {
    "age": [20, 30, 40, 50],
    "hours": [10.0, 20.0, 30.0, 40.0],
    "workclass": ["Private", "State", "Private", "Self"],
    "education": ["HS", "College", "Masters", "HS"],
    "income": [0, 1, 0, 1],
}


def columns_of(clause: str) -> fc.FeatureColumns:
    statement = parse(f"SELECT * FROM t TO TRAIN DNNClassifier {clause} LABEL income INTO m")
    return fc.build(statement.columns, SCHEMA, SAMPLE, "income")


def test_every_function_of_the_column_clause() -> None:
    columns = columns_of(
        "COLUMN age, NUMERIC(hours, 1), CATEGORY_ID(workclass, 16), CATEGORY_HASH(education, 50), "
        "BUCKET(NUMERIC(age), [25, 45]), EMBEDDING(CATEGORY_ID(workclass, 8), 4, sum), "
        "CROSS([education, CATEGORY_HASH(workclass, 10)], 100)"
    ).all
    assert columns[0] == fc.Numeric("age", 1, 35.0, pytest.approx(11.18, abs=0.01))
    assert columns[1].key == "hours" and columns[1].mean == 25.0
    assert columns[2] == fc.CategoryId("workclass", 16, ("Private", "Self", "State"))
    assert columns[3] == fc.CategoryHash("education", 50)
    assert columns[4] == fc.Bucket(fc.Numeric("age"), (25.0, 45.0))
    assert columns[5] == fc.Embedding(fc.CategoryId("workclass", 8, ("Private", "Self", "State")), 4, "sum")
    assert columns[6] == fc.Cross(("education", fc.CategoryHash("workclass", 10)), 100)


@pytest.mark.parametrize(
    ("clause", "message"),
    [
        ("COLUMN workclass", "COLUMN: column 'workclass' is text: say how to use it"),
        ("COLUMN nope", "COLUMN: no column 'nope' in the SELECT"),
        ("COLUMN ONE_HOT(age)", "COLUMN: unknown feature column ONE_HOT"),
        ("COLUMN CATEGORY_ID(age)", "COLUMN: CATEGORY_ID takes 2 arguments, not 1 at position 47"),
        ("COLUMN CATEGORY_ID(age, 0)", "COLUMN: CATEGORY_ID: the bucket count must be a positive integer"),
        (
            "COLUMN BUCKET(CATEGORY_ID(age, 3), [1])",
            "COLUMN: BUCKET: the first argument must be NUMERIC(col)",
        ),
        ("COLUMN BUCKET(NUMERIC(age), [3, 1])", "COLUMN: BUCKET: boundaries must be a list of increasing"),
        ("COLUMN EMBEDDING(age, 3)", "COLUMN: EMBEDDING: the first argument must be CATEGORY_ID"),
        ("COLUMN EMBEDDING(CATEGORY_ID(age, 3), 3, max)", "COLUMN: EMBEDDING: combiner 'max' is not one"),
        ("COLUMN CROSS([age], 10)", "COLUMN: CROSS: the first argument must be a list of at least two"),
        ("COLUMN CATEGORY_ID(workclass, 3)", "COLUMN: CATEGORY_ID(workclass, 3): the column has 3 or more"),
        ("COLUMN age, income", "COLUMN: the label 'income' cannot be a feature column too"),
    ],
)
def test_column_errors_name_the_function_and_position(clause: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        columns_of(clause)
    assert str(caught.value).startswith(message), str(caught.value)


def test_derivation_without_column_clause() -> None:
    sample = {**SAMPLE, "education": [f"e{i}" for i in range(fc.VOCABULARY_LIMIT + 1)]}
    derived = fc.build({}, SCHEMA, sample, "income").groups[""]
    assert [type(c).__name__ for c in derived] == ["Numeric", "Numeric", "Embedding", "Embedding"]
    assert derived[2].category == fc.CategoryId("workclass", 4, ("Private", "Self", "State"))
    assert derived[3].category == fc.CategoryHash("education", fc.HASH_BUCKETS)
    assert "income" not in fc.FeatureColumns({"": derived}).keys


def test_columns_round_trip_through_json() -> None:
    columns = columns_of(
        "COLUMN age, CATEGORY_ID(workclass, 16), BUCKET(NUMERIC(age), [25, 45]), "
        "EMBEDDING(CROSS([education, BUCKET(NUMERIC(age), [30])], 100), 4) FOR dnn "
        "COLUMN CATEGORY_HASH(education, 50) FOR linear"
    )
    assert fc.columns_from_json(fc.columns_to_json(columns)) == columns


def test_prepare_per_record_and_batched() -> None:
    columns = columns_of(
        "COLUMN age, CATEGORY_ID(workclass, 16), CATEGORY_HASH(education, 50), "
        "BUCKET(NUMERIC(age), [25, 45]), CROSS([education, workclass], 100), CATEGORY_ID(age, 7)"
    )
    batch = {
        "age": tf.constant([20, 50], tf.int64),
        "hours": tf.constant([1.0, 2.0], tf.float64),
        "workclass": tf.constant(["Self", "Unknown"]),
        "education": tf.constant(["HS", "Masters"]),
        "income": tf.constant([3, 4], tf.int64),
    }
    batched = fc.prepare(columns, batch)
    names = [columns.input_name(c) for c in columns.all]
    age, workclass, education, bucket, cross, modulo = (batched[n].numpy() for n in names)
    np.testing.assert_allclose(age, [[(20 - 35) / 11.18034], [(50 - 35) / 11.18034]], rtol=1e-4)
    assert workclass.tolist() == [2, 0]  # 1 + index in the vocabulary; 0 for an unknown value
    assert ((education >= 0) & (education < 50)).all() and ((cross >= 0) & (cross < 100)).all()
    assert bucket.tolist() == [0, 2] and modulo.tolist() == [6, 1]
    record = fc.prepare(columns, {key: value[1] for key, value in batch.items()})
    assert record[names[0]].shape == (1,) and record[names[1]].shape == ()
    assert [int(record[n].numpy().reshape(-1)[0]) for n in names[1:]] == [
        int(batched[n].numpy()[1]) for n in names[1:]
    ]


def census_like(rows: int, seed: int = 3) -> dict[str, np.ndarray]:
    rng = random.Random(seed)
    data: dict[str, list] = {k: [] for k in SCHEMA}
    for _ in range(rows):
        age = rng.randint(18, 80)
        work = rng.choice(["Private", "State", "Self"])
        hours = rng.uniform(10, 60)
        score = (age - 40) / 10 + (hours - 35) / 10 + (1.0 if work == "Self" else 0.0)
        data["age"].append(age)
        data["hours"].append(hours)
        data["workclass"].append(work)
        data["education"].append(rng.choice(["HS", "College", "Masters"]))
        data["income"].append(int(score + rng.gauss(0, 0.3) > 0))
    return {k: np.asarray(v, dtype=object if SCHEMA[k] == "string" else SCHEMA[k]) for k, v in data.items()}


@pytest.mark.parametrize(
    ("model", "clause"),
    [
        ("DNNClassifier", ""),
        ("LinearClassifier", "COLUMN age, hours, CATEGORY_ID(workclass, 8)"),
        ("WideAndDeepClassifier", "COLUMN CATEGORY_ID(workclass, 8) FOR linear COLUMN age, hours FOR dnn"),
    ],
)
def test_a_generated_model_file_learns_through_the_contract(tmp_path: Path, model: str, clause: str) -> None:
    data = census_like(600)
    statement = parse(f"SELECT * FROM t TO TRAIN {model} {clause} LABEL income INTO m")
    sample = {k: v.tolist() for k, v in data.items()}
    columns = fc.build(statement.columns, SCHEMA, sample, "income")
    params = {"learning_rate": 0.05, **({} if model == "LinearClassifier" else {"hidden_units": [16]})}
    premade = PremadeModel(model, columns, "income", params)
    path = tmp_path / "model.py"
    path.write_text(model_file_text(premade))
    spec = load_model_spec(str(path))
    dataset = spec.feed(tf.data.Dataset.from_tensor_slices(data), Mode.TRAINING, None).batch(64)
    keras_model = train_in_process(spec, dataset, epochs=8)
    correct = []
    metric = spec.eval_metrics_fn()["accuracy"]
    for features, labels in spec.feed(tf.data.Dataset.from_tensor_slices(data), Mode.EVALUATION, None).batch(
        128
    ):
        correct.extend(metric(labels, keras_model(features)).numpy().tolist())
    assert np.mean(correct) >= 0.8
    features = next(iter(spec.feed(tf.data.Dataset.from_tensor_slices(data), Mode.PREDICTION, None).batch(5)))
    predicted = spec.module.predicted(keras_model(features).numpy())
    assert predicted.dtype == np.int64 and predicted.shape == (5,)


def test_premade_attribute_errors() -> None:
    columns = columns_of("COLUMN age")
    with pytest.raises(ConfigError, match=r"unknown attribute model\.hidden_units"):
        PremadeModel("LinearClassifier", columns, "income", {"hidden_units": [3]})
    with pytest.raises(ConfigError, match="not a premade model"):
        PremadeModel("BoostedTrees", columns, "income")
    with pytest.raises(ConfigError, match=r"model\.n_classes must be an integer >= 2"):
        PremadeModel("DNNClassifier", columns, "income", {"n_classes": 1})
    with pytest.raises(ConfigError, match=r"model\.optimizer 'Lion'"):
        PremadeModel("DNNClassifier", columns, "income", {"optimizer": "Lion"})
