"""A small notebook written in a test: ``notebook(("markdown", "# t"), ("code", "x = 1", "gpu"))``
gives a clean notebook dict, one cell per (kind, source, *tags) tuple."""

from utils import notebooks as nbm


def notebook(*cells) -> dict:
    out = []
    for kind, src, *tags in cells:
        cell = {"cell_type": kind, "metadata": {"tags": tags} if tags else {}, "source": src}
        if kind == "code":
            cell.update(outputs=[], execution_count=None)
        out.append(cell)
    return nbm.clean_notebook({"cells": out})
