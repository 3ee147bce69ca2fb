"""``2d`` all-to-all (Tutel-style hierarchical). Needs nodes of equal size.

(0) a local permute that groups the input by the destination's local index, (1) an intra-node
exchange so that local rank j holds everything its node sends to the ranks of local index j (its
rail), (1b) a local permute that groups that by destination node, (2) one inter-node exchange along
the rail, (3) a local permute into source-rank order (permutes by ``kernels.permute_chunks``; when
pipelined, (0) and (3) gather/scatter each chunk's rows so that they overlap the other chunks'
exchanges; skipped where they are the identity). Every rank sends L - 1 + N - 1 messages instead
of N*L - 1, and the same bytes cross the node link as with ``flat``, so it wins where per-message
cost dominates (many ranks per node, small messages). Phases (1)-(2) run through the comm engine
(one role per phase, docs/architecture.md section 3) and are pipelined over chunks (depth from the cost model): chunk
2's intra-node exchange overlaps chunk 1's inter-node one, and alternate chunks use two rail streams so
the node link stays busy while one synchronises.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...kernels import permute_chunks
from ..engine import Phase, all_of, wait_work
from ..links import COPY_BETA, PHASE_HANDOFF, CostModel
from ..topology import Topology
from ._transport import byte_rows, exchange_rows, row_bytes, then_finish
from .base import Algorithm, Call, Traffic
from .roles import A2A_INTER, A2A_INTER_B, A2A_INTRA, A2A_META

__all__ = ["TwoD", "TWO_D"]


class TwoD(Algorithm):
    name = "2d"
    collectives = ("alltoall",)
    needs_uniform = True
    automatic = True
    flat_on_one_level = ("alltoall",)

    def roles(self, topology: Topology) -> tuple[str, ...]:
        return (A2A_INTRA, A2A_INTER, A2A_INTER_B, A2A_META)

    def traffic(self, collective: str, nbytes: float, topology: Topology, *, itemsize: int = 1) -> Traffic:
        """Even splits of ``nbytes`` per rank: (1) to local rank k everything bound for rail k,
        (2) along the rail, to each other node L*S/p."""
        t = Traffic(topology)
        p = topology.world_size
        if p == 1 or not nbytes:
            return t
        share, n_nodes, local = nbytes / p, topology.num_nodes, topology.local_size
        for node in topology.nodes:
            t.all_pairs(node, n_nodes * share)
        for rail in topology.rails:
            t.all_pairs(rail, local * share)
        return t

    def _time(self, model: CostModel, nbytes: float, topology: Topology, chunks: int) -> float:
        """A local permute (one copy), then per chunk (1) the intra-node exchange of (L-1)/L of the
        chunk in L-1 messages plus the permute between the phases, (2) the inter-node exchange along
        the rail in N-1 messages, all rails sharing the node link; the chunks pipeline, so the time
        is the sum of the stages plus (chunks-1) times the slower one; then the final permute."""
        n, local = topology.num_nodes, topology.local_size
        c = nbytes / chunks
        intra = model.intra.time((local - 1) / local * c, local - 1) + c * COPY_BETA if local > 1 else 0.0
        inter = model.inter.time(self.link_bytes("alltoall", c, topology), n - 1) if n > 1 else 0.0
        handoffs = 2 * chunks * PHASE_HANDOFF if chunks > 1 else 0.0  # a blocking single chunk runs inline
        return 2 * nbytes * COPY_BETA + intra + inter + (chunks - 1) * max(intra, inter) + handoffs

    def cost(self, model: CostModel, collective: str, nbytes: float, topology: Topology) -> float:
        if topology.world_size == 1 or not nbytes:
            return 0.0
        return self._time(model, nbytes, topology, self.chunks(model, collective, nbytes, topology))

    def chunks(self, model: CostModel, collective: str, nbytes: float, topology: Topology) -> int:
        """The depth (1..``model.chunks``) predicted fastest: more chunks hide the intra-node phase,
        each costs N-1 + L-1 more messages."""
        return min(range(1, max(1, model.chunks) + 1), key=lambda k: (self._time(model, nbytes, topology, k), k))

    def all_to_all(self, call: Call) -> torch.futures.Future:
        return _two_d(call)


def _part(rows: int, c: int, chunks: int) -> int:
    """Rows of pipeline chunk ``c`` of a block of ``rows`` rows: [rows*c//chunks, rows*(c+1)//chunks)."""
    return rows * (c + 1) // chunks - rows * c // chunks


def _two_d(call: Call) -> torch.futures.Future:
    """Submit the 2-D phases; see the module docstring for why each exists."""
    p, src, args, topo = call.prepared, call.src, call.args, call.topology
    out_work = p.work.view(p.tensor.shape)  # the contiguous output
    chunks, timeout, blocking = call.chunks, call.timeout, call.blocking
    nodes, world = topo.nodes, topo.world_size
    n_nodes, local = topo.num_nodes, topo.local_size
    me_local = topo.local_rank
    ins, outs = args.in_splits, args.out_splits
    node_of = {r: k for k, nd in enumerate(nodes) for r in nd}
    rails = topo.rails  # rail j's members in rail-group order (torch orders a new group's ranks by rank)
    my_rail = rails[me_local]
    # One role per phase (the engine refuses a queue with two feeders); created in this order on
    # every rank, whatever the splits, so group creation never diverges.
    intra_g = call.groups(A2A_INTRA).intra
    # Two rail streams, alternating chunks: while one synchronises with its rail peer (or scatters
    # its chunk), the other keeps the node link busy (NCCL runs several channels for the same reason).
    inter_gs = [call.groups(role).rail for role in (A2A_INTER, A2A_INTER_B)]
    meta_g = call.groups(A2A_META).intra  # used on the caller's thread only

    # m[s][q]: rows local peer s sends to my_rail[q]; known locally for even splits.
    if args.even:
        m = [[ins[0]] * n_nodes for _ in range(local)]
    else:
        send = torch.tensor([[ins[d] for d in rails[j]] for j in range(local)], dtype=torch.int64)
        recv = torch.empty_like(send)
        wait_work(dist.all_to_all_single(recv, send, group=meta_g, async_op=True), timeout, "all_to_all/2d/meta")
        m = recv.tolist()

    rb = row_bytes(src)
    src_b, out_b = byte_rows(src), byte_rows(out_work)
    in_off = [sum(ins[:d]) for d in range(world)]
    out_off = [sum(outs[:i]) for i in range(world)]
    # (0)'s order: destination local index j, then rail position; (3)'s: what lands from rail
    # position q is from local index s of q's node.
    dests = [d for j in range(local) for d in rails[j]]
    src_of = [nodes[node_of[my_rail[q]]][s] for q in range(n_nodes) for s in range(local)]
    pos_in_buf = {r: k for k, r in enumerate(src_of)}
    # Node-by-node placement: (0) and/or (3) are the identity for one chunk, and the data is sent
    # from the input or lands in the output directly.
    send_direct = chunks == 1 and dests == list(range(world))
    recv_direct = chunks == 1 and src_of == list(range(world))
    staged = src_b if send_direct else torch.empty_like(src_b)
    landing = out_b if recv_direct else src_b.new_empty((sum(outs), rb))

    def gather(a: torch.Tensor, c: int) -> None:
        """(0) for chunk c: with one chunk a permute kernel; pipelined, chunk c's rows of every block
        (one concatenation), so that chunk c+1's gather overlaps chunk c's exchanges."""
        if chunks == 1:
            permute_chunks(src_b, ins, dests, out=a)
        else:
            torch.cat([src_b.narrow(0, in_off[d] + ins[d] * c // chunks, _part(ins[d], c, chunks))
                       for d in dests], out=a)

    def scatter(r: torch.Tensor, c: int) -> None:
        """(3) for chunk c: into source-rank order; pipelined, each block to its rows of the output
        right after chunk c's rail exchange, overlapping the later chunks' intra-node exchange."""
        if chunks == 1:
            permute_chunks(r, [outs[i] for i in src_of], [pos_in_buf[i] for i in range(world)], out=out_b)
            return
        k = 0
        for i in src_of:
            n = _part(outs[i], c, chunks)
            if n:
                out_b.narrow(0, out_off[i] + outs[i] * c // chunks, n).copy_(r.narrow(0, k, n))
            k += n

    order1 = [s * n_nodes + q for q in range(n_nodes) for s in range(local)]
    futures = []
    a_off = r_off = 0
    for c in range(chunks):
        send1 = [sum(_part(ins[d], c, chunks) for d in rails[j]) for j in range(local)]
        mc = [[_part(m[s][q], c, chunks) for q in range(n_nodes)] for s in range(local)]
        recv1 = [sum(row) for row in mc]
        send2 = [sum(mc[s][q] for s in range(local)) for q in range(n_nodes)]
        recv2 = [sum(_part(outs[src_of[q * local + s]], c, chunks) for s in range(local)) for q in range(n_nodes)]
        a = staged[a_off:a_off + sum(send1)]
        r = landing[r_off:r_off + sum(recv2)]
        a_off += sum(send1)
        r_off += sum(recv2)
        b = src_b.new_empty((sum(recv1), rb))
        mid = src_b.new_empty((sum(recv1), rb))
        sizes1 = [mc[s][q] for s in range(local) for q in range(n_nodes)]

        def intra(a=a, b=b, recv1=recv1, send1=send1):
            return exchange_rows(b, a, recv1, send1, intra_g, timeout)

        def regroup(b=b, mid=mid, sizes1=sizes1):
            permute_chunks(b, sizes1, order1, out=mid)

        inter_g = inter_gs[c % 2]

        def inter(mid=mid, r=r, recv2=recv2, send2=send2, inter_g=inter_g):
            return exchange_rows(r, mid, recv2, send2, inter_g, timeout)

        # Local phases run inline: "gather" on the submitting thread (chunk c+1's gather overlaps
        # chunk c's exchanges), "regroup" on the intra-node worker, "scatter" on the rail worker.
        phases = [] if send_direct else [Phase("gather", lambda a=a, c=c: gather(a, c))]
        phases += [
            Phase("intra", intra, intra_g),
            Phase("regroup", regroup),
            Phase("inter", inter, inter_g),
        ]
        if not recv_direct:
            phases.append(Phase("scatter", lambda r=r, c=c: scatter(r, c)))
        futures.append(call.engine.submit(phases, op="all_to_all/2d", device=src.device,
                                       blocking=blocking and chunks == 1))
    return then_finish(all_of(futures, None), p)


TWO_D = TwoD()
