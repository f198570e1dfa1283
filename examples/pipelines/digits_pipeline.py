"""The digits pipeline: prepare the dataset, train a small CNN elastically, evaluate it, predict with it.

    edl-argo pipeline run examples/pipelines/digits_pipeline.py -p data=out/digits   # on this machine
    python examples/pipelines/digits_pipeline.py > digits.yaml                         # for `argo submit`
    edl-argo pipeline submit examples/pipelines/digits_pipeline.py                     # to $ARGO_SERVER

Workflow parameters (``-p NAME=VALUE``): ``data``, where the dataset goes; ``model-def``, the model (the
image's model zoo by default; ``digits_s3_model_pipeline.py`` takes it from S3); ``epochs``,
``minibatch-size``, ``minibatches-per-task``, ``workers``, ``ps``; ``image``, the edl-argo image. The
defaults train to an accuracy of about 0.97 in a minute on two cores.
"""

from hera.workflows import DAG, Parameter, Workflow

from edl_argo.hera import IMAGE, MODEL_ZOO, elastic_train, evaluate, predict, prepare_digits

MODEL = f"{MODEL_ZOO}/digits.py"


def parameter(name: str) -> str:
    """A reference to the workflow parameter ``name``."""
    return f"{{{{workflow.parameters.{name}}}}}"


DATA = parameter("data")
IMAGE_ARGUMENT = {"image": parameter("image")}

with (
    Workflow(
        generate_name="digits-",
        entrypoint="pipeline",
        arguments=[
            Parameter(
                name="data", value="s3://my-bucket/datasets/digits", description="where the dataset goes"
            ),
            Parameter(name="model-def", value=MODEL, description="the model file: in the image, or s3://..."),
            Parameter(name="epochs", value="8"),
            Parameter(name="minibatch-size", value="32"),
            Parameter(name="minibatches-per-task", value="4"),
            Parameter(name="workers", value="2"),
            Parameter(name="ps", value="1"),
            Parameter(name="image", value=IMAGE),
        ],
    ) as workflow,
    DAG(name="pipeline"),
):
    data = prepare_digits(output=DATA, **IMAGE_ARGUMENT)
    train = elastic_train(
        model_def=parameter("model-def"),
        training_data=f"{DATA}/train",
        master_state=f"{DATA}/jobs/{{{{workflow.name}}}}",  # durable: a retried master continues the job
        validation_data=f"{DATA}/test",
        num_epochs=parameter("epochs"),
        minibatch_size=parameter("minibatch-size"),
        num_minibatches_per_task=parameter("minibatches-per-task"),
        num_workers=parameter("workers"),
        num_ps=parameter("ps"),
        **IMAGE_ARGUMENT,
    )
    data >> train
    model = {"model": train.get_artifact("model"), "model_def": parameter("model-def")}
    evaluate(**model, data=f"{DATA}/test", **IMAGE_ARGUMENT)
    predict(**model, data=f"{DATA}/test", **IMAGE_ARGUMENT)

if __name__ == "__main__":
    print(workflow.to_yaml())
