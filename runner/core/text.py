"""Plain fixed-width tables for the terminal (the planner, the benchmarks, comparisons)."""


def cell(value) -> str:
    """A figure as a table shows it: 4 significant digits, `-` for a missing one."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def table(rows: list[dict], columns: list[str]) -> str:
    """Rows (dicts) as right-aligned columns under their names."""
    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)
