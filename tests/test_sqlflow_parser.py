"""SQLFlow statements into dataclasses (edl_argo/sqlflow/parser.py): every clause and its errors."""

from __future__ import annotations

import pytest

from edl_argo.sqlflow.parser import (
    Call,
    EvaluateStatement,
    Name,
    PredictStatement,
    SqlFlowSyntaxError,
    TrainStatement,
    parse,
)

TRAIN = (
    "SELECT * FROM census_train TO TRAIN DNNClassifier WITH model.hidden_units=[64,32], train.epoch=2 "
    "COLUMN age, NUMERIC(hours), CATEGORY_ID(workclass, 16) LABEL income INTO census_model;"
)


def names(exprs) -> list:
    """Column expressions without positions, for comparison."""
    out = []
    for expr in exprs:
        if isinstance(expr, Name):
            out.append(expr.name)
        elif isinstance(expr, Call):
            out.append((expr.function, names(expr.args)))
        elif isinstance(expr, list):
            out.append(names(expr))
        else:
            out.append(expr)
    return out


def test_train_statement_of_the_census_example() -> None:
    statement = parse(TRAIN)
    assert isinstance(statement, TrainStatement)
    assert statement.select == "SELECT * FROM census_train"
    assert statement.model == "DNNClassifier"
    assert statement.attrs == {"model.hidden_units": [64, 32], "train.epoch": 2}
    assert names(statement.columns[""]) == ["age", ("NUMERIC", ["hours"]), ("CATEGORY_ID", ["workclass", 16])]
    assert statement.label == "income" and statement.into == "census_model"
    assert statement.columns[""][1].position == TRAIN.index("NUMERIC") + 1


def test_train_without_with_and_column_and_with_quoted_label_and_lowercase_keywords() -> None:
    statement = parse('select a, b from t where a > 1 to train DNNRegressor label "label" into db.m')
    assert statement == TrainStatement(
        "select a, b from t where a > 1", "DNNRegressor", {}, {}, "label", "db.m"
    )


def test_attribute_values_are_python_like_literals() -> None:
    statement = parse(
        "SELECT * FROM t TO TRAIN LinearClassifier WITH model.n_classes = 3, model.learning_rate=1e-3, "
        "model.optimizer='Adagrad', validation.select=\"SELECT * FROM v WHERE x = 'a'\", "
        "predict.overwrite=true, model.nested=[[1, 2.5], [-3]], model.word=mean INTO m"
    )
    assert statement.attrs == {
        "model.n_classes": 3,
        "model.learning_rate": 1e-3,
        "model.optimizer": "Adagrad",
        "validation.select": "SELECT * FROM v WHERE x = 'a'",
        "predict.overwrite": True,
        "model.nested": [[1, 2.5], [-3]],
        "model.word": "mean",
    }


def test_column_groups_for_wide_and_deep_and_nested_feature_columns() -> None:
    statement = parse(
        "SELECT * FROM t TO TRAIN WideAndDeepClassifier "
        "COLUMN CROSS([education, workclass], 100), CATEGORY_HASH(occupation, 50) FOR linear "
        "COLUMN EMBEDDING(CATEGORY_ID(workclass, 16), 8, 'mean'), BUCKET(NUMERIC(age), [18, 30, 60]) FOR dnn "
        "LABEL income INTO m"
    )
    assert names(statement.columns["linear"]) == [
        ("CROSS", [["education", "workclass"], 100]),
        ("CATEGORY_HASH", ["occupation", 50]),
    ]
    assert names(statement.columns["dnn"]) == [
        ("EMBEDDING", [("CATEGORY_ID", ["workclass", 16]), 8, "mean"]),
        ("BUCKET", [("NUMERIC", ["age"]), [18, 30, 60]]),
    ]


def test_a_select_with_to_inside_strings_parentheses_and_comments() -> None:
    select = "SELECT 'to train x' AS s, (SELECT 1) AS one -- to train y\nFROM t WHERE name <> 'TO PREDICT'"
    statement = parse(select + " TO PREDICT out.pred USING m")
    assert statement == PredictStatement(select, "out", "pred", {}, "m")


def test_predict_statement() -> None:
    statement = parse(
        "SELECT * FROM census_test TO PREDICT db.census_pred.income WITH predict.overwrite=true "
        "USING census_model"
    )
    assert statement == PredictStatement(
        "SELECT * FROM census_test", "db.census_pred", "income", {"predict.overwrite": True}, "census_model"
    )


def test_evaluate_statement() -> None:
    statement = parse(
        'SELECT * FROM census_test TO EVALUATE census_model WITH validation.metrics="Accuracy" LABEL income '
        "INTO census_eval;"
    )
    assert statement == EvaluateStatement(
        "SELECT * FROM census_test",
        "census_model",
        {"validation.metrics": "Accuracy"},
        "income",
        "census_eval",
    )


@pytest.mark.parametrize(
    ("statement", "message"),
    [
        (
            TRAIN.replace(" INTO census_model", ""),
            "TO TRAIN: expected INTO <name> at position {} (found ';')",
        ),
        (
            "SELECT * FROM t TO TRAIN WITH x=1 INTO m",
            "TO TRAIN: expected a model name (e.g. DNNClassifier) at position {}",
        ),
        ("SELECT * FROM t TO TRAIN M WITH a=1,, INTO m", "TO TRAIN: expected an attribute name"),
        ("SELECT * FROM t TO TRAIN M WITH a 1 INTO m", "TO TRAIN: expected '=' after a at position {}"),
        ("SELECT * FROM t TO TRAIN M WITH a=[1, 2 INTO m", "TO TRAIN: expected ',' or ']' at position {}"),
        ("SELECT * FROM t TO TRAIN M WITH a=1, a=2 INTO m", "TO TRAIN: attribute a given twice at position"),
        ("SELECT * FROM t TO TRAIN M COLUMN NUMERIC(a INTO m", "COLUMN: expected ',' or ')' at position {}"),
        ("SELECT * FROM t TO TRAIN M COLUMN , a INTO m", "COLUMN: expected a column name or a feature"),
        ("SELECT * FROM t TO TRAIN M LABEL INTO", "TO TRAIN: expected INTO <name> at position {}"),
        ("SELECT * FROM t TO TRAIN M INTO m extra", "TO TRAIN: expected the end of the statement"),
        (
            "SELECT * FROM t TO TRAIN M COLUMN a COLUMN b INTO m",
            "COLUMN: expected a COLUMN clause for a group",
        ),
        ("SELECT * FROM t TO PREDICT pred USING m", "TO PREDICT: expected <table>.<column> at position {}"),
        ("SELECT * FROM t TO PREDICT p.c WITH x=1", "TO PREDICT: expected USING <model name> at position"),
        ("SELECT * FROM t TO EVALUATE m LABEL y", "TO EVALUATE: expected INTO <table> at position {}"),
        ("SELECT * FROM t TO EVALUATE m INTO e ?", "TO EVALUATE: unexpected character '?' at position {}"),
        ("SELECT * FROM t", "statement: expected TO TRAIN, TO PREDICT or TO EVALUATE after the SELECT"),
        ("SELECT * FROM t WHERE TO TRAIN M INTO m", "SELECT: "),
        ("UPDATE t SET a = 1 TO TRAIN M INTO m", "SELECT: the statement must start with one SELECT query"),
        ("SELECT 'open TO TRAIN M INTO m", "SELECT: unterminated quote ' at position 8"),
    ],
)
def test_syntax_errors_name_the_clause_and_position(statement: str, message: str) -> None:
    with pytest.raises(SqlFlowSyntaxError) as caught:
        parse(statement)
    text = str(caught.value)
    if "{}" in message:  # the position is where the expected token was missing
        head = message.split("{}")[0]
        assert text.startswith(head), text
        position = int(text[len(head) :].split()[0])
        assert 1 <= position <= len(statement) + 1
        if "found" in message:
            assert statement[position - 1] == ";"
    else:
        assert text.startswith(message), text
    assert "\n" not in text
