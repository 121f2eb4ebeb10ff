"""Per-instance utilization per policy as a PNG, drawn with Pillow (no plotting library needed).

One panel per policy: a bar per prefill instance (blue), then a bar per decode instance
(orange), each as tall as its utilization (busy seconds / makespan), gridlines at 0.25 steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from services.router.sim.report import Report

PREFILL_COLOR = (52, 101, 164)
DECODE_COLOR = (230, 126, 34)
GRID_COLOR = (220, 220, 220)
TEXT_COLOR = (20, 20, 20)
PANEL_HEIGHT = 170
PLOT_HEIGHT = 120
LEFT = 44
GAP = 16


def bar_width(num_bars: int) -> int:
    return max(2, min(16, 900 // max(1, num_bars)))


def draw_panel(draw: ImageDraw.ImageDraw, font: ImageFont.ImageFont, report: Report, top: int) -> None:
    base = top + 28 + PLOT_HEIGHT
    bars = [(u, PREFILL_COLOR) for u in report.prefill_utilization]
    bars_decode = [(u, DECODE_COLOR) for u in report.decode_utilization]
    width = bar_width(len(bars) + len(bars_decode))
    right = LEFT + width * (len(bars) + len(bars_decode)) + GAP
    draw.text((LEFT, top + 6), f"{report.policy}: balanced ratio {report.balanced_ratio:.3f}, imbalance "
              f"P {report.imbalance_prefill:.3f} / D {report.imbalance_decode:.3f}, "
              f"TTFT p99 {report.ttft_p99_s:.2f} s", fill=TEXT_COLOR, font=font)
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = base - round(tick * PLOT_HEIGHT)
        draw.line([(LEFT, y), (right, y)], fill=GRID_COLOR)
        draw.text((4, y - 6), f"{tick:.2f}", fill=TEXT_COLOR, font=font)
    x = LEFT
    for position, (utilization, color) in enumerate(bars + bars_decode):
        if position == len(bars):
            x += GAP
        height = round(min(1.0, max(0.0, utilization)) * PLOT_HEIGHT)
        if height > 0:
            draw.rectangle([(x, base - height), (x + max(1, width - 2), base)], fill=color)
        x += width


def plot_utilization(reports: Sequence[Report], path: Path | str) -> Path:
    """Writes the PNG to ``path`` and returns it."""
    if not reports:
        raise ValueError("nothing to plot")
    num_bars = max(len(r.prefill_utilization) + len(r.decode_utilization) for r in reports)
    width = max(LEFT + bar_width(num_bars) * num_bars + 2 * GAP, 640)
    image = Image.new("RGB", (width, PANEL_HEIGHT * len(reports) + 24), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    for i, report in enumerate(reports):
        draw_panel(draw, font, report, i * PANEL_HEIGHT)
    legend_y = PANEL_HEIGHT * len(reports) + 4
    draw.rectangle([(LEFT, legend_y + 2), (LEFT + 10, legend_y + 12)], fill=PREFILL_COLOR)
    draw.text((LEFT + 14, legend_y), "prefill instances", fill=TEXT_COLOR, font=font)
    draw.rectangle([(LEFT + 130, legend_y + 2), (LEFT + 140, legend_y + 12)], fill=DECODE_COLOR)
    draw.text((LEFT + 144, legend_y), "decode instances (utilization = busy s / makespan)",
              fill=TEXT_COLOR, font=font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")
    return path
