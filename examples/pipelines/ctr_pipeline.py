"""The CTR pipeline: synthetic click-through data, a wide-embedding model trained with 2 parameter
servers (26 embedding tables of 100,000 x 16, sharded by id), then its AUC and log loss on test data.

    edl-argo pipeline run examples/pipelines/ctr_pipeline.py -p data=out/ctr -p records=3000
    python examples/pipelines/ctr_pipeline.py > ctr.yaml                     # for `argo submit`
    edl-argo pipeline submit examples/pipelines/ctr_pipeline.py              # to $ARGO_SERVER

Workflow parameters (``-p NAME=VALUE``): ``data``, where the dataset goes; ``records``, training records;
``epochs``, ``workers``, ``ps``; ``image``, the edl-argo image.
"""

from hera.workflows import DAG, Parameter, Workflow

from edl_argo.hera import IMAGE, MODEL_ZOO, elastic_train, evaluate, prepare_ctr

MODEL = f"{MODEL_ZOO}/ctr.py"
PARAMETERS = {
    "data": "s3://my-bucket/datasets/ctr",
    "records": "20000",
    "epochs": "2",
    "workers": "2",
    "ps": "2",
    "image": IMAGE,
}

with (
    Workflow(
        generate_name="ctr-",
        entrypoint="pipeline",
        arguments=[Parameter(name=name, value=value) for name, value in PARAMETERS.items()],
    ) as workflow,
    DAG(name="pipeline"),
):
    data, image = workflow.get_parameter("data"), workflow.get_parameter("image")
    prepared = prepare_ctr(output=data, records=workflow.get_parameter("records"), shards=2, image=image)
    train = elastic_train(
        model_def=MODEL,
        training_data=f"{data}/train",
        validation_data=f"{data}/test",
        master_state=f"{data}/jobs/{{{{workflow.name}}}}",  # durable: a retried master continues the job
        num_epochs=workflow.get_parameter("epochs"),
        num_workers=workflow.get_parameter("workers"),
        num_ps=workflow.get_parameter("ps"),
        ps_resource_request="cpu=1,memory=2048Mi",  # each PS holds half of the 41.6M embedding parameters
        image=image,
    )
    prepared >> train
    evaluate(model=train.get_artifact("model"), model_def=MODEL, data=f"{data}/test", image=image)

if __name__ == "__main__":
    print(workflow.to_yaml())
