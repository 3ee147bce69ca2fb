"""Pipeline parallelism across slow links: GPipe and 1F1B, one stage per rank, on commopt's boundary
channel (docs/architecture.md section 5.5d; the channel: ``commopt.comm.pipeline``).

``PipelineSchedule(stage_module, n_microbatches=, loss_fn=)`` is called like torch's
``Schedule1F1B``: the first stage passes the batch, the last the targets, every stage calls
``step()`` once per batch; gradients accumulate in the stage's parameters (divided by the number of
micro-batches, as torch's ``scale_grads=True``) and the optimizer step is the caller's.

Why not torch's schedule: its single-stage 1F1B posts the receive of the next forward only after the
backward and then waits for it, and gloo's point-to-point moves nothing before the receive is posted,
so one boundary transfer sits on the critical path per micro-batch. Here every receive is posted
``depth`` micro-batches ahead, sends never block, and a stage runs ``extra`` more warm-up forwards per
boundary downstream than torch's ``num_stages - stage``: with one micro-batch more in flight across
each boundary, the activation of micro-batch k + 1 and the gradient of k travel while the stages
compute, up to a transfer of ``extra * (forward + backward) / 2`` (posting early alone does not hide
them: the exposure sits on 1F1B's dependency cycle between neighbouring stages; one extra on every
stage alike would hide only the last boundary's, as the simulator shows: ``schedules/_sim_pipeline.py``).
The cost is ``extra`` more stored activations per boundary downstream of a stage.

Without a codec the arithmetic is torch's: the same micro-batches (torch's own splitting), the same
forward and backward calls, gradients accumulated in ascending micro-batch order, so the parameters'
gradients equal torch's ``ScheduleGPipe`` / ``Schedule1F1B`` and single-process micro-batched
training bit for bit. With a codec, they equal single-process training with the codec's round trip
applied at the boundary (``commopt.comm.pipeline.get_codec(name).roundtrip``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.microbatch import merge_chunks, split_args_kwargs_into_chunks

from ..comm.pipeline import Agreement, StageLinks, get_codec

__all__ = ["PipelineSchedule", "SCHEDULES", "actions"]

SCHEDULES = ("gpipe", "1f1b")


def actions(schedule: str, stage: int, stages: int, n: int, extra: int = 1,
            per_boundary: bool = True) -> list[tuple[str, int]]:
    """The order in which ``stage`` runs its forwards ("F", k) and backwards ("B", k).

    GPipe: every forward, then every backward in ascending order. 1F1B: ``min(n, stages - stage +
    extra * (stages - 1 - stage))`` warm-up forwards (torch's, plus ``extra`` per boundary downstream;
    one on the last stage), then one backward and one forward in turn, then the remaining backwards.
    ``per_boundary=False``: ``extra`` on every stage but the last alike (the simulator's what-if: it hides
    only the last boundary's transfers).
    """
    if schedule == "gpipe":
        return [("F", k) for k in range(n)] + [("B", k) for k in range(n)]
    ahead = (stages - 1 - stage) if per_boundary else min(1, stages - 1 - stage)
    warm = min(n, stages - stage + extra * ahead)
    out = [("F", k) for k in range(warm)]
    f = warm
    for b in range(n):
        out.append(("B", b))
        if f < n:
            out.append(("F", f))
            f += 1
    return out


class PipelineSchedule:
    """One pipeline stage (this rank's) and the schedule that drives it.

    Args:
        module: this stage's part of the model; it takes one tensor (the first stage: the micro-batch's
            positional arguments) and returns one tensor.
        n_microbatches: micro-batches per step (the batch is split along dimension 0 as torch does;
            every micro-batch of a stage must have the same shape, as torch's schedules require).
        loss_fn: ``loss_fn(output, target)``, given on every stage (only the last calls it). None on
            every stage: forwards only (inference; the last stage returns the outputs).
        group: the pipeline's process group, one stage per rank in rank order (None: the world). Give
            the pipeline a group of its own: nothing else may use its point-to-point tags.
        schedule: "1f1b" or "gpipe".
        forward_codec, backward_codec: the codec of the activations and of their gradients (None,
            "bf16", "fp16", "int8", "int4"; ``commopt.comm.pipeline.CODECS``).
        delta_samples: AQ-SGD's delta mode on the activations (fine-tuning on a finite set of samples
            seen many times): the number of distinct sample ids; ``step(..., sample_ids=)`` then gives
            each sample's id on every stage. Each side of each boundary caches one activation per sample.
        error_feedback: keep a residual per micro-batch index for the gradients sent backward.
        extra: warm-up forwards beyond torch's per boundary downstream of this stage (1F1B).
        depth: receives posted ahead per direction.
        timeout: seconds any one wait may take before ``CommTimeoutError``.
        scale_grads: divide the accumulated gradients by ``n_microbatches`` (torch's default), for a
            mean-reducing ``loss_fn``.
    """

    def __init__(self, module: nn.Module, *, n_microbatches: int, loss_fn: Callable | None = None, group=None,
                 schedule: str = "1f1b", forward_codec: str | None = None, backward_codec: str | None = None,
                 delta_samples: int | None = None, error_feedback: bool = False, extra: int = 1, depth: int = 2,
                 timeout: float = 300.0, scale_grads: bool = True) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"PipelineSchedule: schedule={schedule!r}; use one of {SCHEDULES} (for torch's other "
                             f"schedules, give torch's PipelineStage commopt's group: comm.pipeline.group)")
        for name, v, lo in (("n_microbatches", n_microbatches, 1), ("extra", extra, 0), ("depth", depth, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"PipelineSchedule: {name}={v!r} must be an int >= {lo}")
        if not timeout or timeout <= 0:
            raise ValueError(f"PipelineSchedule: timeout={timeout!r} must be a positive number of seconds")
        if not dist.is_initialized():
            raise RuntimeError("PipelineSchedule: torch.distributed is not initialized; call "
                               "dist.init_process_group first (one stage per rank)")
        fwd, bwd = get_codec(forward_codec), get_codec(backward_codec)
        self.module = module
        self.group = group if group is not None else dist.group.WORLD
        self.stage = dist.get_rank(self.group)
        self.stages = dist.get_world_size(self.group)
        self.n = n_microbatches
        self.loss_fn = loss_fn
        self.schedule = schedule
        self.scale_grads = scale_grads
        self.delta = delta_samples is not None
        self.backward = loss_fn is not None
        order = actions(schedule, self.stage, self.stages, n_microbatches, extra)
        self.order = order if self.backward else [a for a in order if a[0] == "F"]
        code = SCHEDULES.index(schedule) + (0 if self.backward else len(SCHEDULES))
        self.links = StageLinks(self.group, Agreement(n_microbatches, code, fwd.name, bwd.name, self.delta),
                                timeout=timeout, delta_capacity=delta_samples, error_feedback=error_feedback,
                                depth=depth, backward=self.backward)
        self._steps = 0

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def bytes_sent(self) -> dict[str, int]:
        """Bytes this stage sent, by ``"<boundary>/<fwd|bwd>"`` (payload and 40-byte trailer)."""
        return self.links.bytes()

    def step(self, *args, target: torch.Tensor | None = None, losses: list | None = None,
             sample_ids: torch.Tensor | Sequence[int] | None = None, **kwargs):
        """Run one batch through the pipeline: forwards and backwards of every micro-batch.

        Args:
            *args, **kwargs: the batch (first stage only), split into micro-batches along dimension 0.
            target: the targets (last stage, with ``loss_fn``), split the same way.
            losses: a list the last stage appends each micro-batch's loss to.
            sample_ids: one id per sample of the batch, on every stage (delta mode only).

        Returns:
            The last stage: the outputs of every micro-batch, concatenated; other stages: None.
        """
        self._steps += 1
        self.links.start(self._steps)
        try:
            if self.is_first and not args and not kwargs:
                raise ValueError("PipelineSchedule.step: the first stage must pass the batch")
            if self.is_last and self.backward and target is None:
                raise ValueError("PipelineSchedule.step: the last stage has a loss_fn and must pass target=")
            arg_mbs, kw_mbs = (split_args_kwargs_into_chunks(args, kwargs, self.n) if self.is_first else
                               ([()] * self.n, [{}] * self.n))
            tgt_mbs = list(torch.tensor_split(target, self.n)) if self.backward and self.is_last else None
            self.links.begin(self._ids(sample_ids))
            return self._run(arg_mbs, kw_mbs, tgt_mbs, losses)
        except BaseException as exc:
            self.links.fail(exc)
            raise

    def _run(self, arg_mbs, kw_mbs, tgt_mbs, losses):
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        mb_losses: dict[int, torch.Tensor] = {}
        kept = []
        for kind, k in self.order:
            if kind == "F":
                if self.is_first:
                    out = self.module(*arg_mbs[k], **kw_mbs[k])
                else:
                    x = self.links.recv_activation(k).detach()
                    inputs[k] = x.requires_grad_(True) if self.backward else x
                    out = self.module(x)
                if not isinstance(out, torch.Tensor):
                    raise TypeError(f"PipelineSchedule: stage {self.stage} returned {type(out).__name__}; a stage "
                                    f"returns one tensor (for tuples, give torch's schedules commopt's group)")
                if self.is_last:
                    kept.append(out.detach())
                    if self.backward:
                        mb_losses[k] = self.loss_fn(out, tgt_mbs[k])
                else:
                    self.links.send_activation(k, out)
                if self.backward:
                    outputs[k] = out
            else:
                out = outputs.pop(k)
                if self.is_last:
                    mb_losses[k].backward()
                else:
                    out.backward(self.links.recv_gradient(k))
                if not self.is_first:
                    self.links.send_gradient(k, inputs.pop(k).grad)
        self.links.end()
        if self.scale_grads and self.n != 1 and self.backward:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.div_(self.n)
        if losses is not None and self.is_last:
            losses.extend(mb_losses[k] for k in range(self.n) if k in mb_losses)
        return merge_chunks(kept, None) if self.is_last else None  # noqa: E501

    def _ids(self, sample_ids) -> list[torch.Tensor | None]:
        if not self.delta:
            if sample_ids is not None:
                raise ValueError("PipelineSchedule.step: sample_ids is for the delta mode (delta_samples=)")
            return [None] * self.n
        if sample_ids is None:
            raise ValueError("PipelineSchedule.step: the delta mode needs sample_ids= (one id per sample) on every "
                             "stage")
        ids = torch.as_tensor(sample_ids).reshape(-1).to(torch.int64).cpu()
        if ids.unique().numel() != ids.numel():
            raise ValueError("PipelineSchedule.step: sample_ids repeat inside the batch; the delta mode needs one "
                             "distinct id per sample of a step")
        parts = list(torch.tensor_split(ids, self.n))
        cache = self.links.delta_in or self.links.delta_out
        return parts if cache is None else [cache.check_ids(p, p.numel()) for p in parts]
