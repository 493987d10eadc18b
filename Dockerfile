# megatron_ext on NVIDIA's NGC PyTorch image: CUDA, cuDNN, NCCL, PyTorch, Transformer Engine
# and Apex built and tested together by NVIDIA. Build, run and multi-node use: docs/docker.md.
#
#   docker build -t megatron_ext .
#   docker run --gpus all --ipc=host --rm megatron_ext python pretrain_llama.py --help
#
# 25.12: Python 3.12, PyTorch 2.10 (NVIDIA build), CUDA 13.1. megatron-core 0.16.1 ships
# cp312 wheels and asks for torch >= 2.6 and Transformer Engine 2.9 - 2.11.
FROM nvcr.io/nvidia/pytorch:25.12-py3

# The image lists every Python package it ships (torch, transformer-engine, apex, numpy, ...)
# in /etc/pip/constraint.txt and points PIP_CONSTRAINT at it. It stays in force: no install
# below can replace NVIDIA's CUDA builds; pip stops with an error instead.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    MEGATRON_EXT_CACHE=/workspace/cache

WORKDIR /workspace/megatron_ext

# 1. Dependencies, in their own layer (kept across code edits): setup.py's install_requires
#    without torch (the image's CUDA build is the torch), megatron-core at the tested version
#    inside setup.py's range, plus pytest, pytest-xdist (pytest.ini runs the suite on every
#    core) and hypothesis for the tests on a GPU.
#    tests/unit/packaging/test_dockerfile.py checks this list against setup.py.
RUN pip install --no-cache-dir "megatron-core==0.16.1" numpy psutil tokenizers safetensors \
        tensorboard matplotlib highspy scipy pyyaml pytest pytest-xdist hypothesis

# 2. The package itself, without dependency resolution (the image's constraints stay the only
#    word on torch).
#    Editable, so a checkout mounted over /workspace/megatron_ext is what runs.
COPY . .
RUN pip install --no-cache-dir --no-deps -e .

CMD ["python", "pretrain_llama.py", "--help"]
