"""Plain-text tables for command-line reports."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str | None = None) -> str:
    """Left-aligned first column, right-aligned others; floats with 2 decimals, NaN as '-'."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths, strict=True))).rstrip()

    out = [title] if title else []
    out += [line(list(headers)), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


def _cell(v: object) -> str:
    if isinstance(v, float):
        return "-" if v != v else f"{v:.2f}"
    return str(v)
