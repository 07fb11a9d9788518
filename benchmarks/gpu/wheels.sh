#!/usr/bin/env bash
# Downloads, where there is network, the wheels benchmarks/gpu/check.sh --wheels DIR installs on a GPU machine
# that has none: the packages the checks import beyond a CUDA image's PyTorch stack (torch, numpy, safetensors,
# tokenizers, pyyaml, pytest are expected there), at constraints.txt's versions, for that machine's Python.
#
#   benchmarks/gpu/wheels.sh [DIR (default .whl)]     PY_VERSION=3.12 by default
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.whl}
PY_VERSION=${PY_VERSION:-3.12}
PYTHON=${PYTHON:-python3}
# transformers and huggingface_hub at the project's pins (an image's may be older), what they and pydantic
# (the config tree) need, and kafka-python (imported by the test fixtures)
NAMES="transformers huggingface_hub httpx2 httpcore2 truststore click regex pydantic pydantic_core annotated-types
typing-inspection typing_extensions kafka-python crc32c"
mkdir -p "$DIR"
for name in $NAMES; do
    pin=$(grep -iE "^${name//[-_]/[-_]}==" constraints.txt) || { echo "$name is not in constraints.txt" >&2; exit 1; }
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$DIR" "$pin"
done
ls -1 "$DIR"
du -sh "$DIR"
