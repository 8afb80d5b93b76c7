# pdserve image: the router, prefill and decode services (the Helm chart runs `python -m <service>`).
#   docker build -t pdserve:0.1.0 .                                   # CPU (torch CPU wheel)
#   docker build --build-arg BASE_IMAGE=<your Ascend CANN image with python 3.10+> --build-arg EXTRAS=npu \
#                --build-arg MOONCAKE_WHEEL=mooncake-transfer-engine-npu -t pdserve:0.1.0-npu .   # Ascend NPU
#   docker build --build-arg BASE_IMAGE=<a CUDA 12 runtime image> \
#                --build-arg MOONCAKE_WHEEL=mooncake-transfer-engine -t pdserve:0.1.0-cuda .        # NVIDIA GPU
# MOONCAKE_WHEEL picks the Mooncake transfer engine built for the accelerator (one of them: they all
# install the `mooncake` module): mooncake-transfer-engine-non-cuda (CPU; the default),
# mooncake-transfer-engine (CUDA 12), mooncake-transfer-engine-cuda13, mooncake-transfer-engine-npu
# (Ascend), mooncake-transfer-engine-efa (AWS EFA); "" leaves Mooncake out (--kv-transport tcp only).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG EXTRAS=""
ARG MOONCAKE_WHEEL=mooncake-transfer-engine-non-cuda
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0

# RDMA verbs + rdmacm for Mooncake; openssl for `pdserve certs`; a C compiler for the CPU
# kernels, built on first use for the node's own CPU (-march=native) into PDSERVE_KERNEL_CACHE.
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 librdmacm1 openssl gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV PDSERVE_KERNEL_CACHE=/tmp/pdserve-kernels

WORKDIR /opt/pdserve
# torch first, pinned, from the CPU index: nothing may pull a CUDA build.
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX}
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY shared ./shared
COPY prefill_service ./prefill_service
COPY decode_service ./decode_service
COPY router ./router
RUN pip install ".[${EXTRAS}]"
RUN if [ -n "${MOONCAKE_WHEEL}" ]; then pip install "${MOONCAKE_WHEEL}"; fi

# Services bind the pod address given by the chart; these are the defaults it uses.
EXPOSE 50051 7001 7002 7100 9400
USER 65534:65534
CMD ["python", "-m", "router", "--help"]
