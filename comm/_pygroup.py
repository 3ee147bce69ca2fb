"""What torch asks of a process group written in Python (commopt's ``"ina"`` backend and the pipeline's
boundary group): its backend's name, and a group name to keep, which torch stores on a C++ group's backends
and a Python group has none of. Without them ``group_name`` raises "ProcessGroup name not set" and
``destroy_process_group(group)`` of a ``new_group(backend=...)`` fails."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["PythonProcessGroup"]


class PythonProcessGroup(dist.ProcessGroup):
    """A ``torch.distributed.ProcessGroup`` subclass whose backend is named :attr:`backend_name`."""

    backend_name = ""

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return self.backend_name

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.backend_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return getattr(self, "_group_name", "")

    def getGroupName(self) -> str:  # noqa: N802 (torch's name)
        return self.group_name
