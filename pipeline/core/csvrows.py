"""The project's CSV tables (``lccn-shards csv``'s ``path,label`` rows, ``lccn-predict``'s
``path`` column, a label view's ``key,label`` file) read row by row with the line each row
starts on, and the two faults Python's :mod:`csv` module lets through or reports without a
place turned into one line naming ``file:line``:

- an unterminated quote: the quoted cell swallows the lines after it, up to the end of the
  file (a cell with a line break in it; :mod:`csv` says nothing) or until it passes the
  field limit (``_csv.Error: field larger than field limit (131072)``, with no line);
- a row with more (non-empty) cells than the header has columns (:class:`csv.DictReader` files the
  extra cells under the key None and carries on).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable, Iterator


class CSVFormatError(ValueError):
    """A CSV row that cannot be read as the table it belongs to; the message names
    ``file:line``."""


def _quote_problem(where: str, start: int, end: int) -> str:
    return (f"{where}:{start}: a quote opened on line {start} is never closed (the cell runs "
            f"on to line {end}); close it, or double a quote inside a quoted cell (\"\")")


def rows(lines: Iterable[str], where: str | os.PathLike, *, header: bool = True
         ) -> Iterator[tuple[int, list[str]]]:
    """``(line, cells)`` of each non-blank row of ``lines`` (an open text file or a list of
    lines), ``line`` the 1-based line the row starts on. ``header``: the first non-blank
    row is a header, and every later row must have at most as many non-empty cells (fewer are
    fine: the last columns left empty; so is a trailing comma). Raises :class:`CSVFormatError` naming ``where:line``."""
    where = str(where)
    reader = csv.reader(lines)
    width = None
    start = 1
    while True:
        start = reader.line_num + 1
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            if "field larger than field limit" in str(e) or "unexpected end of data" in str(e):
                raise CSVFormatError(_quote_problem(where, start, reader.line_num)) from None
            raise CSVFormatError(f"{where}:{start}: not a CSV row ({e})") from None
        if any("\n" in c or "\r" in c for c in cells):
            raise CSVFormatError(_quote_problem(where, start, reader.line_num))
        if not cells or all(not c.strip() for c in cells):
            continue  # a blank line
        if header and width is None:
            width = len(cells)
        elif width is not None and any(c.strip() for c in cells[width:]):
            extra = cells[width:]  # (empty trailing cells, a trailing comma, are no data)
            raise CSVFormatError(f"{where}:{start}: {len(cells)} cells, but the header has "
                                 f"{width} columns (extra: {','.join(extra)!r}); quote a "
                                 f"cell that holds a comma")
        yield start, cells


def dict_rows(lines: Iterable[str], where: str | os.PathLike
              ) -> tuple[list[str], Iterator[tuple[int, dict[str, str]]]]:
    """The header's column names (stripped; [] for an empty file) and ``(line, {column:
    cell})`` of each later row (a missing cell is ""), checked as :func:`rows` checks."""
    it = rows(lines, where, header=True)
    try:
        _, head = next(it)
    except StopIteration:
        return [], iter(())
    cols = [c.strip() for c in head]

    def gen() -> Iterator[tuple[int, dict[str, str]]]:
        for line, cells in it:
            yield line, {c: (cells[i] if i < len(cells) else "") for i, c in enumerate(cols)}

    return cols, gen()
