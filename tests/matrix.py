"""Test matrices split between the default run and ``pytest -m slow``.

A matrix of recorded cases (architectures x options, say) compiles one program per cell, and the
whole of it would keep the default run over its time limit. The default run keeps a spread of
cells, every row at least once and the kept columns staggered from row to row (so a square
matrix runs every column), and the other cells carry the ``slow`` mark:
``.ci/run`` runs them too (``pytest -m slow``), so every submission still checks the whole
matrix.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import pytest


def spread(cells: Iterable[tuple[Hashable, Hashable]], per_row: int = 2) -> list:
    """pytest params for ``(row, column)`` cells, id ``"row-column"``: row ``k`` (in order of
    first appearance) keeps ``per_row`` of its columns by default, starting at its ``k``-th
    column and evenly spaced, so that consecutive rows keep different columns; the others are
    marked slow."""
    cells = list(cells)
    rows: dict[Hashable, list[Hashable]] = {}
    for row, column in cells:
        rows.setdefault(row, []).append(column)
    kept = set()
    for index, (row, columns) in enumerate(rows.items()):
        step = max(1, len(columns) // per_row)
        for j in range(min(per_row, len(columns))):
            kept.add((row, columns[(index + j * step) % len(columns)]))
    return [
        pytest.param(row, column, id=f"{row}-{column}", marks=_marks((row, column) in kept))
        for row, column in cells
    ]


def by_default(values: Sequence, keep: Iterable, ids=None, unpack: bool = False) -> list:
    """pytest params for ``values``: those in ``keep`` run by default, the others are marked
    slow. ``ids``: a list, or a function of the value, as ``pytest.mark.parametrize`` takes;
    else pytest's. ``unpack``: each value is a tuple of several arguments."""
    keep = list(keep)
    missing = [value for value in keep if value not in values]
    assert not missing, f"kept values {missing} are not among {values}"
    if ids is None or callable(ids):
        ids = [ids(value) if ids else None for value in values]
    return [
        pytest.param(*(value if unpack else (value,)), id=name, marks=_marks(value in keep))
        for value, name in zip(values, ids, strict=True)
    ]


def _marks(default: bool) -> tuple:
    return () if default else (pytest.mark.slow,)
