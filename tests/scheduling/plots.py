"""TEST-ONLY: step charts of the scheduling scenarios as standalone SVG (no plotting package needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

WIDTH, HEIGHT = 720, 300
LEFT, RIGHT, TOP, BOTTOM = 60, 150, 30, 40
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")

#: One series: ``(x, y)`` points, x ascending; drawn as a step function (y holds until the next x).
Series = Sequence[tuple[float, float]]


def step_chart(
    title: str, series: Mapping[str, Series], *, x_label: str, y_label: str, y_max: float | None = None
) -> str:
    """An SVG document plotting each series of ``series`` (name -> points) as steps, with a legend."""
    points = [p for values in series.values() for p in values]
    x_max = max((x for x, _ in points), default=1.0) or 1.0
    top = y_max if y_max is not None else max((y for _, y in points), default=1.0) or 1.0
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(x: float) -> float:
        return LEFT + plot_w * x / x_max

    def sy(y: float) -> float:
        return TOP + plot_h * (1 - min(y, top) / top)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif"'
        ' font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{LEFT}" y="18" font-size="13">{escape(title)}</text>',
        f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}" stroke="black"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}" stroke="black"/>',
        f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 8}" text-anchor="middle">{escape(x_label)}</text>',
        f'<text x="14" y="{TOP + plot_h / 2}" transform="rotate(-90 14 {TOP + plot_h / 2})"'
        f' text-anchor="middle">{escape(y_label)}</text>',
    ]
    for i in range(5):
        x_tick, y_tick = x_max * i / 4, top * i / 4
        x_text = f'<text x="{sx(x_tick)}" y="{TOP + plot_h + 14}" text-anchor="middle">{x_tick:.0f}</text>'
        parts.append(x_text)
        parts.append(f'<text x="{LEFT - 6}" y="{sy(y_tick) + 4}" text-anchor="end">{y_tick:g}</text>')
        parts.append(
            f'<line x1="{LEFT}" y1="{sy(y_tick)}" x2="{LEFT + plot_w}" y2="{sy(y_tick)}" stroke="#ddd"/>'
        )
    for index, (name, values) in enumerate(series.items()):
        colour = COLOURS[index % len(COLOURS)]
        path: list[str] = []
        for (x, y), following in zip(values, [*values[1:], None], strict=True):
            path.append(f"{'M' if not path else 'L'}{sx(x):.1f},{sy(y):.1f}")
            if following is not None:
                path.append(f"L{sx(following[0]):.1f},{sy(y):.1f}")
        parts.append(f'<path d="{" ".join(path)}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        legend_y = TOP + 14 * index + 6
        parts.append(
            f'<line x1="{WIDTH - RIGHT + 10}" y1="{legend_y}" x2="{WIDTH - RIGHT + 28}" y2="{legend_y}"'
            f' stroke="{colour}" stroke-width="2"/>'
        )
        parts.append(f'<text x="{WIDTH - RIGHT + 32}" y="{legend_y + 4}">{escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
