# syntax=docker/dockerfile:1
# online-sao service image: one image runs every process (serve, learn, judge, base-model, kafka up
# against an external cluster); the process is the command: `docker run online-sao:cpu learn`.
#
#   docker build -t online-sao:cpu .                                   # CPU (default): torch from PyTorch's CPU index
#   docker build --build-arg VARIANT=cuda -t online-sao:cuda .         # CUDA: torch's CUDA wheel from PyPI
#   docker build --target mlflow -t online-sao-mlflow .                # MLflow server with the PostgreSQL driver
#
# Both variants share the slim Python base: the CUDA wheel carries its CUDA libraries, the host
# only provides the driver (NVIDIA Container Toolkit, `docker run --gpus all`).
# No weights are baked in: mount a model directory (model.path) and the weight store, or download
# a registered version first with `mlflow artifacts download` (docs/DEPLOY.md). Run-time settings come from
# --config FILE and ONLINE_SAO__SECTION__FIELD variables; a variable wins over the file, so the two set
# below (paths.data_dir, serving.host) are changed with -e or --set, not in the file.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG VARIANT=cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY constraints.txt pyproject.toml ./
# torch first (the heavy layer), the exact version constraints.txt pins
RUN python -m venv /opt/venv \
 && TORCH_VERSION="$(sed -n 's/^torch==//p' constraints.txt)" \
 && case "${VARIANT}" in \
      cpu) /opt/venv/bin/pip install -c constraints.txt --index-url https://download.pytorch.org/whl/cpu \
             --extra-index-url https://pypi.org/simple "torch==${TORCH_VERSION}+cpu" ;; \
      cuda) /opt/venv/bin/pip install -c constraints.txt "torch==${TORCH_VERSION}" ;; \
      *) echo "VARIANT must be cpu or cuda, got '${VARIANT}'" >&2; exit 1 ;; \
    esac
# then the other dependencies of pyproject.toml (cached until pyproject.toml or constraints.txt change)
RUN /opt/venv/bin/python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > requirements.txt \
 && /opt/venv/bin/pip install -c constraints.txt -r requirements.txt
COPY README.md ./
COPY online_sao ./online_sao
COPY streams ./streams
COPY serving ./serving
COPY trainer ./trainer
COPY apps ./apps
RUN /opt/venv/bin/pip install --no-deps -c constraints.txt . \
 && /opt/venv/bin/online-sao --help > /dev/null

# MLflow tracking server for docker-compose.yml / Kubernetes: the official MLflow image has no
# PostgreSQL driver, so this stage installs the MLflow version constraints.txt pins plus psycopg2.
FROM ${PYTHON_IMAGE} AS mlflow
ARG PSYCOPG2_VERSION=2.9.13
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY constraints.txt /tmp/constraints.txt
RUN pip install -c /tmp/constraints.txt mlflow "psycopg2-binary==${PSYCOPG2_VERSION}" \
 && useradd --create-home --uid 10002 --user-group mlflow \
 && mkdir -p /mlartifacts && chown mlflow:mlflow /mlartifacts
USER mlflow
EXPOSE 5000
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:5000/health', timeout=4)"]
ENTRYPOINT ["mlflow"]
CMD ["server", "--host", "0.0.0.0", "--port", "5000"]

# The service (default target).
FROM ${PYTHON_IMAGE} AS runtime
ARG UID=10001
# gcc, g++: with trainer.compile, torch.compile builds its kernels with a compiler (the CPU backend's
# C++ kernels, Triton's launchers on a GPU). /models, /weights and /data exist owned by the service
# user, so named volumes mounted there start writable by it.
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid "${UID}" --user-group sao \
 && mkdir -p /data/models /models /weights \
 && chown sao:sao /data /data/models /models /weights
COPY --from=build /opt/venv /opt/venv
COPY configs /app/configs
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    ONLINE_SAO__PATHS__DATA_DIR=/data \
    ONLINE_SAO__SERVING__HOST=0.0.0.0
WORKDIR /app
USER sao
EXPOSE 8000
# Liveness of `serve` (other processes disable it: docker-compose.yml). The port follows
# ONLINE_SAO__SERVING__PORT when set; /healthz needs no API key.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('ONLINE_SAO__SERVING__PORT', '8000'), timeout=4)"]
ENTRYPOINT ["online-sao"]
CMD ["serve"]
