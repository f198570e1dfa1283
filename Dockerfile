# The edl-argo image: what every Argo step and every worker and parameter-server pod runs.
#
#   make image IMAGE=registry.example/edl-argo:0.1.0      (docker, podman or buildah)
#
# * Python 3.11 (slim); edl-argo and exactly the dependency set of requirements.lock (`make lock`, from
#   pyproject.toml) in the virtualenv /opt/venv, whose bin/ (with `edl-argo`) is on the PATH.
# * The project at /opt/edl-argo: the model zoo (examples/model_zoo/digits.py, ...), the example pipelines,
#   components/ and templates/. Models of your own need no image of their own: pass their storage URL as
#   --model-def (docs/deploy.md); or build FROM this image and COPY them under /opt/edl-argo/models/.
# * Runs as uid/gid 1000 (`edl`), the runAsUser/runAsGroup of every step and pod; /tmp is writable.
# * Multi-stage: pip, its caches and the build requirements stay in the build stage.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
RUN python -m venv --without-pip /opt/venv
COPY requirements.lock /opt/edl-argo/requirements.lock
RUN python -m pip --python /opt/venv/bin/python install --no-deps --requirement /opt/edl-argo/requirements.lock
COPY pyproject.toml README.md /opt/edl-argo/
COPY edl_argo /opt/edl-argo/edl_argo
RUN python -m pip --python /opt/venv/bin/python install --no-deps /opt/edl-argo \
    && python -m pip --python /opt/venv/bin/python check \
    && rm -rf /opt/edl-argo/build /opt/edl-argo/*.egg-info
# Every module's bytecode, compiled by the venv's own interpreter (pip compiles what it installs; this makes
# sure of it): the image's processes run with PYTHONDONTWRITEBYTECODE, so a module without its .pyc would
# be compiled again at every start of every step and pod.
RUN /opt/venv/bin/python -m compileall -q -j 0 /opt/venv/lib

FROM ${PYTHON_IMAGE}
# The uid and gid of edl_argo.pods.manifests.RUN_AS_ID (the pods' and steps' runAsUser/runAsGroup).
ARG RUN_AS_ID=1000
RUN groupadd --gid ${RUN_AS_ID} edl \
    && useradd --uid ${RUN_AS_ID} --gid ${RUN_AS_ID} --home-dir /home/edl --create-home --shell /usr/sbin/nologin edl \
    && chmod 1777 /tmp
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/edl-argo /opt/edl-argo
COPY examples /opt/edl-argo/examples
COPY components /opt/edl-argo/components
COPY templates /opt/edl-argo/templates
COPY docs /opt/edl-argo/docs
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/edl \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /opt/edl-argo
USER ${RUN_AS_ID}:${RUN_AS_ID}
ENTRYPOINT ["edl-argo"]
CMD ["--help"]
