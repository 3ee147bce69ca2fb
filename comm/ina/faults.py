"""Seeded network faults for the in-network aggregation protocol: loss, bursts, duplication, reordering.

Faults are injected in the worker's send path (worker -> switch) and receive path (switch -> worker),
one independent channel per direction, each driven by its own ``random.Random`` seeded from
``(seed, salt, direction)``. So a failing run replays exactly: the same seed and worker id drop the
same packets in the same order, whatever the timing (the decision for the k-th packet depends only on
k, never on the clock).

Bursts follow a Gilbert-Elliott model: in the good state a packet starts a burst with probability
``burst_start``; in a burst every packet is lost, and the burst ends after each packet with probability
``1 / burst_length`` (so bursts last ``burst_length`` packets on average). Independent loss
(``loss``) applies on top in the good state.

Reordering holds a packet back and releases it after the next one; duplication sends or delivers a
packet twice. ``drop_once`` names packets (type, round, chunk) lost the first time they cross the
receive path, which is how a test loses exactly one result packet.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from .protocol import HEADER_SIZE, unpack_header

__all__ = ["LinkFaults", "FaultConfig", "FaultInjector"]


@dataclass(frozen=True)
class LinkFaults:
    """Faults on one direction of the link.

    Args:
        loss: probability that a packet is dropped.
        duplicate: probability that a packet is delivered twice.
        reorder: probability that a packet is held back and delivered after the next one.
        burst_start: probability that a packet starts a loss burst.
        burst_length: mean burst length in packets.
    """

    loss: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    burst_start: float = 0.0
    burst_length: float = 8.0

    def __post_init__(self) -> None:
        for name in ("loss", "duplicate", "reorder", "burst_start"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"LinkFaults.{name}={v} must be in [0, 1)")
        if self.burst_length < 1.0:
            raise ValueError(f"LinkFaults.burst_length={self.burst_length} must be >= 1 packet")

    @property
    def active(self) -> bool:
        return bool(self.loss or self.duplicate or self.reorder or self.burst_start)


@dataclass(frozen=True)
class FaultConfig:
    """Faults for one worker: ``send`` is worker -> switch, ``recv`` is switch -> worker.

    Args:
        seed: base seed; combined with the worker's salt (its id) and the direction.
        send: faults on packets the worker sends.
        recv: faults on packets the worker receives.
        drop_once: (packet type, round, chunk) triples lost the first time they are received.
    """

    seed: int = 0
    send: LinkFaults = field(default_factory=LinkFaults)
    recv: LinkFaults = field(default_factory=LinkFaults)
    drop_once: tuple[tuple[int, int, int], ...] = ()


class _Channel:
    """One direction: decides, packet by packet, what gets through."""

    def __init__(self, faults: LinkFaults, rng: random.Random):
        self.faults = faults
        self.rng = rng
        self.in_burst = False
        self.held: list[bytes] = []
        self.dropped = 0
        self.duplicated = 0
        self.reordered = 0

    def process(self, packet: bytes) -> list[bytes]:
        f, rng = self.faults, self.rng
        # Draw every random number for every packet, so one fault does not shift the others' stream.
        u_burst, u_loss, u_dup, u_reorder = rng.random(), rng.random(), rng.random(), rng.random()
        if self.in_burst:
            if u_burst < 1.0 / f.burst_length:
                self.in_burst = False
            self.dropped += 1
            return self._release([])
        if u_burst < f.burst_start:
            self.in_burst = True
            self.dropped += 1
            return self._release([])
        if u_loss < f.loss:
            self.dropped += 1
            return self._release([])
        out = [packet, packet] if u_dup < f.duplicate else [packet]
        self.duplicated += len(out) - 1
        if u_reorder < f.reorder:
            self.reordered += 1
            released = self._release([])
            self.held.extend(out)
            return released
        return self._release(out)

    def _release(self, out: list[bytes]) -> list[bytes]:
        if self.held and out:
            out = out + self.held
            self.held = []
        return out


class FaultInjector:
    """Applies a :class:`FaultConfig` to one worker's packets.

    Args:
        config: what to inject.
        salt: distinguishes workers sharing one config (the worker id).
    """

    def __init__(self, config: FaultConfig, salt: int = 0):
        self.config = config
        self._send = _Channel(config.send, random.Random(f"commopt-ina:{config.seed}:{salt}:send"))
        self._recv = _Channel(config.recv, random.Random(f"commopt-ina:{config.seed}:{salt}:recv"))
        self._drop_once = set(config.drop_once)

    @property
    def stats(self) -> dict[str, int]:
        return {"send_dropped": self._send.dropped, "send_duplicated": self._send.duplicated,
                "send_reordered": self._send.reordered, "recv_dropped": self._recv.dropped,
                "recv_duplicated": self._recv.duplicated, "recv_reordered": self._recv.reordered}

    def on_send(self, packet: bytes) -> list[bytes]:
        """The packets to put on the wire now in place of ``packet`` (zero, one or several)."""
        if not self.config.send.active:
            return [packet]
        return self._send.process(packet)

    def on_recv(self, packet: bytes) -> Iterable[bytes]:
        """The packets to deliver now in place of the received ``packet``."""
        if self._drop_once and len(packet) >= HEADER_SIZE:
            h = unpack_header(packet)  # only read: a malformed packet is the receiver's to count
            key = (h.ptype, h.round, h.seq)
            if key in self._drop_once:
                self._drop_once.discard(key)
                self._recv.dropped += 1
                return []
        if not self.config.recv.active:
            return [packet]
        return self._recv.process(packet)
