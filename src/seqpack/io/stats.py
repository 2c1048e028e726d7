"""What a packed dataset holds and costs: the efficiency report, bytes on disk, and a figure.

``dataset_stats`` gathers the report (rows, cells, real targets, padding, permitted
attention edges), the counts, the bytes on disk per token against the bytes an eager
in-memory epoch would hold per cell, and two histograms: example lengths and row fill.
On a dataset with supervision the report also holds ``supervised_target_fraction``
(supervised targets per cell) beside ``real_target_fraction`` (valid targets per cell);
the counts of a dataset of preference pairs hold ``pairs``.
``stats_svg`` draws both histograms as one self-contained SVG figure.
"""

from __future__ import annotations

from html import escape

import numpy as np

from ..packing.budget import CELL_BYTES, ROW_BYTES
from .dataset import PackedDataset
from .render import printable

HISTOGRAM_BINS = 32


def dataset_stats(dataset: PackedDataset) -> dict:
    """The dataset's report, counts, storage and histograms, as plain JSON-ready values."""
    manifest = dataset.manifest
    report = dataset.report()
    disk = sum(record["bytes"] for part in manifest["parts"] for record in part["files"].values())
    counts = manifest["counts"]
    capacity = dataset.config.capacity
    lengths = dataset.lengths()
    fill = dataset.row_fill()
    length_counts, length_edges = np.histogram(lengths, bins=HISTOGRAM_BINS, range=(0, capacity))
    fill_counts, fill_edges = np.histogram(fill / capacity, bins=HISTOGRAM_BINS, range=(0.0, 1.0))
    eager = report.cells * CELL_BYTES + report.rows * ROW_BYTES
    summary = report.as_dict()
    if "supervised_targets" in counts:  # a dataset with supervision (format version 2)
        summary["supervised_target_fraction"] = counts["supervised_targets"] / report.cells
    return {
        "path": str(dataset.path),
        "report": summary,
        "counts": counts,
        "storage": {
            "bytes_on_disk": disk,
            "token_dtype": np.dtype(dataset.token_dtype).name,
            "bytes_per_token": disk / counts["tokens"],
            "bytes_per_valid_target": disk / report.valid_targets,
            "eager_epoch_bytes": eager,
            "eager_bytes_per_cell": eager / report.cells,
            "eager_over_disk": eager / disk,
        },
        "example_lengths": {"edges": length_edges.tolist(), "counts": length_counts.tolist(),
                            "mean": float(lengths.mean()), "median": float(np.median(lengths)),
                            "max": int(lengths.max())},
        "row_fill": {"edges": fill_edges.tolist(), "counts": fill_counts.tolist(),
                     "mean": float(fill.mean() / capacity), "full_rows": int((fill == capacity).sum())},
    }


def _number(value: float) -> str:
    """A median: a whole number as one, else with its half (``2.5``)."""
    return f"{int(value)}" if float(value).is_integer() else f"{value:.1f}"


def stats_text(stats: dict) -> str:
    """The stats as aligned lines for a terminal."""
    report, counts, storage = stats["report"], stats["counts"], stats["storage"]
    lengths, fill = stats["example_lengths"], stats["row_fill"]
    supervised = "supervised_target_fraction" in report  # then both fractions, each saying what it divides
    lines = [
        ("dataset", printable(stats["path"])),
        ("policy", f"{report['policy']}, capacity {report['capacity']}"),
        ("documents", f"{counts['documents']:,}"),
        ("examples", f"{counts['examples']:,} (lengths: median {_number(lengths['median'])}, "
                     f"mean {lengths['mean']:.1f}, max {lengths['max']:,})"),
        *([("preference pairs", f"{counts['pairs']:,} (chosen and rejected side by side in one row)")]
          if "pairs" in counts else []),
        ("tokens", f"{counts['tokens']:,}"),
        ("rows / batches", f"{report['rows']:,} / {report['batches']:,}"),
        ("cells", f"{report['cells']:,}"),
        ("valid targets", f"{report['valid_targets']:,}"),
        *([("supervised targets", f"{counts['supervised_targets']:,} "
                                  f"({counts['supervised_targets'] / report['valid_targets']:.4f} of the valid; "
                                  f"{counts['skipped_unsupervised_windows']:,} windows without one left out)")]
          if "supervised_targets" in counts else []),
        ("real-target fraction",
         f"{report['real_target_fraction']:.4f}" + (" (valid targets / cells)" if supervised else "")),
        *([("supervised-target fraction", f"{report['supervised_target_fraction']:.4f} (supervised targets / cells)")]
          if supervised else []),
        ("padding cells", f"{report['padding_cells']:,}"),
        ("full rows", f"{fill['full_rows']:,} of {report['rows']:,} (mean fill {fill['mean']:.4f})"),
        ("permitted edges", f"{report['permitted_edges']:,} = {report['permitted_fraction']:.2%} of dense"),
        ("on disk", f"{storage['bytes_on_disk']:,} bytes = {storage['bytes_per_token']:.2f} bytes/token "
                    f"({storage['token_dtype']} tokens)"),
        ("eager epoch", f"{storage['eager_epoch_bytes']:,} bytes = {storage['eager_bytes_per_cell']:.2f} "
                        f"bytes/cell ({storage['eager_over_disk']:.1f}x the disk)"),
    ]
    width = max(len(name) for name, _ in lines)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in lines)


def _histogram_panel(x: float, y: float, width: float, height: float, title: str, axis: str,
                     edges: list, counts: list, labels: tuple[str, str], colour: str) -> list[str]:
    # Bar heights on a log scale, so that a bin of a few examples still shows beside a spike.
    top = max(counts) or 1
    scale = np.log1p(top)
    bar = width / len(counts)
    parts = [f'<g class="panel"><text x="{x}" y="{y - 8}" class="title">{escape(title)}</text>',
             f'<line x1="{x}" y1="{y + height}" x2="{x + width}" y2="{y + height}" class="axis"/>']
    for index, count in enumerate(counts):
        h = height * float(np.log1p(count)) / scale
        # np.histogram's last bin holds its right edge (full rows, examples of the capacity)
        close = "]" if index == len(counts) - 1 else ")"
        parts.append(f'<rect class="bar" x="{x + index * bar:.2f}" y="{y + height - h:.2f}" width="{bar - 1:.2f}" '
                     f'height="{h:.2f}" fill="{colour}"><title>[{edges[index]:.15g}, {edges[index + 1]:.15g}{close}: '
                     f'{count}</title></rect>')
    parts.append(f'<text x="{x}" y="{y + height + 16}" class="tick">{escape(labels[0])}</text>')
    parts.append(f'<text x="{x + width}" y="{y + height + 16}" class="tick" text-anchor="end">{escape(labels[1])}</text>')
    parts.append(f'<text x="{x + width / 2}" y="{y + height + 32}" class="tick" text-anchor="middle">{escape(axis)}</text>')
    parts.append(f'<text x="{x - 6}" y="{y + 10}" class="tick" text-anchor="end">{top:,}</text>')
    parts.append(f'<text x="{x - 6}" y="{y + height}" class="tick" text-anchor="end">0</text></g>')
    return parts


def stats_svg(stats: dict) -> str:
    """Example lengths and row fill, side by side, as a standalone SVG document."""
    report, lengths, fill = stats["report"], stats["example_lengths"], stats["row_fill"]
    width, height = 860, 300
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="12">',
        '<style>.title{font-weight:bold;font-size:13px}.tick{fill:#444}.axis{stroke:#444}</style>',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="20" y="22" class="title">{escape(report["policy"])}, capacity {report["capacity"]}: '
        f'{report["rows"]:,} rows, real-target fraction {report["real_target_fraction"]:.4f}</text>',
    ]
    parts += _histogram_panel(70, 60, 340, 180, "examples by length (log count)", "predictions",
                              lengths["edges"], lengths["counts"], ("0", f"{report['capacity']:,}"), "#4477aa")
    parts += _histogram_panel(490, 60, 340, 180, "rows by fill (log count)", "valid cells / capacity",
                              fill["edges"], fill["counts"], ("0", "1"), "#228833")
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
