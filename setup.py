"""commopt: cheaper communication for distributed PyTorch training.

The four source folders stay at the repository root (docs/architecture.md section 1) and are mapped into the single
import package ``commopt``; ``commopt`` itself is a namespace package without ``__init__.py``.
"""

from setuptools import setup

_FOLDERS = {"comm": "comm", "kernels": "kernels", "schedules": "schedules", "bench": "bench"}
_SUBPACKAGES = ["comm.algorithms", "comm.compression", "comm.elastic", "comm.fsdp", "comm.ina", "comm.integrations",
                "comm.pipeline", "comm.synthesis", "bench.cluster", "bench.cluster.probe"]

_MPI = ["mpi4py>=3.1", "mpich"]
_PLOT = ["matplotlib>=3.5"]
# Optional frameworks (commopt.comm.integrations); none of them may replace the installed torch.
_LIGHTNING = ["pytorch-lightning>=2.1"]
_TRANSFORMERS = ["transformers>=4.40", "accelerate>=0.30"]
# The tests' independent oracles (README, "Set up"): torchft, and what torchtitan 0.3.0 needs, which is
# installed after this extra without its dependencies (pip install --no-deps torchtitan==0.3.0): it pins
# datasets<4.8, and every such datasets needs huggingface-hub<2 while transformers 5 needs >=2.4; the pin
# guards a dataloader-resume bug of datasets 5 (torchtitan#3907) that no test here meets. Exact versions
# for the packages that require torch, so that a later release cannot ask for another torch; wandb is
# left out (torchtitan imports it only for --metrics.enable_wandb).
_ORACLES = ["torchft==0.2.0", "torchdata==0.11.0", "torch_checkpointing==0.1.1", "spmd_types==0.2.3", "tyro",
            "tensorboard", "einops", "datasets>=5"]

setup(
    name="commopt",
    version="0.1.0",
    description="Topology-aware collectives, gradient compression, overlap and in-network "
    "aggregation for PyTorch distributed training",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",
    package_dir={f"commopt.{name}": path for name, path in _FOLDERS.items()},
    packages=[f"commopt.{name}" for name in _FOLDERS] + [f"commopt.{sub}" for sub in _SUBPACKAGES],
    package_data={"commopt.kernels": ["cuda/*.cu"]},
    install_requires=["torch>=2.3", "numpy", "numba", "tqdm"],
    extras_require={
        "mpi": _MPI,
        "cuda12": ["cupy-cuda12x"],
        "cuda13": ["cupy-cuda13x"],
        "plot": _PLOT,
        "lightning": _LIGHTNING,
        "transformers": _TRANSFORMERS,
        "oracles": _ORACLES,
        # expecttest: torch's testing models (torch.testing._internal), which tests/test_tp_torch_oracle.py runs
        "dev": _MPI + _PLOT + _LIGHTNING + _TRANSFORMERS + ["pytest>=7", "pytest-xdist>=3", "ruff", "expecttest"],
    },
    entry_points={"console_scripts": ["commopt-bench = commopt.bench.__main__:main"]},
)
