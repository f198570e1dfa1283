"""An example of storage settings for a MinIO in the workflows' namespace, like the one of Argo's
quick-start (service minio:9000, bucket my-bucket, credentials in the Secret my-minio-cred): the default
artifact repository of the namespace, where step outputs such as the trained model go, and the
edl-argo-storage Secret from which steps and training pods read and write datasets. Edit both for your
own object store.

Not part of templates/: applying it REPLACES the namespace's ConfigMap artifact-repositories, the default
artifact repository of every workflow in that namespace. Apply it only to a namespace of your own (Argo's
quick-start), or merge its `minio` key into your existing ConfigMap by hand."""

import yaml
from hera.workflows.models import ArtifactRepository, S3ArtifactRepository, SecretKeySelector
from kubernetes.client import ApiClient, V1ConfigMap, V1ObjectMeta, V1Secret

from edl_argo.hera import STORAGE_SECRET
from edl_argo.hera.step import LABELS

WARNING = """\
EXAMPLE ONLY. `kubectl apply -f` of this file REPLACES the namespace's ConfigMap artifact-repositories:
every workflow of that namespace that relied on its own default artifact repository then uses this MinIO.
Apply it to a namespace of your own (Argo's quick-start), or merge the `minio` key into your ConfigMap."""

ENDPOINT = "minio:9000"
CREDENTIALS = "my-minio-cred"

REPOSITORY = ArtifactRepository(
    archive_logs=True,
    s3=S3ArtifactRepository(
        endpoint=ENDPOINT,
        bucket="my-bucket",
        insecure=True,
        access_key_secret=SecretKeySelector(name=CREDENTIALS, key="accesskey"),
        secret_key_secret=SecretKeySelector(name=CREDENTIALS, key="secretkey"),
    ),
)

MANIFESTS = ApiClient().sanitize_for_serialization(
    [
        V1ConfigMap(
            api_version="v1",
            kind="ConfigMap",
            metadata=V1ObjectMeta(
                name="artifact-repositories",
                labels=LABELS,
                annotations={"workflows.argoproj.io/default-artifact-repository": "minio"},
            ),
            data={"minio": yaml.safe_dump(REPOSITORY.model_dump(by_alias=True, exclude_none=True))},
        ),
        V1Secret(
            api_version="v1",
            kind="Secret",
            metadata=V1ObjectMeta(name=STORAGE_SECRET, labels=LABELS),
            string_data={
                "EDL_S3_ENDPOINT": f"http://{ENDPOINT}",
                "AWS_ACCESS_KEY_ID": "admin",
                "AWS_SECRET_ACCESS_KEY": "password",
            },
        ),
    ]
)
