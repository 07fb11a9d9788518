# online-sao service image. CPU by default; CUDA with --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
# Build: docker build -t online-sao .     Run: docker run -p 8000:8000 -v $PWD/data:/data online-sao serve
# No weights are baked in: mount a model directory (model.path) or the data directory.
ARG BASE=python:3.11-slim

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY online_sao ./online_sao
COPY streams ./streams
COPY serving ./serving
COPY trainer ./trainer
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir -c constraints.txt .

FROM ${BASE} AS runtime
RUN (command -v python3.11 || (apt-get update && apt-get install -y --no-install-recommends python3.11 && rm -rf /var/lib/apt/lists/*)) \
 && useradd --create-home --uid 10001 sao && mkdir -p /data && chown sao /data
COPY --from=build /opt/venv /opt/venv
COPY configs /app/configs
ENV PATH=/opt/venv/bin:$PATH \
    ONLINE_SAO__PATHS__DATA_DIR=/data \
    ONLINE_SAO__SERVING__HOST=0.0.0.0
WORKDIR /app
USER sao
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s \
  CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/healthz').status == 200 else 1)"
ENTRYPOINT ["online-sao"]
CMD ["serve"]
