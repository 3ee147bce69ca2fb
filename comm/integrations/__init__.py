"""commopt.comm.integrations: thin adapters for the frameworks people train with (docs/architecture.md section 5.6).

Each submodule imports its framework only when it is itself imported, so importing this package
costs nothing and never fails because a framework is missing:

- ``commopt.comm.integrations.lightning``: :class:`CommHookCallback` for PyTorch Lightning
  (``pip install commopt[lightning]``).
- ``commopt.comm.integrations.transformers``: :class:`CommHookCallback` for the Hugging Face
  ``Trainer`` (``pip install commopt[transformers]``).
- ``commopt.comm.integrations.torchtitan``: :func:`parallelize`, a ``ModelSpec.parallelize_fn``
  that runs torchtitan's own and then registers commopt's FSDP2 comms on the modules it sharded
  (``pip install torchtitan``; see docs/frameworks.md).

Lightning's and the Trainer's register :func:`commopt.comm.hooks.allreduce_hook` once the framework
has wrapped the model in ``DistributedDataParallel``, on any device, build the state's topology only
once the process group exists, and keep every rank's hook state (error-feedback residuals, warm
starts) with the framework's checkpoints, so a resumed run continues bit-identically
(docs/faults.md row 18).
"""

from __future__ import annotations

__all__: list[str] = []
