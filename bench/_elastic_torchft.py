"""torchft's DiLoCo in ``commopt-bench elastic``: its Lighthouse outside the nodes, and the worker of a
``torchft-<scenario>`` run (issue 39: "torchft's DiLoCo runs beside it on the same schedule").

The run is the same ``commopt-bench cluster --elastic`` job as commopt's elastic DiLoCo (one world per
node, node 2 killed, stopped or cut off and restarted), with torchft in place of commopt:

- the Lighthouse runs where commopt's coordinator runs, in the coordinator's namespace, outside every node
  (``commopt-bench cluster --coordinator-command``, which starts :func:`main` with the coordinator's
  ``--host``, ``--port``, ``--heartbeat-timeout`` and ``--min-replicas``); the ranks reach it at
  ``http://$COMMOPT_COORDINATOR``;
- each node's rank (:func:`worker`) has a ``torchft.Manager`` of its own one-rank replica group (replica id
  = the node, a ``TCPStore`` for that group on the node's fabric address, ``ProcessGroupGloo`` across the
  replicas), torchft's ``DiLoCo`` (``torchft.local_sgd``, one fragment, synchronous quorum as it requires)
  on the same GPT, tokens, inner AdamW and outer Nesterov SGD (lr 0.7, momentum 0.9: commopt's default),
  and writes the JSON lines ``commopt-bench elastic``'s worker writes.

What torchft does, as its source says (``local_sgd.py``, ``manager.py``): every H inner steps, inside the
inner optimizer's step, a quorum at the Lighthouse, the all-reduce of the pseudo-gradients over the
quorum's gloo group, then ``should_commit``; a failed reduction makes the replica restore the last global
weights: its round of H inner steps is thrown away and trained again (``steps_lost``). A restarted replica
trains a first round from its initial weights, then at its first quorum heals: it downloads a peer's
state (the model and inner optimizer, registered here as torchft's own DiLoCo test trainer does, and
DiLoCo's global weights and outer optimizer) over HTTP; that round of its own is discarded.

Two things the emulated cluster needs of torchft, both only addresses: every node shares the host's
hostname (no UTS namespace), which torchft advertises by default, so the Manager gets ``hostname=`` the
node's fabric address and the checkpoint server :class:`_NodeHTTPTransport` advertises that address too.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from .coordinator import stop_on_signals

__all__ = ["main", "problem", "worker", "QUORUM_TIMEOUT_S", "JOIN_TIMEOUT_S"]

#: torchft's timeouts (collectives, quorum, connections): commopt's elastic worker's ``timeout``.
QUORUM_TIMEOUT_S = 60.0
#: The Lighthouse's join timeout: the setting torchft's README starts it with.
JOIN_TIMEOUT_S = 10.0


def problem(codec: str, steps: int, sync_every: int) -> str | None:
    """Why torchft's runs cannot run with these options here (the reason to print instead of a row), or None."""
    try:
        import torchft  # noqa: F401
        from torchft.local_sgd import DiLoCo  # noqa: F401
    except ImportError as exc:
        return f"torchft is not importable ({exc}); pip install torchft (0.2.0 runs on CPU with gloo)"
    if codec != "none":
        return ("torchft's quantized all-reduce runs Triton kernels on CUDA (torchft#209, #203); on CPU/gloo its "
                "DiLoCo(should_quantize=True) sends fp32 without a word (manager.py: `should_quantize and "
                "IS_TRITON_AVAILABLE`), so its runs are exact only (--codec none)")
    if steps % sync_every:
        return (f"torchft counts committed outer steps (its Manager's step), so a run ends on an outer sync: --steps "
                f"({steps}) must be a multiple of --sync-every ({sync_every})")
    return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m commopt.bench._elastic_torchft",
                                description="torchft's Lighthouse, with commopt-bench coordinator's options "
                                            "(commopt-bench cluster --coordinator-command)")
    p.add_argument("--host", required=True, help="the address to bind (the coordinator's)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--heartbeat-timeout", type=float, default=5.0,
                   help="seconds without a heartbeat after which the Lighthouse drops a replica")
    p.add_argument("--min-replicas", type=int, default=1, help="the fewest replicas a quorum may have")
    p.add_argument("--join-timeout", type=float, default=JOIN_TIMEOUT_S,
                   help="seconds a quorum that could form waits for heartbeating replicas that have not asked to join "
                        f"(default {JOIN_TIMEOUT_S:g}: torchft's README's torchft_lighthouse --join_timeout_ms 10000; "
                        "its Python LighthouseServer's own default, 0.1 s, leaves a replica that asks 0.1 s after the "
                        "first out of the quorum)")
    p.add_argument("--initial-replicas", type=int, default=None,
                   help="accepted for the cluster; the Lighthouse waits for every heartbeating replica instead")
    p.add_argument("--job", default=None, help="accepted for the cluster; the Lighthouse serves one job")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run torchft's Lighthouse until SIGTERM/SIGINT; print ``{"address": "http://host:port", ...}`` once it serves.

    Returns:
        0; 2 when the Lighthouse cannot start (the reason printed).
    """
    args = _parser().parse_args(argv)
    stop = stop_on_signals()
    try:
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(bind=f"{args.host}:{args.port}", min_replicas=args.min_replicas,
                                      join_timeout_ms=int(args.join_timeout * 1000),
                                      heartbeat_timeout_ms=int(args.heartbeat_timeout * 1000))
    except Exception as e:  # ImportError, or the Rust server's bind error (a RuntimeError)
        print(f"torchft lighthouse: error: {e}", flush=True)
        return 2
    try:
        # Its own address() names the host by hostname, which the nodes cannot resolve to this namespace.
        port = int(lighthouse.address().rpartition(":")[2])  # the bound port (--port 0: a free one)
        print(json.dumps({"address": f"http://{args.host}:{port}", "service": "torchft-lighthouse",
                          "pid": os.getpid(), "min_replicas": args.min_replicas,
                          "join_timeout_ms": int(args.join_timeout * 1000),
                          "heartbeat_timeout_ms": int(args.heartbeat_timeout * 1000)}), flush=True)
        while not stop.wait(0.2):
            pass
    finally:
        lighthouse.shutdown()
    return 0


def _node_address(peer: str) -> str:
    """This node's fabric address: the source address of its route to ``peer`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((peer, 1))
        return sock.getsockname()[0]


def _transport_class():
    """torchft's HTTP checkpoint transport, advertising the node's address and counting what it receives."""
    import torch
    from torch.utils._pytree import tree_flatten
    from torchft.checkpointing.http_transport import HTTPTransport

    class _NodeHTTPTransport(HTTPTransport):
        """``HTTPTransport`` whose address names ``host`` (not the hostname every node shares), and that
        counts the tensor bytes and seconds of each checkpoint it receives (a joiner's recovery)."""

        def __init__(self, host: str, timeout: Any) -> None:
            self._host = host
            self.received_bytes = 0
            self.receive_seconds = 0.0
            super().__init__(timeout=timeout, num_chunks=0)

        def address(self) -> str:
            return f"http://{self._host}:{self._server.socket.getsockname()[1]}/checkpoint/"

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: Any) -> Any:
            t0 = time.perf_counter()
            state = super().recv_checkpoint(src_rank, metadata, step, timeout)
            self.receive_seconds += time.perf_counter() - t0
            leaves, _ = tree_flatten(state)
            self.received_bytes += sum(t.nbytes for t in leaves if isinstance(t, torch.Tensor))
            return state

    return _NodeHTTPTransport


def _wait_for_peers(log_dir: str, nodes: int, timeout: float) -> None:
    """Wait until the first process of every node has written its ``ready`` line (its Manager is up and
    heartbeating), at most ``timeout`` seconds.

    The harness's start barrier, the counterpart of commopt's coordinator's ``--initial-replicas``: torchft's
    Lighthouse forms a quorum of the replicas that heartbeat, so a node whose process starts later than the
    others' first round (on 2 shared cores, imports alone take seconds) would miss that round. The nodes of
    the emulated cluster share the host's file system, where the logs are.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = 0
        for node in range(nodes):
            try:
                with open(os.path.join(log_dir, f"node{node}.attempt0.jsonl"), encoding="utf-8") as f:
                    ready += '"event": "ready"' in f.read()
            except FileNotFoundError:
                pass
        if ready == nodes:
            return
        time.sleep(0.05)


def worker(args: argparse.Namespace, node: int, write: Callable[..., None], link_bytes: Callable[[], int],
           held_out: Callable[[Any, argparse.Namespace], float]) -> int:
    """One node's rank of a torchft run: torchft's DiLoCo until its Manager has committed ``steps / H`` outer
    steps, one JSON line per inner step through ``write``.

    Each step line has ``step`` (the steps the run counts at its end: H x the Manager's committed outer steps,
    plus the inner steps of the round in progress: after a discarded round it falls back by H), ``time``,
    ``synced`` (an outer step committed at it), ``discarded`` (an outer sync at it did not commit: the round is
    thrown away). The final line has ``steps`` (H x committed outer steps), ``trained`` (the inner steps this
    process ran), ``committed`` (those of them a committed outer step kept: a round thrown away, or replaced
    by a peer's state when the replica heals, is not), ``discarded`` and ``healed`` (how many rounds),
    ``recovery_bytes`` and ``transfer_seconds`` (the checkpoints a restarted process downloaded: their tensors'
    bytes, not counting HTTP's framing), ``joined`` (``[None, seconds from its begin to its first commit]``
    for a restarted process), ``link_bytes``, on node 0 ``held_out_loss``, and ``error`` (what ended the
    training early, or None).

    Args:
        args: ``commopt-bench elastic``'s options (model, data, H, steps, lr).
        node: this node (``COMMOPT_REPLICA_ID``): the replica id, and the data's seed offset.
        write: writes one JSON line of fields to this process's log.
        link_bytes: bytes on this node's link so far (sent and received).
        held_out: the held-out loss of a model (``commopt-bench elastic``'s, the same batches for every run).

    Returns:
        0; 1 when training ended early (``error``).
    """
    from datetime import timedelta

    import torch
    from torch import nn
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from .cluster.progress import report_step
    from .diloco import _VOCAB
    from .models import GPT, synthetic_tokens

    torch.set_num_threads(1)
    h, attempt = args.sync_every, int(os.environ.get("COMMOPT_RESTART", "0") or 0)
    lighthouse = os.environ["COMMOPT_COORDINATOR"]
    host = _node_address(lighthouse.rpartition(":")[0])
    model = GPT(_VOCAB, args.d_model, args.layers, 4, args.seq_len, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    store = TCPStore(host, 0, 1, is_master=True, wait_for_workers=False)  # this replica group's, reachable
    timeout = timedelta(seconds=QUORUM_TIMEOUT_S)
    transport = _transport_class()(host, timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=2,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]), opt.load_state_dict(state["opt"])),
        state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
        replica_id=str(node), store_addr=host, store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=f"http://{lighthouse}", port=0, hostname=host, use_async_quorum=False,
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout, checkpoint_transport=transport,
        init_sync=False)  # every node builds the same weights (seed 0): torchft's documented setting for it
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    reached = [0]
    # Registered before DiLoCo's own hook, so it runs first: a fault at step 3H lands inside the outer sync.
    hook = opt.register_step_post_hook(lambda *_: report_step(reached[0]))
    diloco = DiLoCo(manager, [model], opt, outer, sync_every=h, backup_device=torch.device("cpu"), pin_memory=False,
                    use_bucketization=True)
    if not attempt:  # every first process's Manager heartbeats before any trains: see _wait_for_peers
        write(event="ready", time=time.time())
        _wait_for_peers(args.log_dir, int(os.environ.get("COMMOPT_NUM_REPLICAS", "1")), QUORUM_TIMEOUT_S)
    target, trained, committed, in_round, discarded, healed, joined = args.steps // h, 0, 0, 0, 0, 0, None
    error = None
    begin = time.time()
    write(event="begin", time=begin, steps=manager.current_step() * h, attempt=attempt)
    link0 = link_bytes()
    with diloco:
        try:
            while manager.current_step() < target:
                before = manager.current_step()
                reached[0] = before * h + in_round + 1
                data = synthetic_tokens(args.batch, args.seq_len, _VOCAB, seed=10_000 * reached[0] + node)
                opt.zero_grad(set_to_none=True)
                logits = model(data[:, :-1])
                nn.functional.cross_entropy(logits.reshape(-1, _VOCAB), data[:, 1:].reshape(-1)).backward()
                opt.step()  # torchft's DiLoCo syncs inside it, every H inner steps
                trained += 1
                in_round = (in_round + 1) % h
                after = manager.current_step()
                synced = in_round == 0 and after > before
                discarded += in_round == 0 and not synced
                if synced and after == before + 1:
                    committed += h
                elif synced:  # healed: a peer's state (and step) replaced this process's round
                    healed += 1
                    if attempt and joined is None:
                        joined = time.time() - begin
                write(step=after * h + in_round, time=time.time(), synced=synced, redone=0,
                      discarded=in_round == 0 and not synced)
        except Exception as e:  # e.g. a joiner's quorum that never formed (the others had finished): said, not hidden
            error = f"{type(e).__name__}: {e}"
    link = link_bytes() - link0
    hook.remove()
    loss = held_out(model, args) if node == 0 else None
    write(event="final", time=time.time(), steps=manager.current_step() * h, trained=trained, committed=committed,
          discarded=discarded, healed=healed, redone=0, recovery_bytes=transport.received_bytes if attempt else None,
          transfer_seconds=transport.receive_seconds if attempt else None,
          joined=[None, joined] if joined is not None else None, link_bytes=link, held_out_loss=loss, error=error)
    manager.shutdown(wait=False)
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main())
