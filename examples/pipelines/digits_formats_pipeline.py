"""The digits pipeline on files of another format: prepare the digits as TFRecord, CSV or Parquet files,
PNG images in class folders (or RecordIO shards), train the digits model on them, evaluate it.

    edl-argo pipeline run examples/pipelines/digits_formats_pipeline.py -p format=csv -p data=out/digits-csv
    python examples/pipelines/digits_formats_pipeline.py > digits-formats.yaml     # for `argo submit`

Workflow parameters (``-p NAME=VALUE``): ``format``, one of recordio, tfrecord, csv, parquet, images;
``data``, where the dataset goes; ``epochs``, ``workers``; ``image``, the edl-argo image. Nothing names the
format after the prepare step: training and evaluation detect it from the file names (``--data-format``
empty), and the model's ``feed`` takes records, rows and PNG files alike (``examples/model_zoo/digits.py``).
"""

from hera.workflows import DAG, Parameter, Workflow

from edl_argo.hera import IMAGE, MODEL_ZOO, elastic_train, evaluate, prepare_digits

FORMATS = ["recordio", "tfrecord", "csv", "parquet", "images"]

MODEL = f"{MODEL_ZOO}/digits.py"

with (
    Workflow(
        generate_name="digits-formats-",
        entrypoint="pipeline",
        arguments=[
            Parameter(name="format", value="csv", enum=FORMATS, description="the files' format"),
            Parameter(name="data", value="s3://my-bucket/datasets/digits-formats"),
            Parameter(name="epochs", value="8"),
            Parameter(name="workers", value="2"),
            Parameter(name="image", value=IMAGE),
        ],
    ) as workflow,
    DAG(name="pipeline"),
):
    data, image = workflow.get_parameter("data"), workflow.get_parameter("image")
    prepared = prepare_digits(output=data, format=workflow.get_parameter("format"), shards=2, image=image)
    train = elastic_train(
        model_def=MODEL,
        training_data=f"{data}/train",
        validation_data=f"{data}/test",
        master_state=f"{data}/jobs/{{{{workflow.name}}}}",  # durable: a retried master continues the job
        num_epochs=workflow.get_parameter("epochs"),
        minibatch_size=32,
        num_minibatches_per_task=4,
        num_workers=workflow.get_parameter("workers"),
        num_ps=1,
        image=image,
    )
    prepared >> train
    evaluate(model=train.get_artifact("model"), model_def=MODEL, data=f"{data}/test", image=image)

if __name__ == "__main__":
    print(workflow.to_yaml())
