"""``commopt-bench plot RESULTS.json``: the picture of a benchmark's JSON results, as a PNG.

It reads what the benchmarks write with ``--json`` and draws, by the kind of results:

- ``commopt-bench collectives``: for each collective, bus bandwidth against message size per
  algorithm (solid), with the cost model's bound for each (dashed: the busbw the alpha-beta model
  predicts), and beside it each algorithm's speed-up against flat, measured and predicted;
- ``commopt-bench ddp``: the median step time and the final loss of every hook (DDP's default as
  the reference line), and the loss curves;
- ``commopt-bench tp``: each variant's step beside its compute alone and its communication alone
  (the block, then attention).

The same pictures come out of a run with ``--plot PNG`` on those subcommands. matplotlib is the
``plot`` extra (``pip install commopt[plot]``), imported only when something is drawn. Every plot
function returns the series it drew, read back from the figure, so that a test can hold them
against the JSON::

    commopt-bench collectives --spawn 4 --topology 2x2 --json sweep.json
    commopt-bench plot sweep.json                 # writes sweep.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ._plot import pyplot

__all__ = ["kind_of", "main", "plot", "plot_collectives", "plot_ddp", "plot_tp"]

_OP_TITLE = {"allreduce": "all-reduce", "reduce_scatter": "reduce-scatter", "all_gather": "all-gather",
             "alltoall": "all-to-all"}
# One colour per algorithm, the same in every picture.
_COLOURS = {"flat": "tab:blue", "hierarchical": "tab:orange", "auto": "tab:green", "torch": "tab:gray",
            "leader": "tab:purple", "ina": "tab:red", "2d": "tab:orange", "synth": "tab:brown"}
# auto runs the algorithm it picks, so its line lies on that one's: a smaller marker on top keeps both
# visible.
_STYLE = {"flat": dict(marker="o", markersize=7), "hierarchical": dict(marker="s", markersize=9),
          "auto": dict(marker="^", markersize=5, zorder=3), "torch": dict(marker="x", markersize=7)}


def kind_of(data: dict) -> str:
    """``"collectives"``, ``"ddp"`` or ``"tp"``: which benchmark wrote ``data`` (ValueError for anything else)."""
    if isinstance(data, dict):
        if data.get("kind") == "tp" and isinstance(data.get("results"), list):
            return "tp"
        if isinstance(data.get("rows"), list) and isinstance(data.get("meta"), dict):
            return "collectives"
        results = data.get("results")
        if isinstance(results, list) and results and all(isinstance(r, dict) and "hook" in r for r in results):
            return "ddp"
    raise ValueError("not the JSON of a benchmark that plots: expected `commopt-bench collectives --json` "
                     "({'meta', 'rows'}), `commopt-bench ddp --json` ({'results': [{'hook', ...}]}) or "
                     "`commopt-bench tp --json` ({'kind': 'tp', 'results': [...]})")


def plot(data: dict, path: str) -> dict | None:
    """Draw ``data`` (any kind :func:`kind_of` knows) into the PNG ``path``; see the plot functions."""
    return {"collectives": plot_collectives, "ddp": plot_ddp, "tp": plot_tp}[kind_of(data)](data, path)


def _labels(fig) -> dict:
    """The figure's title and, per visible panel, its title, axis labels and scales."""
    title = fig.get_suptitle() if hasattr(fig, "get_suptitle") else (fig._suptitle.get_text() if fig._suptitle else "")
    return {"title": title,
            "axes": [{"title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
                      "xscale": ax.get_xscale(), "yscale": ax.get_yscale(), "legend": ax.get_legend() is not None}
                     for ax in fig.axes if ax.get_visible()]}


# ------------------------------------------------------------------------------------ collectives
def _size_label(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            value = n / div
            return f"{value:g} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n:g} B"


def _where(meta: dict) -> str:
    """The topology and link of a collectives run, in words (the title's second half)."""
    world = meta.get("world_size", "?")
    layout = str(meta.get("topology", ""))
    nodes = [n for n in layout.split(";") if n]
    sizes = {len(n.split(",")) for n in nodes}
    shape = f"{len(nodes)}x{sizes.pop()}" if len(sizes) == 1 else layout
    text = f"{world} ranks" + (f", {shape} (nodes x ranks)" if len(nodes) > 1 else ", one node")
    rate, measured = meta.get("link_rate_bps"), meta.get("link_measured_bps")
    link = meta.get("inter_node_link", bool(rate))
    if len(nodes) > 1 and link and rate:
        text += f", {rate / 1e6:g} Mbit/s inter-node link"
        if measured:
            text += f" ({measured / 1e6:.0f} measured)"
    elif len(nodes) > 1 and not link:
        text += ", logical nodes on one machine (no inter-node link)"
    return text


def _algo_label(rows: list[dict]) -> str:
    r = rows[0]
    label = r["algo"] + (" + validate" if r.get("validate") else "")
    if r["algo"] == "auto":
        chosen = sorted({x["chosen"] for x in rows if x.get("chosen")})
        if chosen:
            label += f" (chose {'/'.join(chosen)})"
    return label


def plot_collectives(data: dict, path: str) -> dict | None:
    """Bus bandwidth against size per algorithm, with the bound, and the speed-up against flat.

    One row of panels per collective in the results. Left: busbw (nccl-tests' definition) against the
    per-rank message size, both on log scales, measured (solid, dots) and the cost model's bound
    (dashed, same colour). Right (when flat and another algorithm were measured): time of flat / time
    of each algorithm, measured (solid) and predicted by the model (dashed), with 1.0 marked.

    Args:
        data: ``{"meta": ..., "rows": [...]}`` as ``commopt-bench collectives --json`` writes it.
        path: the PNG to write.

    Returns:
        What was drawn, read back from the figure's lines: ``{"busbw": {key: (sizes, values)},
        "bound": {...}, "speedup": {...}, "predicted_speedup": {...}, "unit": "GB/s" | "MB/s"}`` with
        keys ``"<op>/<algo>"`` (``"<op>/<algo>+v"`` for validate=True); values in ``unit``; also
        ``"title"`` and ``"axes"`` (each panel's title, labels, scales, whether it has a legend).
        None when matplotlib is missing (a note on stderr says so).
    """
    plt = pyplot(f"plot {path}")
    if plt is None:
        return None
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    meta, rows = data["meta"], data["rows"]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    series = {op: {} for op in ops}
    for r in rows:
        series[r["op"]].setdefault((r["algo"], bool(r.get("validate"))), []).append(r)
    have_flat = {op: ("flat", False) in s and len(s) > 1 for op, s in series.items()}
    ncols = 2 if any(have_flat.values()) else 1
    fig, axes = plt.subplots(len(ops), ncols, figsize=(6.4 * ncols, 4.6 * len(ops)), squeeze=False)
    # GB/s on a real network; a 200 Mbit/s link moves 0.025 GB/s, which reads better in MB/s.
    peak = max([r["busbw"] for r in rows] + [0.0])
    unit, scale = ("GB/s", 1.0) if peak >= 1.0 else ("MB/s", 1e3)
    out: dict[str, Any] = {"busbw": {}, "bound": {}, "speedup": {}, "predicted_speedup": {}, "unit": unit}
    for i, op in enumerate(ops):
        ax = axes[i][0]
        sizes = sorted({r["size"] for r in rows if r["op"] == op})
        for (algo, val), rs in series[op].items():
            rs = sorted(rs, key=lambda r: r["size"])
            key = f"{op}/{algo}" + ("+v" if val else "")
            colour = _COLOURS.get(algo)
            ax.plot([r["size"] for r in rs], [r["busbw"] * scale for r in rs], color=colour,
                    linestyle=":" if val else "-", label=_algo_label(rs), gid=f"busbw:{key}",
                    **_STYLE.get(algo, dict(marker="o")))
            bounded = [r for r in rs if r.get("bound_us")]
            if bounded and algo != "torch":  # torch's row repeats flat's bound
                ax.plot([r["size"] for r in bounded],
                        [r["busbw"] * r["time_us"] / r["bound_us"] * scale for r in bounded],
                        linestyle="--", color=colour, alpha=0.8, gid=f"bound:{key}")
        cut = sorted({r["size"]: r for r in rows if r["op"] == op and r.get("cut_us")}.values(),
                     key=lambda r: r["size"])
        if cut:  # the link map's cut bound (comm/synthesis/bound.py): the busbw no schedule exceeds
            ax.plot([r["size"] for r in cut], [r["busbw"] * r["time_us"] / r["cut_us"] * scale for r in cut],
                    linestyle="-.", color="black", alpha=0.7, label="cut bound of the link map", gid=f"cut:{op}")
        ax.set_xscale("log", base=2)
        values = [y for line in ax.get_lines() for y in line.get_ydata() if y > 0]
        log_y = bool(values) and max(values) / min(values) > 10  # a sweep from latency to bandwidth bound
        if log_y:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        else:
            ax.set_ylim(bottom=0, top=max(values + [0.0]) * 1.1 or None)
        ax.xaxis.set_major_locator(FixedLocator(sizes))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([_size_label(s) for s in sizes], rotation=30 if len(sizes) > 6 else 0)
        per = "per peer" if op == "alltoall" else "per rank"
        ax.set_xlabel(f"message size {per} (bytes, log scale)")
        ax.set_ylabel(f"bus bandwidth ({unit}{', log scale' if log_y else ''})")
        ax.set_title(f"{_OP_TITLE.get(op, op)}: busbw against size")
        ax.grid(True, which="both", alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if any((line.get_gid() or "").startswith("bound:") for line in ax.get_lines()):
            handles.append(Line2D([], [], color="black", linestyle="--"))
            labels.append("cost-model bound (dashed)")
        ax.legend(handles, labels, fontsize="small")
        if ncols == 2:
            ax = axes[i][1]
            if not have_flat[op]:
                ax.set_visible(False)
                continue
            flat = {r["size"]: r for r in series[op][("flat", False)]}
            for (algo, val), rs in series[op].items():
                if (algo, val) == ("flat", False):
                    continue
                rs = sorted((r for r in rs if r["size"] in flat), key=lambda r: r["size"])
                key = f"{op}/{algo}" + ("+v" if val else "")
                colour = _COLOURS.get(algo)
                ax.plot([r["size"] for r in rs], [flat[r["size"]]["time_us"] / r["time_us"] for r in rs],
                        color=colour, linestyle=":" if val else "-", label=_algo_label(rs),
                        gid=f"speedup:{key}", **_STYLE.get(algo, dict(marker="o")))
                both = [r for r in rs if r.get("bound_us") and flat[r["size"]].get("bound_us")]
                if both and algo != "torch":
                    ax.plot([r["size"] for r in both],
                            [flat[r["size"]]["bound_us"] / r["bound_us"] for r in both],
                            linestyle="--", color=colour, alpha=0.8, gid=f"predicted_speedup:{key}")
            ax.axhline(1.0, color=_COLOURS["flat"], linewidth=1, label="flat (= 1)")
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_locator(FixedLocator(sizes))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticklabels([_size_label(s) for s in sizes], rotation=30 if len(sizes) > 6 else 0)
            ax.set_xlabel(f"message size {per} (bytes, log scale)")
            ax.set_ylabel("speed-up against flat (time of flat / time)")
            ax.set_title(f"{_OP_TITLE.get(op, op)}: speed-up against flat, measured interleaved")
            ax.grid(True, alpha=0.3)
            handles, labels = ax.get_legend_handles_labels()
            if any((line.get_gid() or "").startswith("predicted_speedup:") for line in ax.get_lines()):
                handles.append(Line2D([], [], color="black", linestyle="--"))
                labels.append("cost model's prediction (dashed)")
            ax.legend(handles, labels, fontsize="small")
    fig.suptitle(f"commopt-bench collectives: {_where(meta)}, {meta.get('dtype', rows[0]['type'] if rows else '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    out.update(_labels(fig))
    for ax in fig.axes:
        for line in ax.get_lines():
            gid = line.get_gid() or ""
            what, _, key = gid.partition(":")
            if what in out and key:
                out[what][key] = ([float(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()])
    plt.close(fig)
    return out


# ------------------------------------------------------------------------------------ ddp
def plot_ddp(data: dict, path: str) -> dict | None:
    """Step time and final loss per hook, and the loss curves, of a ``commopt-bench ddp`` run.

    Top left: median step time per hook (ms), DDP's default marked. Top right: final loss per hook
    against DDP's. Bottom: the loss of every hook at every step.

    Args:
        data: ``{"args": ..., "layout": ..., "results": [...]}`` as ``commopt-bench ddp --json``
            writes it.
        path: the PNG to write.

    Returns:
        ``{"step_ms": {hook: ms}, "final_loss": {hook: loss}, "loss": {hook: (steps, losses)}}``,
        read back from the figure's bars, markers and lines, with ``"title"`` and ``"axes"`` as
        :func:`plot_collectives` gives them; None when matplotlib is missing.
    """
    plt = pyplot(f"plot {path}")
    if plt is None:
        return None
    from matplotlib.patches import Patch

    results = data["results"]
    args = data.get("args", {})
    hooks = [r["hook"] for r in results]
    base = next((r for r in results if r["hook"] == "ddp"), None)
    colours = ["tab:gray" if h == "ddp" or h.startswith("torch-") else "tab:blue" for h in hooks]
    fig = plt.figure(figsize=(13, 4.0 + 0.28 * len(hooks) + 4.2))
    grid = fig.add_gridspec(2, 2, height_ratios=[1.0 + 0.09 * len(hooks), 1.3])
    ax_t, ax_l, ax_c = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])
    ys = list(range(len(hooks)))
    step_ms = [r["step_ms"] for r in results]
    bars = ax_t.barh(ys, step_ms, color=colours, gid="step_ms")
    for bar, r in zip(bars, results):
        text = f"{r['step_ms']:.1f}" + (f" ({r['step_ms'] / base['step_ms']:.2f}x)" if base else "")
        ax_t.annotate(text, (bar.get_width(), bar.get_y() + bar.get_height() / 2), xytext=(3, 0),
                      textcoords="offset points", va="center", fontsize="small")
    handles = [Patch(color="tab:gray", label="torch's hooks"), Patch(color="tab:blue", label="commopt's hooks")]
    if base:
        handles.append(ax_t.axvline(base["step_ms"], color="black", linestyle="--", linewidth=1, alpha=0.6,
                                    label="DDP's default"))
    ax_t.legend(handles=handles, loc="upper right", fontsize="small")
    ax_t.set_yticks(ys, hooks)
    ax_t.invert_yaxis()
    ax_t.set_xlim(0, max(step_ms) * 1.3)
    ax_t.set_xlabel("median step time (ms, slowest rank; in brackets: against DDP's default)")
    ax_t.set_title("step time per hook (interleaved)")
    ax_t.grid(True, axis="x", alpha=0.3)

    final = [r["losses"][-1] for r in results]
    ax_l.scatter(final, ys, color=colours, zorder=3, gid="final_loss")
    if base:  # named in the title: a legend box could hide a dot
        ax_l.axvline(base["losses"][-1], color="black", linestyle="--", linewidth=1)
    ax_l.margins(x=0.12)
    ax_l.set_yticks(ys, hooks)
    ax_l.invert_yaxis()
    ax_l.set_xlabel(f"loss after {len(results[0]['losses'])} steps (cross-entropy, mean over ranks)")
    ax_l.set_title("final loss per hook" + (" (dashed: DDP's default)" if base else ""))
    ax_l.grid(True, axis="x", alpha=0.3)

    cmap = plt.get_cmap("tab20")
    for k, r in enumerate(results):
        ax_c.plot(range(len(r["losses"])), r["losses"], color=cmap(k % 20), label=r["hook"],
                  linewidth=2.2 if r["hook"] == "ddp" else 1.2, gid=f"loss:{r['hook']}")
    ax_c.set_xlabel("training step")
    ax_c.set_ylabel("loss (cross-entropy)")
    ax_c.set_title("loss curves (same seed, same data for every hook)")
    ax_c.grid(True, alpha=0.3)
    ax_c.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)

    where = _where({"world_size": data.get("world_size", "?"), "topology": data.get("layout", ""),
                    "link_rate_bps": data.get("link_rate_bps")})
    fig.suptitle(f"commopt-bench ddp: GPT d={args.get('d_model', '?')} L={args.get('layers', '?')} "
                 f"seq={args.get('seq_len', '?')} batch={args.get('batch', '?')}/rank; {where}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    out: dict[str, Any] = {
        **_labels(fig),
        "step_ms": {h: float(b.get_width()) for h, b in zip(hooks, bars.patches)},
        "final_loss": {h: float(x) for h, (x, _) in zip(hooks, ax_l.collections[0].get_offsets())},
        "loss": {},
    }
    for line in ax_c.get_lines():
        gid = line.get_gid() or ""
        if gid.startswith("loss:"):
            out["loss"][gid[5:]] = ([float(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()])
    plt.close(fig)
    return out


# ------------------------------------------------------------------------------------ tp
def plot_tp(data: dict, path: str) -> dict | None:
    """The variants of a ``commopt-bench tp`` run: one panel for the block, one for attention; per
    variant a bar of its step (annotated with its ratio to max(compute, communication)), with compute
    alone and communication alone as dashed lines and their max dotted: the gap from the bar down to
    the dotted line is what overlap did not hide.

    Returns:
        ``{"step_ms": {variant: ms}, "compute_ms": {group: ms}, "comm_ms": {group: ms}}`` read back from
        the figure, with ``"title"`` and ``"axes"``; None when matplotlib is missing.
    """
    plt = pyplot(f"plot {path}")
    if plt is None:
        return None
    rows = data["results"]
    groups = [g for g in ("block", "attention") if any(r["group"] == g for r in rows)]
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4.2), squeeze=False)
    out: dict[str, Any] = {"step_ms": {}, "compute_ms": {}, "comm_ms": {}}
    for ax, group in zip(axes[0], groups):
        mine = [r for r in rows if r["group"] == group]
        names = [r["variant"] for r in mine]
        compute, comm = 1e3 * mine[0]["compute_s"], 1e3 * mine[0]["comm_s"]
        bars = ax.bar(names, [1e3 * r["step_s"] for r in mine], color="tab:blue", gid=f"step:{group}")
        for bar, r in zip(bars, mine):
            ax.annotate(f"{1e3 * r['step_s']:.1f} ms\n{r['step_over_max']:.2f}x max",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()), xytext=(0, 3),
                        textcoords="offset points", ha="center", fontsize="small")
            out["step_ms"][r["variant"]] = float(bar.get_height())
        ax.axhline(compute, color="tab:green", linestyle="--", label=f"compute alone {compute:.1f} ms")
        ax.axhline(comm, color="tab:red", linestyle="--", label=f"communication alone {comm:.1f} ms")
        ax.axhline(max(compute, comm), color="black", linestyle=":", label="max of the two (perfect overlap)")
        out["compute_ms"][group], out["comm_ms"][group] = compute, comm
        ax.set_ylabel("forward + backward (ms, slowest rank, median)")
        ax.set_title(f"{group}: each variant's step")
        ax.set_ylim(0, max(max(b.get_height() for b in bars), compute, comm) * 1.3)
        ax.legend(fontsize="small", loc="upper right")
        ax.grid(True, axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize="small")
    args = data.get("args", {})
    fig.suptitle(f"commopt-bench tp: TP {data.get('world', '?')}, d={args.get('d_model', '?')} heads="
                 f"{args.get('heads', '?')} ffn={args.get('ffn', '?')} seq={args.get('seq_len', '?')} "
                 f"batch={args.get('batch', '?')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    out.update(_labels(fig))
    plt.close(fig)
    return out


# ------------------------------------------------------------------------------------ CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commopt-bench plot", description=__doc__.split("\n\n")[0])
    p.add_argument("results", metavar="RESULTS.json", help="what `commopt-bench collectives --json`, "
                   "`commopt-bench ddp --json` or `commopt-bench tp --json` wrote")
    p.add_argument("-o", "--output", default=None, metavar="PNG",
                   help="the picture (default: RESULTS.png beside the JSON)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with open(args.results, encoding="utf-8") as f:
            data = json.load(f)
        kind = kind_of(data)
    except (OSError, ValueError) as e:
        print(f"commopt-bench plot: {args.results}: {e}", file=sys.stderr)
        return 2
    path = args.output or os.path.splitext(args.results)[0] + ".png"
    if plot(data, path) is None:
        return 2
    print(f"commopt-bench plot: {kind} results of {args.results} drawn in {path}")
    return 0
