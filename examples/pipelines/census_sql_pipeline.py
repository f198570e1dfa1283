"""The SQLFlow census pipeline: generate census tables in a database, then three SQLFlow statements, each
an ``sql`` step: TO TRAIN a DNNClassifier of income, TO PREDICT the test table's income into a new table,
TO EVALUATE the model's accuracy into another.

    edl-argo pipeline run examples/pipelines/census_sql_pipeline.py           # SQLite, under out/census
    edl-argo pipeline run examples/pipelines/census_sql_pipeline.py -p db=sqlite:////tmp/c.db -p models=m
    python examples/pipelines/census_sql_pipeline.py > census.yaml              # for `argo submit`

Workflow parameters (``-p NAME=VALUE``): ``db``, the database (a SQLAlchemy URL without password; the
default, a SQLite file under ``out/census`` of the current folder, suits only a run on this machine: in a
cluster give a database server, ``postgresql://user@host:5432/db``, and ``db-secret``, the Secret whose key
``password`` is its password); ``models``, where TO TRAIN writes the model (a folder, or ``s3://...`` in a
cluster); ``train-rows``, ``test-rows``; ``epochs``; ``image``, the edl-argo image. The tables are
``census_train`` and ``census_test`` (replaced at each run), ``census_pred`` (the test rows with the
predicted ``income``) and ``census_eval`` (the accuracy and the number of records).
"""

from hera.workflows import DAG, Parameter, Workflow

from edl_argo.hera import DB_SECRET, IMAGE, prepare_census, sql

PARAMETERS = {
    "db": "sqlite:///out/census/census.db",
    "models": "out/census/models",
    "train-rows": "2000",
    "test-rows": "500",
    "epochs": "6",
    "db-secret": DB_SECRET,
    "image": IMAGE,
}
COLUMNS = "age, NUMERIC(hours_per_week), CATEGORY_ID(workclass, 16), EMBEDDING(CATEGORY_ID(education, 8), 4)"

with (
    Workflow(
        generate_name="census-sql-",
        entrypoint="pipeline",
        arguments=[Parameter(name=name, value=value) for name, value in PARAMETERS.items()],
    ) as workflow,
    DAG(name="pipeline"),
):
    db = workflow.get_parameter("db")
    database = {
        "db": db,
        "db_secret": workflow.get_parameter("db-secret"),
        "image": workflow.get_parameter("image"),
    }
    statements = {**database, "models": workflow.get_parameter("models")}
    train_table = prepare_census(
        "census-train", table="census_train", rows=workflow.get_parameter("train-rows"), seed=11, **database
    )
    test_table = prepare_census(
        "census-test", table="census_test", rows=workflow.get_parameter("test-rows"), seed=12, **database
    )
    train = sql(
        "train",
        statement=(
            "SELECT * FROM census_train TO TRAIN DNNClassifier WITH model.hidden_units=[32, 16], "
            f"model.learning_rate=0.01, train.epoch={workflow.get_parameter('epochs')}, "
            f"train.batch_size=64, train.key=id COLUMN {COLUMNS} LABEL income INTO census_model"
        ),
        **statements,
    )
    predict = sql(
        "predict",
        statement=(
            "SELECT * FROM census_test TO PREDICT census_pred.income WITH predict.overwrite=true "
            "USING census_model"
        ),
        **statements,
    )
    evaluate = sql(
        "evaluate",
        statement=(
            'SELECT * FROM census_test TO EVALUATE census_model WITH validation.metrics="Accuracy", '
            "evaluate.overwrite=true LABEL income INTO census_eval"
        ),
        **statements,
    )
    train_table >> train
    [train, test_table] >> predict >> evaluate  # one writer at a time: SQLite locks the whole file

if __name__ == "__main__":
    print(workflow.to_yaml())
