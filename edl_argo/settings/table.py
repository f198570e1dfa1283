"""Every setting of ``edl-argo train``, ``worker`` and ``ps``: the one place a setting is declared.

Adding a setting is one entry here plus the code that uses its value: its flag on each role's command
line, the master passing it to its pods, the configuration field that holds it (``TrainConfig``,
``ModelOptions``) and the ``elastic-train`` step's input all follow (see :mod:`edl_argo.settings.schema`).
``tests/test_settings.py`` checks that every path agrees with this table.
"""

from __future__ import annotations

from edl_argo import __version__
from edl_argo.flags import (
    fraction,
    non_negative_int,
    optional_port,
    port_number,
    positive_int,
    positive_number,
)
from edl_argo.settings.schema import Argo, Setting

PARAMETER_SERVER = "ParameterServerStrategy"
ALLREDUCE = "AllreduceStrategy"
STRATEGIES = (PARAMETER_SERVER, ALLREDUCE)
#: ``--nan-loss``: what a worker does with a minibatch whose loss is NaN or infinite. ``fail``: the job
#: fails at once, naming the model version, task and shard; ``skip``: the minibatch is not pushed, and
#: ``nan_batches_skipped`` in metrics.json counts it.
NAN_LOSS_POLICIES = ("fail", "skip")
#: ``--nan-gradients``: the same for a minibatch whose loss is finite but whose gradients hold a NaN or an
#: infinity (:mod:`edl_argo.worker.gradient_check`); ``nan_gradients_skipped`` counts them per worker.
NAN_GRADIENT_POLICIES = ("fail", "skip")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
#: Deadline of every gRPC call (``--rpc-timeout-seconds``).
RPC_TIMEOUT_SECONDS = 30
#: ``--master-timeout``: a worker or PS whose master stays unreachable this long ends.
MASTER_TIMEOUT_SECONDS = 600
#: The image and storage Secret every Argo step defaults to (``templates/``), and the pods' resources.
STEP_IMAGE = f"edl-argo:{__version__}"
STEP_STORAGE_SECRET = "edl-argo-storage"
#: The elastic-train step's ``db-secret`` default (edl_argo.readers.credentials.DEFAULT_SECRET, which the
#: settings must not import).
DB_SECRET = "edl-argo-db"
ROLE_RESOURCES = "cpu=1,memory=1024Mi"
#: ``--k8s-qps`` and ``--k8s-burst``: the master's request budget on the Kubernetes API
#: (:mod:`edl_argo.pods.request_budget` says why these values).
K8S_QPS = 50.0
K8S_BURST = 100

ALL = ("train", "worker", "ps")
MODEL = "model"
JOB = "job"
TRAINING = "training"
CLUSTER = "workers and parameter servers"
K8S = "kubernetes (with --backend kubernetes)"
POD = "pod (given by the master)"
DATA = "data"
#: The names ``--data-format`` takes (edl_argo.readers.registry.FORMATS, which the settings must not import),
#: but ``custom``: a model's custom data reader (``--custom-data-reader``) selects that one.
DATA_FORMATS = ("recordio", "tfrecord", "csv", "parquet", "images", "sql")
MONITORING = "monitoring"
#: ``--log-loss-steps``: how often a worker logs its loss, in its own training steps.
LOG_LOSS_STEPS = 100


def _model_function(name: str, default: str) -> Setting:
    return Setting(
        "--" + name,
        str,
        default,
        f"name of the model file's {name.replace('-', '_')} (default {default})",
        roles=ALL,
        section="model",
        group=MODEL,
        metavar="NAME",
        argo=Argo(),
    )


def _role_settings(role: str, argo_default: str, priority: str) -> list[Setting]:
    note = " (recorded only: Argo creates the master's pod, see master-cpu and master-memory)"
    note = note if role == "master" else ""
    return [
        Setting(
            f"--{role}-resource-request",
            str,
            "",
            f"resource requests of {role} pods{note}",
            section="kubernetes",
            group=K8S,
            metavar="cpu=2,memory=2048Mi,gpu=1",
            argo=Argo(default=argo_default),
        ),
        Setting(
            f"--{role}-resource-limit",
            str,
            "",
            f"resource limits of {role} pods (default: none){note}",
            section="kubernetes",
            group=K8S,
            metavar="cpu=2,memory=2048Mi,gpu=1",
            argo=Argo(),
        ),
        Setting(
            f"--{role}-pod-priority",
            str,
            "",
            f"PriorityClass of {role} pods{note}",
            section="kubernetes",
            group=K8S,
            argo=Argo(default=priority),
        ),
    ]


SETTINGS: tuple[Setting, ...] = (
    # ------------------------------------------------------------------ the model
    Setting(
        "--model-def",
        str,
        "",
        "path/to/model.py[:custom_model], package.module.fn, or with --model-zoo module.path.fn; in a "
        "cluster a file in the image (/opt/edl-argo/examples/model_zoo/digits.py) or in storage "
        "(s3://bucket/models/model.py)",
        roles=ALL,
        required=ALL,
        group=MODEL,
        argo=Argo(),
    ),
    Setting(
        "--model-zoo",
        str,
        "",
        "folder of model files (ElasticDL's); --model-def is then module.path.function inside it",
        roles=ALL,
        section="model",
        group=MODEL,
        metavar="DIR",
        argo=Argo(),
    ),
    Setting(
        "--model-params",
        str,
        "",
        'keyword arguments of the model function, "k=v;..." (values are Python literals)',
        roles=ALL,
        section="model",
        group=MODEL,
        metavar='"k=v;..."',
        argo=Argo(),
    ),
    Setting(
        "--feed",
        str,
        "",
        "name of the input function (default: feed, else dataset_fn)",
        roles=ALL,
        section="model",
        group=MODEL,
        aliases=("--dataset-fn",),
        metavar="NAME",
        argo=Argo(),
    ),
    _model_function("loss", "loss"),
    _model_function("optimizer", "optimizer"),
    _model_function("eval-metrics-fn", "eval_metrics_fn"),
    _model_function("callbacks", "callbacks"),
    _model_function("prediction-outputs-processor", "PredictionOutputsProcessor"),
    Setting(
        "--custom-data-reader",
        str,
        "",
        "name of the model file's ElasticDL data reader factory, custom_data_reader(data_origin, "
        "records_per_task=None, **data_options) returning an AbstractDataReader (create_shards(), "
        "read_records(task) of serialized records); default: custom_data_reader if the model file defines "
        "it. The data URLs are then read by it (--data-format custom)",
        roles=ALL,
        section="model",
        group=MODEL,
        metavar="NAME",
    ),
    # ------------------------------------------------------------------ the job
    Setting(
        "--training-data",
        str,
        "",
        "URL of the training data: a folder, s3://bucket/prefix or one file (RecordIO, TFRecord, CSV, "
        "Parquet, a folder of class folders of images), or a database URL#table or URL#SELECT ...",
        required=("train",),
        metavar="URL",
        argo=Argo(),
    ),
    Setting(
        "--validation-data",
        str,
        "",
        "URL of the data to evaluate on, in the same forms as --training-data; empty: no evaluation",
        metavar="URL",
        argo=Argo(),
    ),
    Setting(
        "--data-format",
        str,
        "",
        "format of the data URLs; empty: from the file names (a dataset manifest, .tfrecord[.gz], .csv, "
        ".parquet, class folders of images, no extension: RecordIO) or the database URL",
        group=DATA,
        choices=("", *DATA_FORMATS),
        argo=Argo(),
    ),
    Setting(
        "--data-options",
        str,
        "",
        'the format\'s options, "k=v;...": columns (read only these), schema (CSV: name:type,...), '
        "delimiter, fill_missing, key (SQL: a unique key column), labels (images: a CSV of file,label)",
        group=DATA,
        metavar='"k=v;..."',
        argo=Argo(),
    ),
    Setting(
        "--output",
        str,
        "",
        "where the model, metrics and checkpoints go",
        required=("train",),
        metavar="URL",
    ),
    Setting(
        "--job-name",
        str,
        "",
        "name of the job (default: a random edl-XXXXXXXX); on Kubernetes its pods are <job>-worker-N",
        argo=Argo(
            "name of the job (its pods are <job>-worker-N); default <workflow>-<task>, one job per training "
            "task; a name longer than 50 characters is shortened with a hash suffix",
            default="{{workflow.name}}",
        ),
    ),
    Setting(
        "--master-state",
        str,
        "",
        "where the master keeps the job's state, so that a master started again with the same job name "
        "continues the job (default: --output; use durable storage when --output is a pod's own disk)",
        metavar="URL",
        argo=Argo(
            "URL (s3://...) where the master keeps the job's state, so a master retried by Argo continues "
            "the job; empty: the pod's own disk, and a retried master starts the job afresh"
        ),
    ),
    Setting("--backend", str, "local", "where pods run", choices=("local", "kubernetes")),
    Setting("--log-level", str, "INFO", "how much to log", roles=ALL, choices=LOG_LEVELS, argo=Argo()),
    Setting(
        "--metrics-output",
        str,
        "",
        "also write the final metrics as JSON to this file",
        section="command",
        metavar="PATH",
    ),
    # ------------------------------------------------------------------ monitoring
    Setting(
        "--metrics-port",
        int,
        0,
        "serve the job's live metrics to Prometheus on this port of the master (0: none; the elastic-train"
        " step serves them on its container port named metrics)",
        group=MONITORING,
        parse=port_number,
    ),
    Setting(
        "--log-loss-steps",
        int,
        LOG_LOSS_STEPS,
        "each worker logs its mean loss every N of its training steps, as a `loss` event reading"
        " 'Loss = <loss> at step <model version>' (0: never)",
        roles=("train", "worker"),
        group=MONITORING,
        parse=non_negative_int,
        argo=Argo(),
    ),
    # ------------------------------------------------------------------ training
    Setting(
        "--num-epochs",
        int,
        1,
        "passes over the training data",
        group=TRAINING,
        parse=positive_int,
        argo=Argo(),
    ),
    Setting(
        "--minibatch-size",
        int,
        64,
        "records per minibatch",
        roles=("train", "worker"),
        group=TRAINING,
        parse=positive_int,
        argo=Argo(),
    ),
    Setting(
        "--num-minibatches-per-task",
        int,
        8,
        "minibatches per task (the unit of work)",
        group=TRAINING,
        parse=positive_int,
        argo=Argo(),
    ),
    Setting(
        "--shuffle",
        bool,
        False,
        "shuffle the task order each epoch",
        group=TRAINING,
        # The step has always shuffled; a pipeline now may say shuffle=False.
        argo=Argo(default=True),
    ),
    Setting("--seed", int, 0, "seed of the task shuffle", group=TRAINING, argo=Argo()),
    Setting(
        "--nan-loss",
        str,
        "fail",
        "a minibatch whose loss is NaN: fail the job at once (default), or skip the minibatch",
        roles=("train", "worker"),
        group=TRAINING,
        choices=NAN_LOSS_POLICIES,
        argo=Argo(),
    ),
    Setting(
        "--nan-gradients",
        str,
        "fail",
        "a minibatch whose gradients hold NaN or Inf (the loss finite): fail the job at once (default),"
        " or skip the minibatch",
        roles=("train", "worker"),
        group=TRAINING,
        choices=NAN_GRADIENT_POLICIES,
        argo=Argo(),
    ),
    Setting(
        "--evaluation-steps",
        int,
        0,
        "evaluate every N model versions (0: at the end only)",
        roles=("train", "worker"),
        group=TRAINING,
        parse=non_negative_int,
        argo=Argo(),
    ),
    Setting(
        "--checkpoint-steps",
        int,
        0,
        "checkpoint the model every N versions (each PS, or with AllreduceStrategy the group; 0: never)",
        roles=ALL,
        group=TRAINING,
        parse=non_negative_int,
        argo=Argo("checkpoint the model every N versions (0: never); needs checkpoint-dir"),
    ),
    Setting(
        "--checkpoint-dir",
        str,
        "",
        "where checkpoints go, the newest restored at start (default OUTPUT/checkpoints); with --backend "
        "kubernetes an s3:// URL",
        roles=ALL,
        group=TRAINING,
        metavar="URL",
        argo=Argo(
            "URL (s3://...) of the checkpoints that replaced PS pods, or AllreduceStrategy workers that all "
            "died, restore"
        ),
    ),
    # ------------------------------------------------------------------ workers and parameter servers
    Setting(
        "--distribution-strategy",
        str,
        PARAMETER_SERVER,
        "ParameterServerStrategy: variables on PS pods (sparse and large models); AllreduceStrategy: "
        "full replicas on workers that average gradients every step (dense models, synchronous SGD; "
        "num-ps and grads-to-wait are then ignored)",
        roles=("train", "worker"),
        group=CLUSTER,
        choices=STRATEGIES,
        argo=Argo(),
    ),
    Setting(
        "--collective-timeout-seconds",
        int,
        60,
        "AllreduceStrategy: a member silent this long in a collective step is dropped from the group",
        roles=("train", "worker"),
        group=CLUSTER,
        parse=positive_int,
        argo=Argo(),
    ),
    Setting(
        "--scale-lr-by-world-size",
        bool,
        False,
        "AllreduceStrategy: multiply the learning rate by the number of workers (linear scaling rule)",
        roles=("train", "worker"),
        group=CLUSTER,
        argo=Argo(),
    ),
    Setting("--num-workers", int, 2, "worker pods", group=CLUSTER, parse=positive_int, argo=Argo()),
    Setting(
        "--num-ps",
        int,
        1,
        "parameter-server pods",
        roles=("train", "ps"),
        group=CLUSTER,
        parse=positive_int,
        aliases=("--num-ps-pods",),
        argo=Argo(),
    ),
    Setting(
        "--grads-to-wait",
        int,
        1,
        "synchronous SGD: gradient pushes averaged per step",
        roles=("train", "ps"),
        group=CLUSTER,
        parse=positive_int,
        argo=Argo(),
    ),
    Setting(
        "--use-async",
        bool,
        False,
        "asynchronous SGD: apply each push on arrival",
        roles=("train", "ps"),
        group=CLUSTER,
        argo=Argo(),
    ),
    Setting(
        "--lr-staleness-modulation",
        bool,
        False,
        "asynchronous SGD: scale the learning rate by 1/staleness",
        roles=("train", "ps"),
        group=CLUSTER,
        argo=Argo(),
    ),
    Setting(
        "--pipelined",
        bool,
        False,
        "asynchronous SGD: push and pull while the next minibatch computes (faster, one more step of "
        "staleness)",
        roles=("train", "worker"),
        group=CLUSTER,
        argo=Argo(),
    ),
    Setting(
        "--sync-version-tolerance",
        int,
        0,
        "synchronous SGD: accept pushes up to this many versions old",
        roles=("train", "ps"),
        group=CLUSTER,
        parse=non_negative_int,
        argo=Argo(),
    ),
    Setting(
        "--max-embedding-rows",
        int,
        0,
        "the most rows one embedding table may hold on one PS: pulls and pushes of new ids beyond it are"
        " refused (0, the default: no bound; set it to the vocabulary size)",
        roles=("train", "ps"),
        group=CLUSTER,
        parse=non_negative_int,
        argo=Argo(),
    ),
    Setting(
        "--max-task-retries",
        int,
        3,
        "a task that fails this often fails the job",
        group=CLUSTER,
        parse=positive_int,
        argo=Argo(),
    ),
    Setting(
        "--max-worker-relaunches",
        int,
        16,
        "worker pods replaced at most this often",
        group=CLUSTER,
        parse=non_negative_int,
        argo=Argo(),
    ),
    Setting(
        "--relaunch-backoff-seconds",
        int,
        10,
        "a worker whose predecessors keep failing soon after they start (exit status, signal, OOM) is"
        " relaunched after a delay, as the kubelet backs off a crash loop: none after the first failure,"
        " then this many seconds, doubling to 30 times it; a worker that ran 10 minutes resets it (0:"
        " relaunch at once)",
        group=CLUSTER,
        parse=non_negative_int,
        metavar="SECONDS",
        argo=Argo(),
    ),
    Setting(
        "--max-workers",
        int,
        0,
        "the most workers: the job grows to it, one worker at a time, while capacity frees up and each worker"
        " added raises the throughput (see --scale-up-min-gain); `edl-argo scale` may ask for at most it (0:"
        " no growth, and scale asks for at most 64, or --num-workers if more); a PS is given the job's"
        " resolved limit and admits as many calls at once as that many workers make",
        roles=("train", "ps"),
        group=CLUSTER,
        parse=non_negative_int,
        argo=Argo(),
    ),
    Setting(
        "--min-workers",
        int,
        1,
        "training runs only while at least this many workers run: below it (at start, or after preemption)"
        " it pauses, and the job fails after --min-workers-timeout",
        group=CLUSTER,
        parse=positive_int,
        argo=Argo(),
    ),
    Setting(
        "--min-workers-timeout",
        int,
        1800,
        "how long training may stay paused with fewer than --min-workers running before the job fails",
        group=CLUSTER,
        parse=positive_int,
        metavar="SECONDS",
        argo=Argo(),
    ),
    Setting(
        "--scale-up-window-seconds",
        int,
        60,
        "growth to --max-workers: each worker count is measured this long (every worker running and"
        " training) before the next worker is added",
        group=CLUSTER,
        parse=positive_int,
        metavar="SECONDS",
        argo=Argo(),
    ),
    Setting(
        "--scale-up-min-gain",
        float,
        0.25,
        "growth to --max-workers stops when the last worker added raised the job's records/s by less than"
        " this fraction of one worker's average share (the PS or the collective is the bottleneck); it is"
        " tried again 10 windows later",
        group=CLUSTER,
        parse=fraction,
        argo=Argo(),
    ),
    Setting(
        "--max-ps-relaunches",
        int,
        8,
        "parameter-server pods replaced at most this often",
        group=CLUSTER,
        parse=non_negative_int,
        argo=Argo(),
    ),
    Setting(
        "--min-task-timeout-seconds",
        int,
        60,
        "reclaim a task held longer than max(this, 5 x the longest recent task) and replace its worker",
        group=CLUSTER,
        parse=positive_int,
        argo=Argo(),
    ),
    Setting(
        "--rpc-timeout-seconds",
        int,
        RPC_TIMEOUT_SECONDS,
        "deadline of every call to the master or a parameter server, in seconds; a peer that does not "
        "answer in time is retried as an unavailable one (a server ends a call that outlives it by more "
        "than its handlers' slack)",
        roles=("train", "worker", "ps"),
        group=CLUSTER,
        parse=positive_int,
        argo=Argo(),
    ),
    Setting(
        "--master-port",
        int,
        0,
        "port of the master (0: any free port)",
        group=CLUSTER,
        parse=port_number,
    ),
    Setting(
        "--master-timeout",
        int,
        MASTER_TIMEOUT_SECONDS,
        "a worker or PS whose master stays unreachable this long ends (a PS after saving its checkpoint); "
        "a master restarted within it adopts them",
        roles=ALL,
        group=CLUSTER,
        parse=positive_int,
        metavar="SECONDS",
        argo=Argo(),
    ),
    Setting(
        "--tls-dir",
        str,
        "",
        "serve the master and parameter servers over TLS: a folder holding tls.crt, tls.key and optionally"
        " ca.crt (the certificate must name DNS:edl-argo); with --backend kubernetes use --tls-secret",
        roles=ALL,
        group=CLUSTER,
        metavar="DIR",
    ),
    # ------------------------------------------------------------------ kubernetes
    Setting(
        "--image",
        str,
        "",
        "container image of the worker and PS pods (in the Argo step also the master's)",
        section="kubernetes",
        group=K8S,
        argo=Argo(default=STEP_IMAGE),
    ),
    Setting(
        "--image-pull-policy",
        str,
        "IfNotPresent",
        "when the pods pull their image",
        section="kubernetes",
        group=K8S,
        choices=PULL_POLICIES,
        argo=Argo(),
    ),
    Setting(
        "--image-pull-secret",
        str,
        (),
        "Secret for pulling the image (repeatable, or several separated by ';'; default: the master's own "
        "pod's imagePullSecrets)",
        section="kubernetes",
        group=K8S,
        metavar="NAME",
        repeated=True,
        argo=Argo(),
    ),
    Setting(
        "--namespace",
        str,
        "",
        "namespace of the pods (default: the master's own, else 'default')",
        section="kubernetes",
        group=K8S,
    ),
    Setting(
        "--service-account",
        str,
        "",
        "service account of the worker and PS pods",
        section="kubernetes",
        group=K8S,
        argo=Argo(),
    ),
    *_role_settings("worker", ROLE_RESOURCES, "edl-argo-low"),
    Setting(
        "--opportunistic-worker-pod-priority",
        str,
        "",
        "PriorityClass of the workers growth adds beyond --num-workers (default: --worker-pod-priority's);"
        " a lower one lets other jobs' workers preempt them first, taking back the room this job grew into",
        section="kubernetes",
        group=K8S,
        argo=Argo(default="edl-argo-opportunistic"),
    ),
    *_role_settings("ps", ROLE_RESOURCES, "edl-argo-high"),
    *_role_settings("master", "", "edl-argo-high"),
    Setting(
        "--node-selector",
        str,
        "",
        "nodeSelector of the pods",
        section="kubernetes",
        group=K8S,
        metavar="KEY=VALUE,...",
        argo=Argo(),
    ),
    Setting(
        "--toleration",
        str,
        (),
        "tolerate a taint (kubectl taint syntax; repeatable, or several separated by ';')",
        section="kubernetes",
        group=K8S,
        metavar="KEY[=VALUE][:EFFECT]",
        repeated=True,
        argo=Argo(),
    ),
    Setting(
        "--volume",
        str,
        (),
        "mount a PersistentVolumeClaim in every pod (also sub_path=, read_only=true; repeatable, or several "
        "separated by ';')",
        section="kubernetes",
        group=K8S,
        metavar="claim_name=NAME,mount_path=/PATH",
        repeated=True,
        argo=Argo(),
    ),
    Setting(
        "--storage-secret",
        str,
        "",
        "Secret whose keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN (each optional) the "
        "pods get as environment variables (the Argo step's pod also EDL_S3_ENDPOINT)",
        section="kubernetes",
        group=K8S,
        metavar="NAME",
        argo=Argo(default=STEP_STORAGE_SECRET),
    ),
    Setting(
        "--db-secret",
        str,
        "",
        "Secret whose key 'password' the workers (and the Argo step's pod) get as EDL_DB_PASSWORD, the "
        "password of the database the training data is in (optional: none for a database without one)",
        section="kubernetes",
        group=K8S,
        metavar="NAME",
        argo=Argo(default=DB_SECRET),
    ),
    Setting(
        "--tls-secret",
        str,
        "",
        "serve the master and parameter servers over TLS: a Secret of type kubernetes.io/tls (tls.crt, "
        "tls.key, optionally ca.crt; the certificate must name DNS:edl-argo), which the master reads and "
        "mounts read-only into its worker and PS pods",
        section="kubernetes",
        group=K8S,
        metavar="NAME",
        argo=Argo(),
    ),
    Setting(
        "--ps-port",
        int,
        2222,
        "PS i listens on this port + i",
        section="kubernetes",
        group=K8S,
        parse=positive_int,
        argo=Argo(),
    ),
    Setting(
        "--pod-creation-timeout",
        int,
        300,
        "retry creating a pod (quota, admission errors) this long",
        section="kubernetes",
        group=K8S,
        parse=positive_int,
        metavar="SECONDS",
        argo=Argo(),
    ),
    Setting(
        "--k8s-qps",
        float,
        K8S_QPS,
        "requests a second the master sends the Kubernetes API, on average at most (client-side, as"
        " client-go's QPS; every create, delete, get, list, log read, retry and watch counts)",
        section="kubernetes",
        group=K8S,
        parse=positive_number,
        metavar="QPS",
        argo=Argo(),
    ),
    Setting(
        "--k8s-burst",
        int,
        K8S_BURST,
        "requests the master may send the Kubernetes API at once, beyond --k8s-qps (as client-go's Burst)",
        section="kubernetes",
        group=K8S,
        parse=positive_int,
        metavar="REQUESTS",
        argo=Argo(),
    ),
    Setting(
        "--yaml",
        bool,
        False,
        "print the manifests of the job's pods and exit",
        section="command",
        group=K8S,
    ),
    # ------------------------------------------------------------------ what the master gives each pod
    Setting(
        "--worker-id",
        int,
        0,
        "this worker's id",
        roles=("worker",),
        required=("worker",),
        group=POD,
        parse=non_negative_int,
        from_master=True,
    ),
    Setting(
        "--ps-id",
        int,
        0,
        "this server's id",
        roles=("ps",),
        group=POD,
        parse=non_negative_int,
        from_master=True,
    ),
    Setting(
        "--master-addr",
        str,
        "",
        "host:port of the job's master (a PS without one serves until SIGTERM)",
        roles=("worker", "ps"),
        required=("worker",),
        group=POD,
        from_master=True,
    ),
    Setting(
        "--training-data-spec",
        str,
        "",
        "the training data's reader spec as the master opened it (JSON: format, schema, options)",
        roles=("worker",),
        group=POD,
        from_master=True,
    ),
    Setting(
        "--ps-addrs",
        str,
        "",
        "comma-separated host:port, in PS id order (ParameterServerStrategy)",
        roles=("worker",),
        group=POD,
        from_master=True,
    ),
    Setting(
        "--collective-port",
        int,
        0,
        "AllreduceStrategy: port of this worker's collective service (0: any free port)",
        roles=("worker",),
        group=POD,
        parse=non_negative_int,
        from_master=True,
    ),
    Setting(
        "--host",
        str,
        "",
        "address to listen on (default: $POD_IP, else 127.0.0.1)",
        roles=("ps",),
        group=POD,
    ),
    Setting(
        "--port",
        int,
        2222,
        "port to listen on",
        roles=("ps",),
        group=POD,
        parse=non_negative_int,
        from_master=True,
    ),
    Setting(
        "--tensor-port",
        int,
        0,
        "port of the tensor port, which carries pushes and dense pulls over plain TCP beside gRPC"
        " (0: any free port; -1: none)",
        roles=("ps",),
        group=POD,
        parse=optional_port,
        from_master=True,
    ),
    Setting("--prediction-output", str, "", "URL to write predictions to", roles=("worker",), group=POD),
)

#: Each setting by its flag (``"--num-epochs"``).
BY_FLAG = {setting.flag: setting for setting in SETTINGS}


def default_of(flag: str) -> object:
    """The default of the setting ``flag``."""
    return BY_FLAG[flag].default
