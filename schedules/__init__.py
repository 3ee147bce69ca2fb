"""commopt.schedules: overlap schedulers, their plans, the autotuner and the iteration simulator.

``OverlapDataParallel`` (docs/architecture.md section 2.1) overlaps gradient reduction with backward and with the next
forward, issuing chunks in an order every rank shares (``plan``, ``priority``); ``profile`` holds
the per-step timings re-planning reads, ``checkpoint`` the format of its per-bucket optimizers'
checkpoint; ``autotune`` picks bucket sizes, partition and credit from measured steps; ``simulator``
predicts iteration time and exposed communication at scales no laptop runs, and the traffic matrix
of each algorithm. ``tensor_parallel`` holds the decomposed tensor-parallel matmuls
(``all_gather_matmul``, ``matmul_reduce_scatter``, ``matmul_all_reduce``): rings of point-to-point
steps on the comm engine, each step's transfer overlapped with the previous block's matmul; and
``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, drop-ins for torch's styles in
``parallelize_module`` plans that run those rings where a collective meets a matmul.
``context_parallel`` holds context parallelism (``ring_attention``, ``ulysses_attention`` and the
zig-zag layout helpers ``zigzag_shard`` / ``zigzag_unshard``): attention over a sequence sharded
across ranks, K/V rotating around a ring of engine phases, or all-to-alls between sequence and heads.
``diloco`` holds ``DiLoCo``, the low-communication outer loop (workers train ``sync_every`` inner steps
alone, then reduce their pseudo-gradients along the rails), and ``worker_group``, the inner loop's group;
``DiLoCo(elastic=True)`` and ``elastic.ElasticReplicas`` (data-parallel replicas) survive a lost node.
"""

from __future__ import annotations

from . import checkpoint, context_parallel, plan, priority, profile, simulator, tensor_parallel
from .autotune import TuneConfig, TuneResult, autotune
from .context_parallel import ring_attention, ulysses_attention, zigzag_shard, zigzag_unshard
from .diloco import DiLoCo, worker_group, worker_topology
from .elastic import ElasticReplicas
from .overlap import OverlapDataParallel
from .plan import BucketPlan, IssuePlan, broadcast_plan, build_buckets
from .priority import credit_for, fifo_plan, partition_for, priority_plan
from .profile import StepProfile
from .simulator import Layer, Schedule, simulate, traffic_matrix
from .tensor_parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    all_gather_matmul,
    matmul_all_reduce,
    matmul_reduce_scatter,
)

__all__ = ["OverlapDataParallel", "StepProfile", "autotune", "TuneConfig", "TuneResult", "BucketPlan", "IssuePlan",
           "build_buckets", "broadcast_plan", "fifo_plan", "priority_plan", "partition_for", "credit_for", "Layer",
           "Schedule", "simulate", "traffic_matrix", "plan", "priority", "simulator", "profile", "checkpoint",
           "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "tensor_parallel", "ColwiseParallel",
           "RowwiseParallel", "SequenceParallel",
           "ring_attention", "ulysses_attention", "zigzag_shard", "zigzag_unshard", "context_parallel",
           "DiLoCo", "worker_group", "worker_topology", "diloco", "ElasticReplicas"]
