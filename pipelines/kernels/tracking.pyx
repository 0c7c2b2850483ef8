# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled per-frame step of ``pipelines.tracking.Tracker`` (greedy matching).

The numpy code in pipelines/tracking.py is the reference: this is the same arithmetic in the same order,
one pass over a few dozen tracks instead of ~150 numpy calls of fixed cost each (tests/test_kernels.py
checks that both give the same tracks, ids and events frame by frame). Table layout: pipelines.tracking's
rows, checked against ``LAYOUT`` when the tracker loads this module.
"""

import numpy as np

cimport numpy as cnp
from libc.math cimport isfinite
from libc.stdlib cimport free, malloc, qsort

cnp.import_array()

# Rows of the track table (pipelines.tracking).
cdef enum:
    R_VEL = 4
    R_VAR_POS = 8
    R_COV_PV = 12
    R_VAR_VEL = 16
    R_CUR = 20
    R_SCORE = 24
    R_BEST = 27
    R_BEST_SCORE = 31
    R_LAST_T = 34
    R_FIRST_SEEN = 35
    R_ID = 36
    R_CLS = 37
    R_STATE = 38
    R_HITS = 39
    ROWS = 40

LAYOUT = {"VEL": R_VEL, "VAR_POS": R_VAR_POS, "COV_PV": R_COV_PV, "VAR_VEL": R_VAR_VEL, "CUR": R_CUR,
          "SCORE": R_SCORE, "BEST": R_BEST, "BEST_SCORE": R_BEST_SCORE, "LAST_T": R_LAST_T,
          "FIRST_SEEN": R_FIRST_SEEN, "ID": R_ID, "CLS": R_CLS, "STATE": R_STATE, "HITS": R_HITS,
          "ROWS": ROWS, "STEP": 2}  # STEP: the step's revision (2: expiry before matching, finite times)

cdef double TENTATIVE = 0.0, TRACKED = 1.0, LOST = 2.0


cdef inline double dmax(double a, double b) noexcept nogil:
    # np.maximum: NaN if either is NaN (a != a: a is NaN; a >= NaN is false, so b, the NaN, comes back).
    return a if (a >= b or a != a) else b


cdef inline double dmin(double a, double b) noexcept nogil:
    return a if (a <= b or a != a) else b


cdef void _predict(double[:, ::1] tab, Py_ssize_t n, double k, double c_pos, double c_ratio) noexcept nogil:
    cdef Py_ssize_t i, c
    cdef double s[2]
    cdef double grow
    for i in range(n):
        s[0] = dmax(tab[2, i], 1.0)
        s[0] *= s[0]
        s[1] = dmax(tab[3, i], 1.0)
        s[1] *= s[1]
        for c in range(4):
            tab[c, i] += k * tab[R_VEL + c, i]
        tab[2, i] = dmax(tab[2, i], 1.0)
        tab[3, i] = dmax(tab[3, i], 1.0)
        s[0] *= k * c_pos
        s[1] *= k * c_pos
        for c in range(4):
            grow = tab[R_VAR_VEL + c, i] * (k * k)
            grow += (2.0 * k) * tab[R_COV_PV + c, i]
            tab[R_VAR_POS + c, i] += grow
            tab[R_VAR_POS + c, i] += s[c & 1]
            tab[R_COV_PV + c, i] += k * tab[R_VAR_VEL + c, i]
        s[0] *= c_ratio
        s[1] *= c_ratio
        for c in range(4):
            tab[R_VAR_VEL + c, i] += s[c & 1]


ctypedef struct Pair:
    double s
    Py_ssize_t r
    Py_ssize_t c


cdef int _before(const void* a, const void* b) noexcept nogil:
    """qsort order: higher score first, then lower row, then lower column."""
    cdef const Pair* x = <const Pair*>a
    cdef const Pair* y = <const Pair*>b
    if x.s != y.s:
        return -1 if x.s > y.s else 1
    if x.r != y.r:
        return -1 if x.r < y.r else 1
    return -1 if x.c < y.c else (1 if x.c > y.c else 0)


cdef Py_ssize_t _pairs(double[:, ::1] tab, const double* cur, Py_ssize_t m, const int[:] cls,
                       double high_score, double stage_iou[3][2], double stage_bonus[3][2],
                       double t, double max_age[3], Pair* pairs) noexcept nogil:
    """The pairs a stage allows: IoU of the predicted track with the detection at least the stage's (same
    class), scored IoU plus the stage bonus (pipelines.tracking.Tracker._associate); tracks past their age
    at ``t`` have none (confirmed ones unmatched longer than max_lost_s: they end in this frame). Returns
    their number."""
    cdef Py_ssize_t n = tab.shape[1], i, j, k = 0
    cdef double hx, hy, lx, ly, area, iw, ih, inter, union, v
    cdef const double* x1 = cur
    cdef const double* y1 = cur + m
    cdef const double* x2 = cur + 2 * m
    cdef const double* y2 = cur + 3 * m
    cdef const double* score = cur + 4 * m
    cdef int st, hi
    for i in range(n):
        hx = 0.5 * tab[2, i]
        hy = 0.5 * tab[3, i]
        lx = tab[0, i] - hx
        ly = tab[1, i] - hy
        hx = tab[0, i] + hx
        hy = tab[1, i] + hy
        area = tab[2, i] * tab[3, i]
        st = <int>tab[R_STATE, i]
        if st != 0 and (t - tab[R_LAST_T, i]) > max_age[2]:
            continue  # confirmed and unmatched longer than max_lost_s: ends in this frame
        for j in range(m):
            if tab[R_CLS, i] != <double>cls[j]:
                continue
            hi = 1 if score[j] >= high_score else 0
            iw = dmin(hx, x2[j]) - dmax(lx, x1[j])
            iw = dmax(iw, 0.0)
            if iw == 0.0:
                continue  # no overlap: IoU 0 passes no stage (every stage needs more than 0)
            ih = dmin(hy, y2[j]) - dmax(ly, y1[j])
            ih = dmax(ih, 0.0)
            if ih == 0.0:
                continue
            inter = iw * ih
            union = area + (x2[j] - x1[j]) * (y2[j] - y1[j])
            union -= inter
            v = inter / union
            if v >= stage_iou[st][hi]:
                pairs[k].s = v + stage_bonus[st][hi]
                pairs[k].r = i
                pairs[k].c = j
                k += 1
    return k


cdef Py_ssize_t _greedy(Pair* pairs, Py_ssize_t k, Py_ssize_t n, Py_ssize_t m, Py_ssize_t* row_col,
                        Py_ssize_t* col_row) noexcept nogil:
    """Greedy matching, best pair first (ties: lower row, then lower column): the pairs of
    pipelines.matching.greedy_match. ``row_col[i]``: the column matched to row i, -1 for none."""
    cdef Py_ssize_t i, j, p, found = 0
    for i in range(n):
        row_col[i] = -1
    for j in range(m):
        col_row[j] = -1
    qsort(pairs, k, sizeof(Pair), _before)
    for p in range(k):
        i = pairs[p].r
        j = pairs[p].c
        if row_col[i] < 0 and col_row[j] < 0:
            row_col[i] = j
            col_row[j] = i
            found += 1
    return found


cdef void _correct(double[:, ::1] tab, Py_ssize_t i, const double* cur, Py_ssize_t m, Py_ssize_t j,
                   double t, double c_pos) noexcept nogil:
    """Kalman update of track ``i`` with detection ``j`` (pipelines.tracking.Tracker._correct's arithmetic)."""
    cdef double r[2]
    cdef double meas[4]
    cdef double s, gp, gv, innov, one_minus
    cdef Py_ssize_t c
    r[0] = dmax(tab[2, i], 1.0)
    r[0] *= r[0]
    r[0] *= c_pos
    r[1] = dmax(tab[3, i], 1.0)
    r[1] *= r[1]
    r[1] *= c_pos
    meas[0] = cur[j] + cur[2 * m + j]
    meas[0] *= 0.5
    meas[1] = cur[m + j] + cur[3 * m + j]
    meas[1] *= 0.5
    meas[2] = cur[2 * m + j] - cur[j]
    meas[3] = cur[3 * m + j] - cur[m + j]
    for c in range(4):
        s = tab[R_VAR_POS + c, i] + r[c & 1]
        gp = tab[R_VAR_POS + c, i] / s
        gv = tab[R_COV_PV + c, i] / s
        one_minus = r[c & 1] / s
        innov = meas[c] - tab[c, i]
        tab[c, i] += gp * innov
        tab[R_VEL + c, i] += gv * innov
        tab[R_VAR_VEL + c, i] -= gv * tab[R_COV_PV + c, i]
        tab[R_VAR_POS + c, i] *= one_minus
        tab[R_COV_PV + c, i] *= one_minus
    for c in range(7):
        tab[R_CUR + c, i] = cur[c * m + j]
    tab[R_LAST_T, i] = t
    tab[R_HITS, i] += 1.0


cdef inline cnp.ndarray _new(Py_ssize_t n, int typenum):
    """A new 1-D array (numpy's C API: a fraction of np.empty's cost, no buffer to acquire)."""
    cdef cnp.npy_intp d = n
    return cnp.PyArray_EMPTY(1, &d, typenum, 0)


cdef inline void* _data(cnp.ndarray a) noexcept:
    return cnp.PyArray_DATA(a)


cdef class Kernel:
    """The step for one set of tracker settings (pipelines.tracking.Tracker.configure makes one)."""

    cdef double high_score, new_score, c_pos, c_ratio, c_new_pos, c_new_vel
    cdef int min_hits
    cdef double stage_iou[3][2]
    cdef double stage_bonus[3][2]
    cdef double max_age[3]

    def __init__(self, double high_score, double new_score, int min_hits, stage_iou, stage_bonus, max_age,
                 double c_pos, double c_ratio, double c_new_pos, double c_new_vel):
        cdef int a, b
        self.high_score = high_score
        self.new_score = new_score
        self.min_hits = min_hits
        for a in range(3):
            self.max_age[a] = max_age[a]
            for b in range(2):
                if not stage_iou[a][b] > 0.0:
                    raise ValueError("every stage needs an IoU above 0 (pairs without overlap are skipped)")
                self.stage_iou[a][b] = stage_iou[a][b]
                self.stage_bonus[a][b] = stage_bonus[a][b]
        self.c_pos = c_pos
        self.c_ratio = c_ratio
        self.c_new_pos = c_new_pos
        self.c_new_vel = c_new_vel

    def update(self, table_in, const float[:, :] boxes, const float[:] scores, const int[:] cls, double t,
               double ts, double frame_id, double k, long long next_id):
        """One frame on the table ``table_in`` ((ROWS, tracks) float64, C order; updated in place, and a
        new table is returned when tracks were added or dropped). Detections: float32 boxes and scores,
        int32 classes (pipelines.frames).

        Returns (table, det_rows, row_map or None, confirmed, improved, ended_rows, ended_table or None, ids,
        active, next_id), with the meanings of pipelines.tracking.Step.
        """
        cdef double[:, ::1] tab = table_in
        cdef Py_ssize_t n = tab.shape[1], m = scores.shape[0]
        if tab.shape[0] != ROWS:
            raise ValueError(f"table: {tab.shape[0]} rows, the layout has {ROWS}")
        if not (isfinite(t) and isfinite(ts) and isfinite(k)):
            # A NaN last-match time never ages out (pipelines.tracking.Tracker.admit repairs them first).
            raise ValueError(f"frame times must be finite, got t={t}, ts={ts}, k={k}")
        if boxes.shape[0] != m or cls.shape[0] != m or (m and boxes.shape[1] != 4):
            raise ValueError(f"detections: {boxes.shape[0]} boxes of {boxes.shape[1]}, {m} scores, "
                             f"{cls.shape[0]} classes")
        cdef Pair* pairs = <Pair*>malloc((n * m + 1) * sizeof(Pair))
        cdef Py_ssize_t* scratch = <Py_ssize_t*>malloc((4 * n + 2 * m + 1) * sizeof(Py_ssize_t))
        cdef double* cur = <double*>malloc((7 * m + 1) * sizeof(double))
        if pairs == NULL or scratch == NULL or cur == NULL:
            free(pairs)
            free(scratch)
            free(cur)
            raise MemoryError()
        try:
            return self._update(table_in, tab, boxes, scores, cls, t, ts, frame_id, k, next_id, pairs,
                                scratch, cur)
        finally:
            free(pairs)
            free(scratch)
            free(cur)

    cdef object _update(self, table_in, double[:, ::1] tab, const float[:, :] boxes, const float[:] scores,
                        const int[:] cls, double t, double ts, double frame_id, double k, long long next_id,
                        Pair* pairs, Py_ssize_t* scratch, double* cur):
        cdef Py_ssize_t n = tab.shape[1], m = scores.shape[0], i, j, p, q, n_keep = 0, n_new = 0, n_end = 0
        cdef Py_ssize_t n_conf = 0, n_impr = 0, n_match = 0, n_out
        cdef Py_ssize_t* row_col = scratch
        cdef Py_ssize_t* keep = scratch + n
        cdef Py_ssize_t* index = scratch + 3 * n
        cdef Py_ssize_t* col_row = scratch + 4 * n
        cdef Py_ssize_t* new = scratch + 4 * n + m
        cdef double* out
        cdef double st, w, h
        cdef bint starts
        # The detections in the table's CUR layout (x1, y1, x2, y2, score, ts, frame id), as float64.
        for j in range(m):
            for q in range(4):
                cur[q * m + j] = boxes[j, q]
            cur[4 * m + j] = scores[j]
            cur[5 * m + j] = ts
            cur[6 * m + j] = frame_id
        det_rows_a = _new(m, cnp.NPY_INTP)
        cdef Py_ssize_t* det_rows = <Py_ssize_t*>_data(det_rows_a)
        for j in range(m):
            det_rows[j] = -1
        for i in range(n):
            row_col[i] = -1
        if n:
            if k > 0.0:
                _predict(tab, n, k, self.c_pos, self.c_ratio)
            if m:
                p = _pairs(tab, cur, m, cls, self.high_score, self.stage_iou, self.stage_bonus, t,
                           self.max_age, pairs)
                n_match = _greedy(pairs, p, n, m, row_col, col_row)
            for i in range(n):
                if tab[R_STATE, i] == TRACKED:
                    tab[R_STATE, i] = LOST
        conf_a = _new(n_match + m if self.min_hits <= 1 else n_match, cnp.NPY_INTP)
        impr_a = _new(n_match + m, cnp.NPY_INTP)
        cdef Py_ssize_t* conf = <Py_ssize_t*>_data(conf_a)
        cdef Py_ssize_t* impr = <Py_ssize_t*>_data(impr_a)
        # Matched tracks in track order: the Kalman update, confirmation (ids: older tracks first), best.
        for i in range(n):
            j = row_col[i]
            if j < 0:
                continue
            det_rows[j] = i
            _correct(tab, i, cur, m, j, t, self.c_pos)
            if tab[R_HITS, i] >= self.min_hits:
                if tab[R_STATE, i] == TENTATIVE:
                    tab[R_ID, i] = <double>next_id
                    next_id += 1
                    conf[n_conf] = i
                    n_conf += 1
                tab[R_STATE, i] = TRACKED
            if tab[R_SCORE, i] > tab[R_BEST_SCORE, i]:
                for q in range(7):
                    tab[R_BEST + q, i] = tab[R_CUR + q, i]
                impr[n_impr] = i
                n_impr += 1
        # Tracks that end (lost too long) or leave silently (tentative and missed), and detections that start.
        for i in range(n):
            st = tab[R_STATE, i]
            if (t - tab[R_LAST_T, i]) > self.max_age[<Py_ssize_t>st]:
                if st == LOST:
                    n_end += 1
            else:
                keep[n_keep] = i
                n_keep += 1
        for j in range(m):
            if self.new_score <= self.high_score:
                starts = cur[4 * m + j] >= self.high_score
            else:
                starts = cur[4 * m + j] >= self.new_score
            if starts and det_rows[j] < 0:
                new[n_new] = j
                n_new += 1
        ended_out = None
        ended_idx_a = _new(n_end, cnp.NPY_INTP)
        cdef Py_ssize_t* ended_idx = <Py_ssize_t*>_data(ended_idx_a)
        if n_end:
            p = 0
            for i in range(n):
                if tab[R_STATE, i] == LOST and (t - tab[R_LAST_T, i]) > self.max_age[<Py_ssize_t>LOST]:
                    ended_idx[p] = i
                    p += 1
            ended_out = np.empty((ROWS, n_end))
            out = <double*>_data(ended_out)
            for q in range(ROWS):
                for p in range(n_end):
                    out[q * n_end + p] = tab[q, ended_idx[p]]
        if n_keep == n and n_new == 0:
            ids_a, active_a = _ids_active(table_in, det_rows, m, t)
            return (table_in, det_rows_a, None, conf_a[:n_conf], impr_a[:n_impr], ended_idx_a, ended_out,
                    ids_a, active_a, next_id)
        n_out = n_keep + n_new
        table = np.zeros((ROWS, n_out))
        out = <double*>_data(table)
        map_a = _new(n_out, cnp.NPY_INTP)
        cdef Py_ssize_t* row_map = <Py_ssize_t*>_data(map_a)
        if n_keep != n:
            for i in range(n):
                index[i] = -1
            for p in range(n_keep):
                index[keep[p]] = p
            for j in range(m):
                if det_rows[j] >= 0:
                    det_rows[j] = index[det_rows[j]]
            for p in range(n_conf):
                conf[p] = index[conf[p]]
            for p in range(n_impr):
                impr[p] = index[impr[p]]
        for q in range(ROWS):
            for p in range(n_keep):
                out[q * n_out + p] = tab[q, keep[p]]
        for p in range(n_keep):
            row_map[p] = keep[p]
        for p in range(n_new):
            q = n_keep + p
            j = new[p]
            row_map[q] = -1
            out[q] = cur[j] + cur[2 * m + j]
            out[q] *= 0.5
            out[n_out + q] = cur[m + j] + cur[3 * m + j]
            out[n_out + q] *= 0.5
            out[2 * n_out + q] = cur[2 * m + j] - cur[j]
            out[3 * n_out + q] = cur[3 * m + j] - cur[m + j]
            w = dmax(out[2 * n_out + q], 1.0)
            w *= w
            h = dmax(out[3 * n_out + q], 1.0)
            h *= h
            out[R_VAR_POS * n_out + q] = w * self.c_new_pos
            out[(R_VAR_POS + 1) * n_out + q] = h * self.c_new_pos
            out[(R_VAR_POS + 2) * n_out + q] = w * self.c_new_pos
            out[(R_VAR_POS + 3) * n_out + q] = h * self.c_new_pos
            out[R_VAR_VEL * n_out + q] = w * self.c_new_vel
            out[(R_VAR_VEL + 1) * n_out + q] = h * self.c_new_vel
            out[(R_VAR_VEL + 2) * n_out + q] = w * self.c_new_vel
            out[(R_VAR_VEL + 3) * n_out + q] = h * self.c_new_vel
            for i in range(7):
                out[(R_CUR + i) * n_out + q] = cur[i * m + j]
                out[(R_BEST + i) * n_out + q] = cur[i * m + j]
            out[R_LAST_T * n_out + q] = t
            out[R_FIRST_SEEN * n_out + q] = ts
            out[R_CLS * n_out + q] = <double>cls[j]
            out[R_HITS * n_out + q] = 1.0
            if self.min_hits <= 1:  # confirmed at once
                out[R_STATE * n_out + q] = TRACKED
                out[R_ID * n_out + q] = <double>next_id
                next_id += 1
                conf[n_conf] = q
                n_conf += 1
            det_rows[j] = q
            impr[n_impr] = q
            n_impr += 1
        ids_a, active_a = _ids_active(table, det_rows, m, t)
        return (table, det_rows_a, map_a, conf_a[:n_conf], impr_a[:n_impr], ended_idx_a, ended_out, ids_a,
                active_a, next_id)


cdef tuple _ids_active(cnp.ndarray table, Py_ssize_t* det_rows, Py_ssize_t m, double t):
    """Step.ids (each detection's track id, 0 for none) and Step.active (confirmed and matched now)."""
    cdef Py_ssize_t n = cnp.PyArray_DIMS(table)[1], i, j
    cdef const double* tab = <const double*>_data(table)
    cdef const double* tid = tab + R_ID * n
    cdef const double* last = tab + R_LAST_T * n
    ids_a = _new(m, cnp.NPY_INT64)
    active_a = _new(n, cnp.NPY_BOOL)
    cdef long long* ids = <long long*>_data(ids_a)
    cdef unsigned char* active = <unsigned char*>_data(active_a)
    for j in range(m):
        ids[j] = <long long>tid[det_rows[j]] if det_rows[j] >= 0 else 0
    for i in range(n):
        active[i] = tid[i] > 0 and last[i] == t
    return ids_a, active_a
