# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled per-frame steps of ``pipelines.zones.Zones`` and ``pipelines.lines.Lines``.

The numpy code in pipelines/zones.py, lines.py and state.py is the reference: the same arithmetic in the same
order, in one pass over tracks x zones (x edges) and tracks x lines (tests/test_kernels.py checks both give
the same states, transitions and counts). Arrays are checked (type, order, shape) before their data is
read; the table's rows are pipelines.tracking's (cx, cy, w, h in rows 0-3 and the class are read).
"""

import numpy as np

cimport numpy as cnp
from libc.math cimport NAN
from libc.string cimport memcpy

cnp.import_array()

# Results of a frame in which nothing happened (shared: read-only, never written by anyone).
_NO_ROWS = np.zeros(0, np.intp)
_NO_ROWS.flags.writeable = False
_NO_DWELL = np.zeros(0)
_NO_DWELL.flags.writeable = False

cdef enum:
    R_CLS = 37  # the class row of pipelines.tracking's table (checked by pipelines.regions)
    MAX_STREAK = 32767  # streaks are int16: they stop counting there (an inertia_s can outlast them)


cdef inline double _anchor(double c, double off, double size) noexcept nogil:
    return c + off * size  # as the numpy code: also for a zero offset (an infinite size gives NaN there too)


cdef void* _data(cnp.ndarray a, int typenum, Py_ssize_t rows, Py_ssize_t cols, str name) except NULL:
    """``a``'s data, after checking it is what the loops below index: C order, ``typenum``, (rows, cols)
    or (rows,) where ``cols`` < 0."""
    if cnp.PyArray_TYPE(a) != typenum or not cnp.PyArray_IS_C_CONTIGUOUS(a):
        raise TypeError(f"{name}: need a C-ordered array of numpy type {typenum}, got {(<object>a).dtype}")
    if cnp.PyArray_NDIM(a) != (1 if cols < 0 else 2) or cnp.PyArray_DIMS(a)[0] != rows or (
        cols >= 0 and cnp.PyArray_DIMS(a)[1] != cols
    ):
        raise ValueError(f"{name}: shape {(<object>a).shape}, expected ({rows}, {cols})")
    return cnp.PyArray_DATA(a)


cdef inline Py_ssize_t _class(double cls, Py_ssize_t n_classes) noexcept nogil:
    # pipelines.regions.classes: ids beyond the labels, and negative ones, map to n_classes (unknown).
    cdef Py_ssize_t c = <Py_ssize_t>cls
    return c if 0 <= c < n_classes else n_classes


cdef inline cnp.ndarray _zeros(Py_ssize_t rows, Py_ssize_t cols, int typenum):
    cdef cnp.npy_intp d[2]
    d[0] = rows
    d[1] = cols
    return cnp.PyArray_ZEROS(2, d, typenum, 0)


def follow_rows(const Py_ssize_t[::1] row_map, cnp.ndarray state):
    """``state`` ((tracks, k), any type, C order) in the tracker's new track order: old rows moved, new
    tracks zero (pipelines.state.follow_rows, the numpy reference)."""
    if cnp.PyArray_NDIM(state) != 2 or not cnp.PyArray_IS_C_CONTIGUOUS(state):
        raise TypeError(f"state: need a C-ordered 2-D array, got shape {(<object>state).shape}")
    cdef Py_ssize_t n = row_map.shape[0], old = cnp.PyArray_DIMS(state)[0], i, r
    cdef size_t row = cnp.PyArray_DIMS(state)[1] * cnp.PyArray_ITEMSIZE(state)
    cdef cnp.npy_intp d[2]
    d[0] = n
    d[1] = cnp.PyArray_DIMS(state)[1]
    out = cnp.PyArray_ZEROS(2, d, cnp.PyArray_TYPE(state), 0)
    cdef const char* src = <const char*>cnp.PyArray_DATA(state)
    cdef char* dst = <char*>cnp.PyArray_DATA(out)
    for i in range(n):
        r = row_map[i]
        if r < 0:
            continue
        if r >= old:
            raise IndexError(f"row_map: {r} beyond the {old} tracks")
        memcpy(dst + i * row, src + r * row, row)
    return out


cdef class ZonesKernel:
    """The zones of one camera at one picture size (pipelines.zones.Zones._compile makes one)."""

    cdef const short[::1] inertia
    cdef const double[::1] inertia_s
    cdef const double[::1] ex1, ey1, ey2, slope
    cdef const Py_ssize_t[::1] bounds
    cdef const double[:, ::1] offsets
    cdef const unsigned char[:, ::1] mask
    cdef bint use_mask
    cdef Py_ssize_t n_classes

    def __init__(self, const short[::1] inertia, const double[::1] inertia_s, const double[::1] ex1,
                 const double[::1] ey1, const double[::1] ey2, const double[::1] slope,
                 const Py_ssize_t[::1] bounds, const double[:, ::1] offsets, const unsigned char[:, ::1] mask,
                 bint use_mask, Py_ssize_t n_classes):
        """``inertia``, ``inertia_s``: (Z,) frames and seconds the raw test must disagree before a flip;
        ``bounds``: (Z + 1,) first edge of each zone and the end; ``offsets``: (2, Z) anchor offsets;
        ``mask``: (classes + 1, Z) the classes each zone counts, applied when ``use_mask``."""
        if inertia_s.shape[0] != inertia.shape[0]:
            raise ValueError(f"inertia_s: {inertia_s.shape[0]} zones, inertia {inertia.shape[0]}")
        self.inertia, self.inertia_s = inertia, inertia_s
        self.ex1, self.ey1, self.ey2, self.slope = ex1, ey1, ey2, slope
        self.bounds, self.offsets, self.mask, self.use_mask = bounds, offsets, mask, use_mask
        self.n_classes = n_classes

    def step(self, const double[:, ::1] tab, cnp.ndarray active_a, const Py_ssize_t[::1] confirmed,
             cnp.ndarray inside_a, cnp.ndarray streak_a, cnp.ndarray since_a, cnp.ndarray entered_a,
             cnp.ndarray visited_a, double ts):
        """One frame: the raw point-in-polygon test of every active track (anchor inside and the zone
        counting its class), inertia streaks (frames, and time since the streak's first frame);
        ``inside``, ``streak``, ``since``, ``entered_at`` and ``visited`` updated in place. Returns (tracks, zones, dwell, counts) of the flips in row-major order (numpy's nonzero on
        the (tracks, Z) flip mask); dwell: NaN for an enter, the time inside for a leave; counts: the new
        (Z, classes + 1) counts of tracks inside, None when nothing flipped."""
        cdef Py_ssize_t n = tab.shape[1], z_n = self.inertia.shape[0], i, z, e, k = 0, p, c
        if tab.shape[0] <= R_CLS:
            raise ValueError(f"table: {tab.shape[0]} rows, the class is row {R_CLS}")
        cdef double x, y, xint
        cdef bint raw, differs
        cdef const unsigned char* active = <const unsigned char*>_data(active_a, cnp.NPY_BOOL, n, -1, "active")
        cdef unsigned char* inside = <unsigned char*>_data(inside_a, cnp.NPY_BOOL, n, z_n, "inside")
        cdef short* streak = <short*>_data(streak_a, cnp.NPY_INT16, n, z_n, "streak")
        cdef double* since = <double*>_data(since_a, cnp.NPY_FLOAT64, n, z_n, "since")
        cdef double* entered_at = <double*>_data(entered_a, cnp.NPY_FLOAT64, n, z_n, "entered_at")
        cdef unsigned char* visited = <unsigned char*>_data(visited_a, cnp.NPY_BOOL, n, z_n, "visited")
        flips_a = _zeros(n, z_n, cnp.NPY_UINT8)
        cdef unsigned char* flips = <unsigned char*>cnp.PyArray_DATA(flips_a)
        for i in range(n):
            if not active[i]:
                for z in range(z_n):
                    streak[i * z_n + z] = 0  # no disagreement in a frame the track was not seen
                continue
            c = _class(tab[R_CLS, i], self.n_classes)
            for z in range(z_n):
                x = _anchor(tab[0, i], self.offsets[0, z], tab[2, i])
                y = _anchor(tab[1, i], self.offsets[1, z], tab[3, i])
                raw = False
                for e in range(self.bounds[z], self.bounds[z + 1]):
                    if (self.ey1[e] > y) != (self.ey2[e] > y):
                        xint = y - self.ey1[e]
                        xint *= self.slope[e]
                        xint += self.ex1[e]
                        if x < xint:
                            raw = not raw
                if self.use_mask and not self.mask[c, z]:
                    raw = False
                differs = raw != (inside[i * z_n + z] != 0)
                if differs:
                    if streak[i * z_n + z] == 0:
                        since[i * z_n + z] = ts
                    if streak[i * z_n + z] < MAX_STREAK:
                        streak[i * z_n + z] += 1
                else:
                    streak[i * z_n + z] = 0
                if streak[i * z_n + z] >= self.inertia[z] and ts - since[i * z_n + z] >= self.inertia_s[z]:
                    flips[i * z_n + z] = 1
                    k += 1
        for p in range(confirmed.shape[0]):
            # A track confirmed in this frame starts in or out at once (it is active: seen this frame).
            i = confirmed[p]
            if i < 0 or i >= n:
                raise IndexError(f"confirmed: track {i} of {n}")
            for z in range(z_n):
                if not flips[i * z_n + z] and streak[i * z_n + z] > 0:
                    flips[i * z_n + z] = 1
                    k += 1
        if k == 0:
            return _NO_ROWS, _NO_ROWS, _NO_DWELL, None
        rows_a = np.empty(k, np.intp)
        cols_a = np.empty(k, np.intp)
        dwell_a = np.empty(k)
        cdef Py_ssize_t[::1] rows = rows_a, cols = cols_a
        cdef double[::1] dwell = dwell_a
        p = 0
        for i in range(n):
            for z in range(z_n):
                if flips[i * z_n + z]:
                    streak[i * z_n + z] = 0
                    inside[i * z_n + z] ^= 1
                    if inside[i * z_n + z]:
                        entered_at[i * z_n + z] = ts
                        visited[i * z_n + z] = 1
                        dwell[p] = NAN
                    else:
                        dwell[p] = ts - entered_at[i * z_n + z]
                    rows[p] = i
                    cols[p] = z
                    p += 1
        counts_a = np.zeros((z_n, self.n_classes + 1), np.int64)
        cdef long long[:, ::1] counts = counts_a
        for i in range(n):
            c = _class(tab[R_CLS, i], self.n_classes)
            for z in range(z_n):
                if inside[i * z_n + z]:
                    counts[z, c] += 1
        return rows_a, cols_a, dwell_a, counts_a



cdef class LinesKernel:
    """The lines of one camera at one picture size (pipelines.lines.Lines._compile makes one)."""

    cdef const double[::1] nx, ny, c, ux, uy, u0
    cdef const double[:, ::1] offsets
    cdef const unsigned char[:, ::1] mask
    cdef double hysteresis
    cdef Py_ssize_t n_classes

    def __init__(self, const double[::1] nx, const double[::1] ny, const double[::1] c, const double[::1] ux,
                 const double[::1] uy, const double[::1] u0, const double[:, ::1] offsets,
                 const unsigned char[:, ::1] mask, double hysteresis, Py_ssize_t n_classes):
        """Signed distance ``nx * x + ny * y - c``, projection ``ux * x + uy * y - u0`` per line; ``offsets``
        (2, L) anchor offsets; ``mask`` (classes + 1, L); ``hysteresis`` in box heights."""
        self.nx, self.ny, self.c, self.ux, self.uy, self.u0 = nx, ny, c, ux, uy, u0
        self.offsets, self.mask, self.hysteresis = offsets, mask, hysteresis
        self.n_classes = n_classes

    def step(self, const double[:, ::1] tab, cnp.ndarray active_a, const Py_ssize_t[::1] confirmed,
             cnp.ndarray side_a):
        """One frame: each active track's side, updated in place. Returns (tracks, lines, directions 0 in /
        1 out, classes) of the crossings that count (the anchor's projection within the segment, the line
        counting the class), row-major."""
        cdef Py_ssize_t n = tab.shape[1], l_n = self.nx.shape[0], i, j, k = 0, p, cl
        if tab.shape[0] <= R_CLS:
            raise ValueError(f"table: {tab.shape[0]} rows, the class is row {R_CLS}")
        cdef double x, y, dist, eps, u
        cdef signed char now
        cdef const unsigned char* active = <const unsigned char*>_data(active_a, cnp.NPY_BOOL, n, -1, "active")
        cdef signed char* side = <signed char*>_data(side_a, cnp.NPY_INT8, n, l_n, "side")
        crossed_a = _zeros(n, l_n, cnp.NPY_INT8)
        cdef signed char* crossed = <signed char*>cnp.PyArray_DATA(crossed_a)
        for i in range(n):
            if not active[i]:
                continue
            eps = self.hysteresis * tab[3, i]
            cl = _class(tab[R_CLS, i], self.n_classes)
            for j in range(l_n):
                x = _anchor(tab[0, i], self.offsets[0, j], tab[2, i])
                y = _anchor(tab[1, i], self.offsets[1, j], tab[3, i])
                dist = x * self.nx[j]
                dist += y * self.ny[j]
                dist -= self.c[j]
                now = 1 if dist > eps else (-1 if dist < -eps else 0)
                if now == 0:
                    continue
                if now * side[i * l_n + j] < 0:
                    u = x * self.ux[j] + y * self.uy[j] - self.u0[j]
                    if 0.0 <= u <= 1.0 and self.mask[cl, j]:
                        crossed[i * l_n + j] = 1 if now > 0 else 2
                        k += 1
                side[i * l_n + j] = now
        for p in range(confirmed.shape[0]):
            # A track confirmed in this frame only takes its side.
            i = confirmed[p]
            if i < 0 or i >= n:
                raise IndexError(f"confirmed: track {i} of {n}")
            for j in range(l_n):
                if crossed[i * l_n + j]:
                    crossed[i * l_n + j] = 0
                    k -= 1
        if k == 0:
            return _NO_ROWS, _NO_ROWS, _NO_ROWS, _NO_ROWS
        rows_a = np.empty(k, np.intp)
        cols_a = np.empty(k, np.intp)
        dirs_a = np.empty(k, np.intp)
        cls_a = np.empty(k, np.intp)
        cdef Py_ssize_t[::1] rows = rows_a, cols = cols_a, dirs = dirs_a, classes = cls_a
        p = 0
        for i in range(n):
            for j in range(l_n):
                if crossed[i * l_n + j]:
                    rows[p] = i
                    cols[p] = j
                    dirs[p] = crossed[i * l_n + j] - 1
                    classes[p] = _class(tab[R_CLS, i], self.n_classes)
                    p += 1
        return rows_a, cols_a, dirs_a, cls_a

LAYOUT = {"CLS": R_CLS, "STEP": 2}  # STEP: pipelines.regions.KERNEL_LAYOUT's revision (2: inertia_s)
