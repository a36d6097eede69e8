"""Hand-made Nsight Compute exports for the profile drivers' CPU tests."""


def raw_page(cells: dict[str, tuple[str, str]]) -> str:
    """ncu's raw page as CSV: one kernel, ``cells`` maps a metric name to (unit, value)."""
    names = ",".join(f'"{n}"' for n in cells)
    units = ",".join(f'"{u}"' for u, _ in cells.values())
    values = ",".join(f'"{v}"' for _, v in cells.values())
    return f"{names}\n{units}\n{values}\n"
