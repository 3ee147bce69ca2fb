"""``commopt-bench elastic``'s data-parallel worker: one rank of an HSDP node (issue 39, item 4).

Each node of the emulated cluster is its own world of L ranks (``--elastic``); the bench GPT is sharded
with FSDP2 over the node's ranks (``fully_shard`` on every block and the root) and
``ElasticReplicas`` averages the shards' gradients over the nodes of the current generation, rail by
rail. The node's rank 0 writes the same JSON lines as the DiLoCo worker (``bench/elastic.py``): one per
step (``synced``: every data-parallel step is a cross-node reduction), then the final record, so that
``run_record`` computes the same columns.
"""

from __future__ import annotations

import json
import os
import time

__all__ = ["worker"]


def worker(args, link_bytes) -> int:
    """One rank: build, join the job, train ``args.steps`` steps, write the logs (``link_bytes()``: the
    node link's byte counter, ``bench/elastic.py``'s)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from commopt.comm.compression import QuantizeCompressor
    from commopt.schedules import ElasticReplicas

    from .cluster.progress import report_step
    from .diloco import _VOCAB, _held_out
    from .models import GPT, synthetic_tokens

    node = int(os.environ["COMMOPT_REPLICA_ID"])
    attempt = int(os.environ.get("COMMOPT_RESTART", "0") or 0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # the node's own world (RANK, WORLD_SIZE, MASTER_* of the node)
    rank = dist.get_rank()
    model = GPT(_VOCAB, args.d_model, args.layers, 4, args.seq_len, seed=0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    log = open(os.path.join(args.log_dir, f"node{node}.attempt{attempt}.jsonl"), "a", encoding="utf-8") \
        if rank == 0 else None

    def write(**fields) -> None:
        if log is not None:
            log.write(json.dumps(fields) + "\n")
            log.flush()

    t0 = time.monotonic()
    reps = ElasticReplicas(model, opt, min_replicas=2, timeout=60.0,
                           compressor=QuantizeCompressor(8) if args.codec == "int8" else None)
    if attempt > 0:
        joined = [reps.steps, time.monotonic() - t0]  # the step it joined at, the seconds its join took
        write(event="joined", time=time.time(), joined=joined, steps=reps.steps)
    write(event="begin", time=time.time(), steps=reps.steps)
    link0 = link_bytes()
    trained = 0
    for step in range(reps.steps + 1, args.steps + 1):
        data = synthetic_tokens(args.batch, args.seq_len, _VOCAB, seed=10_000 * step + 100 * node + rank)
        opt.zero_grad(set_to_none=True)
        logits = model(data[:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, _VOCAB), data[:, 1:].reshape(-1)).backward()
        trained += 1
        report_step(step)  # after the backward, before the cross-node reduction: a step fault lands in it
        reps.step()
        write(step=reps.steps, time=time.time(), synced=True, redone=reps.replicas.redone)
    link = link_bytes() - link0  # the node's link, over its steps (both ranks share it)
    held_out = _held_out({"model": model}, args)
    received = torch.tensor([reps.replicas.recovery_bytes if attempt > 0 else 0], dtype=torch.int64)
    dist.all_reduce(received)  # every rail carried its rank's shards
    write(event="final", time=time.time(), steps=reps.steps, trained=trained, redone=reps.replicas.redone,
          recovery_bytes=int(received), joined=joined if attempt > 0 else None,
          transfer_seconds=reps.replicas.transfer_seconds, link_bytes=link,
          held_out_loss=held_out if node == 0 else None)
    if log is not None:
        log.close()
    reps.close()
    dist.destroy_process_group()
    return 0
