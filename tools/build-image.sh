#!/bin/sh
# Build the edl-argo image (Dockerfile) as IMAGE with whichever of docker, podman or buildah works here:
# docker only with a daemon that answers. Run from the repository root: `make image IMAGE=...` does.
set -eu
image=${1:?usage: tools/build-image.sh registry/name:tag}
# Whether "$@" (a builder's cheap self-check) runs and succeeds within 20 s.
works() { command -v "$1" >/dev/null 2>&1 && timeout 20 "$@" >/dev/null 2>&1; }
if works docker info; then
    exec docker build --tag "$image" --file Dockerfile .
elif works podman info; then
    exec podman build --tag "$image" --file Dockerfile .
elif works buildah version; then
    exec buildah bud --tag "$image" --file Dockerfile .
fi
echo "make image: no container builder here: install podman or buildah, or start docker's daemon ('docker info' fails)" >&2
exit 1
