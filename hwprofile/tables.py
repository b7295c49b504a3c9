"""Latency tables with structured keys and multilinear interpolation.

A table has named numeric axes, e.g. verify: ("n", "ctx"), draft_layer: ("heads", "ffn", "cross",
"n", "ctx"), and one entry per point of the full grid (every combination of axis values):

    "n=8,ctx=512": {"ms": 91.3, "iqr": 2.1, "census": [flops, float_elems, other_bytes, kernels]}

`lookup(n=12, ctx=700)` interpolates linearly along every axis between the bracketing grid values
(piecewise-linear, so it returns grid points exactly and is monotone between neighbouring points);
outside the grid it extends the nearest segment linearly, never below zero.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import product

from hwprofile.census import Census
from hwprofile.timing import Stat

Point = tuple[int, ...]


def format_key(axes: tuple[str, ...], point: Point) -> str:
    return ",".join(f"{a}={v}" for a, v in zip(axes, point))


def parse_key(axes: tuple[str, ...], key: str) -> Point:
    parts = dict(p.split("=", 1) for p in key.split(","))
    if set(parts) != set(axes):
        raise ValueError(f"table key '{key}' does not match axes {axes}")
    return tuple(int(parts[a]) for a in axes)


@dataclass
class Table:
    axes: tuple[str, ...]
    ms: dict[Point, float] = field(default_factory=dict)
    iqr: dict[Point, float] = field(default_factory=dict)
    census: dict[Point, Census] = field(default_factory=dict)

    # ------------------------------------------------------------------ building
    def put(self, point: Point, stat: Stat | float, census: Census | None = None) -> None:
        point = tuple(int(v) for v in point)
        if len(point) != len(self.axes):
            raise ValueError(f"point {point} has {len(point)} values for axes {self.axes}")
        if isinstance(stat, Stat):
            self.ms[point], self.iqr[point] = stat.ms, stat.iqr_ms
        else:
            self.ms[point], self.iqr[point] = float(stat), 0.0
        if census is not None:
            self.census[point] = census

    def grid(self, axis: str) -> list[int]:
        i = self.axes.index(axis)
        return sorted({p[i] for p in self.ms})

    def points(self) -> Iterator[Point]:
        return iter(sorted(self.ms))

    def check_complete(self) -> None:
        """Every combination of the axis values must be present (multilinear interpolation needs it)."""
        full = set(product(*(self.grid(a) for a in self.axes)))
        missing = full - set(self.ms)
        if missing:
            raise ValueError(f"table over {self.axes} misses {len(missing)} grid points, e.g. {sorted(missing)[0]}")

    # ------------------------------------------------------------------ interpolation
    def lookup(self, **query: float) -> float:
        if set(query) != set(self.axes):
            raise KeyError(f"lookup needs exactly the axes {self.axes}, got {sorted(query)}")
        grids = [self.grid(a) for a in self.axes]
        return max(0.0, self._interp(grids, [float(query[a]) for a in self.axes], ()))

    def _interp(self, grids: list[list[int]], q: list[float], fixed: Point) -> float:
        d = len(fixed)
        if d == len(self.axes):
            return self.ms[fixed]
        g, x = grids[d], q[d]
        if len(g) == 1:
            return self._interp(grids, q, fixed + (g[0],))
        j = bisect.bisect_left(g, x)
        if j < len(g) and g[j] == x:  # exactly on the grid: no arithmetic, so grid points come back exactly
            return self._interp(grids, q, fixed + (g[j],))
        lo = min(max(j - 1, 0), len(g) - 2)  # bracketing segment, or the end segment outside the grid
        x0, x1 = g[lo], g[lo + 1]
        y0 = self._interp(grids, q, fixed + (x0,))
        y1 = self._interp(grids, q, fixed + (x1,))
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict:
        entries = {}
        for p in self.points():
            e = {"ms": round(self.ms[p], 4), "iqr": round(self.iqr.get(p, 0.0), 4)}
            if p in self.census:
                e["census"] = self.census[p].to_list()
            entries[format_key(self.axes, p)] = e
        return {"axes": list(self.axes), "entries": entries}

    @classmethod
    def from_json(cls, d: dict) -> "Table":
        axes = tuple(d["axes"])
        t = cls(axes)
        for key, e in d["entries"].items():
            p = parse_key(axes, key)
            t.ms[p] = float(e["ms"])
            t.iqr[p] = float(e.get("iqr", 0.0))
            if "census" in e:
                t.census[p] = Census.from_list(e["census"])
        return t
