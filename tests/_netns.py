"""``needs_netns``: the skip marker of the emulated cluster's tests (root and iproute2 required)."""

from __future__ import annotations

import shutil

import pytest

from commopt.bench import cluster as cl

__all__ = ["needs_netns"]


def _have_netns() -> bool:
    with open("/proc/self/status", encoding="ascii") as f:
        caps = cl.parse_cap_eff(f.read())
    return not cl.missing_requirements(caps, shutil.which("ip"), shutil.which("tc"))


needs_netns = pytest.mark.skipif(not _have_netns(),
                                 reason="needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2")
