"""The links of an emulated cluster (:class:`Fabric`) and the command-line grammar that gives them.

Two fabrics (docs/architecture.md, "synthesized collectives"; ``commopt.comm.links.LinkMap`` is the
ranks' view of the same thing, in bytes/s):

- **star**: every node has one port to a bridge, ``up[i]`` bit/s out of node i and ``down[i]`` bit/s
  into it (``--link-rate R``: all alike; ``--link-rates R0,R1,..``: one per node, both directions;
  ``--up-rates`` / ``--down-rates``: one direction). A transfer i -> j crosses i's up and j's down
  shaper, and transfers through one port share its rate.
- **mesh** (direct connect): one link per node pair, each direction shaped on its own
  (``--fabric mesh --pair-rates 0-1:200mbit,1-2:200mbit,0-2:50mbit``; ``I-J:R`` is both directions,
  ``I>J:R`` one). Every pair needs a link: gloo connects every pair of ranks directly (its
  rendezvous, barrier and all-reduce), and the nodes do not forward, so a pair without a link would
  hang the first collective instead of being relayed.

Rates are integers in bit/s, the one value both tc and the ranks get. Importing this module imports no
torch (the probe agent runs inside this package in every node).
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["Fabric", "parse_fabric", "parse_pair_rates", "parse_rate", "parse_rates"]

_PAIR_RE = re.compile(r"^\s*(\d+)\s*([->])\s*(\d+)\s*:\s*(\S+)\s*$")


def parse_rate(text: str) -> int:
    """Parse a link rate such as ``"200mbit"`` or ``"1gbit"`` into bit/s, as an integer.

    The grammar is ``commopt.comm.topology.parse_rate``'s (tc's units: ``bit``/``kbit``/``mbit``/
    ``gbit``/``tbit`` are bits per second, powers of 1000; ``bps``/``kbps``/``mbps``/``gbps`` are
    *bytes* per second; a bare number is bit/s), rounded here to the one integer that both tc and the
    ranks (``COMMOPT_LINK_RATE_BPS``, ``COMMOPT_LINK_MAP``) get, so that they agree.

    Args:
        text: the rate as given on the command line.

    Returns:
        The rate in bit/s, a positive integer.

    Raises:
        ValueError: the text is not a positive rate.
    """
    # Imported here: commopt.comm imports torch, which importing this package (the probe agent
    # runs inside it) must not pay for.
    from commopt.comm.topology import parse_rate as bits_per_second

    value = int(round(bits_per_second(text)))
    if value <= 0:  # e.g. "0.4bit": positive, but no rate tc can shape
        raise ValueError(f"link rate must be positive, got {text!r}")
    return value


def parse_rates(text: str, option: str, nodes: int) -> list[int]:
    """One rate per node from ``"R0,R1,.."`` (``--link-rates``, ``--up-rates``, ``--down-rates``).

    Raises:
        ValueError: naming ``option``, when an item is not a rate or the count is not ``nodes``.
    """
    items = text.split(",")
    rates = []
    for k, item in enumerate(items):
        try:
            rates.append(parse_rate(item))
        except ValueError as e:
            raise ValueError(f"{option}: item {k} ({item.strip()!r}, node {k}): {e}") from None
    if len(rates) != nodes:
        raise ValueError(f"{option} gives {len(rates)} rate(s) for {nodes} node(s): give one per node, in node "
                         f"order, e.g. {option} {','.join(['200mbit'] * max(nodes - 1, 0) + ['50mbit'])}")
    return rates


def parse_pair_rates(text: str, nodes: int) -> dict[tuple[int, int], int]:
    """The directed links of ``--pair-rates``: ``I-J:RATE`` (both directions) or ``I>J:RATE`` (i to j).

    Args:
        text: comma-separated items, e.g. ``"0-1:200mbit,1-2:200mbit,0-2:50mbit"``.
        nodes: the number of nodes; node indices are 0..nodes-1.

    Returns:
        ``{(i, j): bit/s}``, one entry per direction given.

    Raises:
        ValueError: an item that does not parse, names a node that does not exist or the same node
            twice, or gives a direction a second time.
    """
    pairs: dict[tuple[int, int], int] = {}
    for item in text.split(","):
        match = _PAIR_RE.match(item)
        if match is None:
            raise ValueError(f"--pair-rates: cannot parse {item.strip()!r}: write I-J:RATE for both directions "
                             f"or I>J:RATE for one, e.g. 0-1:200mbit,0>2:50mbit")
        i, sep, j, rate_text = int(match[1]), match[2], int(match[3]), match[4]
        for node in (i, j):
            if node >= nodes:
                raise ValueError(f"--pair-rates: {item.strip()!r} names node {node}, but --nodes {nodes} has nodes "
                                 f"0..{nodes - 1}")
        if i == j:
            raise ValueError(f"--pair-rates: {item.strip()!r} links node {i} to itself: inside a node ranks talk "
                             f"over loopback; give pairs of two nodes")
        try:
            rate = parse_rate(rate_text)
        except ValueError as e:
            raise ValueError(f"--pair-rates: {item.strip()!r}: {e}") from None
        for key in [(i, j)] if sep == ">" else [(i, j), (j, i)]:
            if key in pairs:
                raise ValueError(f"--pair-rates: the link {key[0]}->{key[1]} is given twice ({item.strip()!r} "
                                 f"again): give each direction once")
            pairs[key] = rate
    return pairs


def parse_fabric(nodes: int, *, fabric: str = "star", link_rate: str | None = None, link_rates: str | None = None,
                 up_rates: str | None = None, down_rates: str | None = None,
                 pair_rates: str | None = None) -> Fabric:
    """The fabric the cluster options describe (each argument the option's text, or None when not given).

    A star takes ``--link-rate`` (every node, both directions; 1gbit when nothing is given) or
    ``--link-rates`` (one per node), then ``--up-rates`` / ``--down-rates`` replace one direction. A
    mesh takes ``--pair-rates`` alone.

    Raises:
        ValueError: saying which option is wrong and what to give instead.
    """
    star_options = [opt for opt, v in (("--link-rate", link_rate), ("--link-rates", link_rates),
                                       ("--up-rates", up_rates), ("--down-rates", down_rates)) if v is not None]
    if fabric == "mesh":
        if star_options:
            raise ValueError(f"--fabric mesh has no ports to shape with {', '.join(star_options)}: give every node "
                             "pair's rate instead, e.g. --pair-rates 0-1:200mbit,1-2:200mbit,0-2:50mbit")
        if pair_rates is None:
            raise ValueError("--fabric mesh needs --pair-rates with a rate for every node pair, e.g. "
                             "--pair-rates 0-1:200mbit,1-2:200mbit,0-2:50mbit")
        return Fabric.mesh(nodes, parse_pair_rates(pair_rates, nodes))
    if fabric != "star":
        raise ValueError(f"--fabric must be star or mesh, got {fabric!r}")
    if pair_rates is not None:
        raise ValueError("--pair-rates gives the links of a direct-connect mesh: add --fabric mesh (or give a star's "
                         "rates per node with --link-rates)")
    if link_rate is not None and link_rates is not None:
        raise ValueError("give --link-rate (every node alike) or --link-rates (one per node), not both")
    base = parse_rates(link_rates, "--link-rates", nodes) if link_rates is not None else \
        [parse_rate(link_rate if link_rate is not None else "1gbit")] * nodes
    up = parse_rates(up_rates, "--up-rates", nodes) if up_rates is not None else base
    down = parse_rates(down_rates, "--down-rates", nodes) if down_rates is not None else base
    return Fabric.star(up, down)


@dataclasses.dataclass(frozen=True)
class Fabric:
    """The configured links of an emulated cluster, in bit/s (see the module).

    Attributes:
        kind: ``"star"`` or ``"mesh"``.
        nodes: the number of nodes.
        up: star: what node i sends, bit/s (its own end of its veth is shaped at it).
        down: star: what node i receives, bit/s (the bridge's end of its veth).
        pairs: mesh: ``(i, j, bit/s)`` per directed link i -> j (node i's end of the pair's veth),
            sorted; every ordered pair of nodes has one.
    """

    kind: str
    nodes: int
    up: tuple[int, ...] = ()
    down: tuple[int, ...] = ()
    pairs: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("star", "mesh"):
            raise ValueError(f"fabric kind must be 'star' or 'mesh', got {self.kind!r}")
        if self.nodes < 1:
            raise ValueError(f"a fabric needs at least one node, got {self.nodes}")
        rates = self.up + self.down + tuple(r for *_, r in self.pairs)
        if any(int(r) != r or r <= 0 for r in rates):
            raise ValueError(f"link rates must be positive integers of bit/s, got {rates}")
        if self.kind == "star":
            if len(self.up) != self.nodes or len(self.down) != self.nodes or self.pairs:
                raise ValueError(f"a star of {self.nodes} node(s) needs {self.nodes} up and down rates and no pairs, "
                                 f"got up={self.up}, down={self.down}, pairs={self.pairs}")
            return
        if self.up or self.down:
            raise ValueError("a mesh has pair rates only, no per-node up or down rates")
        if self.nodes < 2:
            raise ValueError("a mesh needs at least 2 nodes: its links join node pairs")
        seen = [(i, j) for i, j, _ in self.pairs]
        wrong = [(i, j) for i, j in seen if not (0 <= i < self.nodes and 0 <= j < self.nodes and i != j)]
        if wrong or len(set(seen)) != len(seen):
            raise ValueError(f"mesh links must join two of the nodes 0..{self.nodes - 1}, each direction once; "
                             f"got {seen}")
        missing = [f"{i}->{j}" for i in range(self.nodes) for j in range(self.nodes)
                   if i != j and (i, j) not in set(seen)]
        if missing:
            raise ValueError(f"the mesh has no link {', '.join(missing)}: every node pair needs one, both ways. "
                             "gloo connects every pair of ranks directly (rendezvous, barrier, its own all-reduce) "
                             "and the nodes do not forward, so a missing link would hang the run; add e.g. "
                             f"--pair-rates ...,{missing[0].replace('->', '-')}:50mbit")

    @classmethod
    def star(cls, up: list[int], down: list[int] | None = None) -> Fabric:
        """A star of per-node port rates in bit/s (``down`` None: the same as ``up``)."""
        return cls("star", len(up), tuple(int(r) for r in up), tuple(int(r) for r in (up if down is None else down)))

    @classmethod
    def uniform(cls, nodes: int, rate_bps: int) -> Fabric:
        """Today's cluster: a star whose every port runs at ``rate_bps`` both ways."""
        return cls.star([int(rate_bps)] * nodes)

    @classmethod
    def mesh(cls, nodes: int, pairs: dict[tuple[int, int], int]) -> Fabric:
        """A direct-connect mesh, ``pairs[(i, j)]`` bit/s from i to j (every ordered pair)."""
        return cls("mesh", nodes, pairs=tuple(sorted((int(i), int(j), int(r)) for (i, j), r in pairs.items())))

    def rate(self, i: int, j: int) -> int:
        """bit/s from node i to node j alone on the fabric (a star: the slower of i's up and j's down)."""
        if self.kind == "star":
            return min(self.up[i], self.down[j])
        return next(r for a, b, r in self.pairs if (a, b) == (i, j))

    @property
    def uniform_links(self) -> bool:
        """Every port (star) or every directed link (mesh) has the same rate."""
        return len(set(self.up + self.down + tuple(r for *_, r in self.pairs))) <= 1

    @property
    def slowest(self) -> int:
        """The slowest configured rate, bit/s: what a collective over every node is bound by
        (``COMMOPT_LINK_RATE_BPS``)."""
        return min(self.up + self.down + tuple(r for *_, r in self.pairs))

    def directed(self) -> list[tuple[int, int]]:
        """Every directed node pair, ``(i, j)`` in order: each is a link to probe."""
        return [(i, j) for i in range(self.nodes) for j in range(self.nodes) if i != j]

    def configured(self) -> dict[str, int]:
        """``{"n<i>->n<j>": bit/s}`` for every directed pair, the names the probe reports under."""
        return {f"n{i}->n{j}": self.rate(i, j) for i, j in self.directed()}

    def link_map(self) -> dict | None:
        """``commopt.comm.links.LinkMap.to_dict()`` of these links in bytes/s (``COMMOPT_LINK_MAP``), or
        None for a star whose ports are all alike: today's cluster, whose ranks' environment stays as
        it was. A mesh always has one: nothing else tells the ranks that its links are independent."""
        if self.kind == "star" and self.uniform_links:
            return None
        from commopt.comm.links import LinkMap  # torch: see parse_rate

        if self.kind == "star":
            return LinkMap.star([r / 8 for r in self.up], [r / 8 for r in self.down]).to_dict()
        return LinkMap.mesh(self.nodes, {(i, j): r / 8 for i, j, r in self.pairs}).to_dict()

    def describe(self) -> str:
        """One line for the launcher's banner, rates in Mbit/s."""
        if self.kind == "star":
            if self.uniform_links:
                return f"link {self.up[0] / 1e6:g} Mbit/s"
            ports = ", ".join(f"n{i} {u / 1e6:g}" + ("" if u == d else f"/{d / 1e6:g}")
                              for i, (u, d) in enumerate(zip(self.up, self.down)))
            return f"star, ports in Mbit/s (up/down where they differ): {ports}"
        rates = {(i, j): r for i, j, r in self.pairs}
        parts = []
        for i, j, r in self.pairs:
            if i < j and rates[(j, i)] == r:
                parts.append(f"{i}-{j} {r / 1e6:g}")
            elif i < j or rates[(j, i)] != r:
                parts.append(f"{i}>{j} {r / 1e6:g}")
        return f"mesh, links in Mbit/s: {', '.join(parts)}"
