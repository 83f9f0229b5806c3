"""Length buckets: which padded lengths a micro-batch may have.

Two things decide the length a micro-batch is padded to (its T in the padded [b, T] layout, or
its total token count N in the packed [1, N] layout):

1. **Alignment** — ``required_alignment(engine_cfg)``, the one place that computes what every
   padded length must be a multiple of: the bucket granularity (``engine.pad_to_length_bucket``,
   only when ``engine.pad_to_length`` is on) and the hard divisibility that model parallelism and
   FP8 impose whether or not bucketing is on. See ``alignment_factors`` for the derivation.
2. **Policy** — which multiples of the alignment are boundaries (``engine.pad_to_length_policy``):

   ``none``      (pad_to_length off) every multiple of the hard alignment (usually 1: no padding)
   ``multiple``  every multiple of the alignment (verl's ``pad_to_length_bucket``)
   ``geometric`` alignment x 2^(k/2), rounded up to the alignment: about two shapes per doubling
                 of length, worst-case padding under 1 - 1/sqrt(2) = 29%
   ``learned``   at most K = ``engine.pad_to_length_max_shapes`` boundaries fitted to the
                 lengths seen so far (a dynamic programme minimising padded tokens), refitted
                 after the first step and then every ``engine.pad_to_length_refresh_steps``
                 steps; boundaries are only ever added, so every shape compiled earlier stays
                 valid.

Every policy has a top boundary ``max_length`` (rounded up to the alignment): the longest length
it must cover. Lengths above it still get a shape (rounded up to the alignment, counted in
``overflows``) so a run never fails mid-way, but they are outside the policy's shape budget.
"""

from __future__ import annotations

import math
import warnings
from bisect import bisect_left
from typing import Iterable, Optional

import numpy as np

from engine.errors import ConfigError

# policy=learned: a refresh adds the fewest boundaries that get within this fraction of the
# observed real tokens of the best padding its slot allowance could reach (a boundary that saves
# less padding than that is not worth a compiled shape).
LEARNED_MIN_GAIN = 0.005


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= n (n >= 1 gives at least one multiple)."""
    return -(-max(int(n), 1) // multiple) * multiple


def alignment_factors(engine_cfg) -> dict[str, int]:
    """Every divisibility constraint on a padded length, by name (1 = no constraint).

    ``model_parallel``: Megatron splits the sequence dim over context-parallel ranks, each rank
    holding two of 2*cp chunks (load-balanced causal CP), so T must split into 2*cp chunks; with
    sequence parallelism the cp-rank's local slice L = T/cp is further split over the TP ranks.
    So L must be a multiple of lcm(tp if sequence_parallel, 2 if cp > 1, 16 if fp8,
    8 * tp if fp8 and sequence_parallel) and T = cp * L. FP8 (Transformer Engine) GEMMs need
    their token dimension to be a multiple of 16 (the all-gathered L: the weight gradient's
    inner dimension); and under SP, Transformer-Engine's column-parallel linears check the
    input *before* their all-gather (``assert_dim_for_fp8_exec`` in
    transformer_engine/pytorch/module/layernorm_linear.py and linear.py, v2.x: the product of
    the leading dims, (L / tp) * rows, a multiple of 8), so with a micro-batch of any row count
    L / tp must be a multiple of 8. verl uses tp*cp*2 (and lcm with 16 for FP8).

    ``bucket``: ``engine.pad_to_length_bucket``, only when ``engine.pad_to_length`` is on.
    """
    tp = int(getattr(engine_cfg, "tensor_model_parallel_size", 1) or 1)
    cp = int(getattr(engine_cfg, "context_parallel_size", 1) or 1)
    sp = bool(getattr(engine_cfg, "sequence_parallel", False)) and tp > 1
    fp8 = bool(getattr(engine_cfg, "fp8", False))
    local = math.lcm(tp if sp else 1, 2 if cp > 1 else 1, 16 if fp8 else 1, 8 * tp if fp8 and sp else 1)
    factors = {"model_parallel": cp * local}
    factors["bucket"] = int(engine_cfg.pad_to_length_bucket) if engine_cfg.pad_to_length else 1
    return factors


def hard_alignment(engine_cfg) -> int:
    """What every padded length must be a multiple of even with pad_to_length off."""
    return alignment_factors(engine_cfg)["model_parallel"]


def required_alignment(engine_cfg) -> int:
    """The lcm of everything that constrains a padded length under this config (see module doc)."""
    return math.lcm(*alignment_factors(engine_cfg).values())


def default_max_length(engine_cfg) -> int:
    """Top boundary when the caller knows no longer bound: the token budget, rounded down to the
    alignment (so one bucket at the top still fits ``max_tokens_per_micro_batch``)."""
    align = required_alignment(engine_cfg)
    return max(align, engine_cfg.max_tokens_per_micro_batch // align * align)


class BucketPolicy:
    """Maps a natural length n to the padded length a micro-batch gets.

    Subclasses define ``_bucket(n)`` for 1 <= n <= max_length. Lengths above ``max_length`` are
    overflows: rounded up to the alignment and counted, never an error.
    """

    name = "base"

    def __init__(self, alignment: int, max_length: int):
        if alignment < 1:
            raise ValueError(f"alignment must be >= 1, got {alignment}")
        self.alignment = int(alignment)
        self.max_length = round_up(max_length, self.alignment)
        self.overflows = 0
        self._warned_overflow = False

    # ---- what the micro-batcher calls ---------------------------------------------------
    def bucket_length(self, n: int) -> int:
        """The padded length for a natural length ``n`` (>= n, a multiple of the alignment)."""
        if n > self.max_length:
            self.overflows += 1
            if not self._warned_overflow:
                self._warned_overflow = True
                warnings.warn(f"length {n} is above the longest bucket ({self.max_length}) of the "
                              f"{self.name} policy; it gets its own shape. Pass the real longest "
                              f"sequence length as max_length to make_bucket_policy.", stacklevel=2)
            return round_up(n, self.alignment)
        return self._bucket(max(int(n), 1))

    def _bucket(self, n: int) -> int:
        raise NotImplementedError

    def boundaries(self) -> list[int]:
        """Every length <= max_length that bucket_length can return, ascending."""
        raise NotImplementedError

    # ---- learning hooks (no-ops except for policy=learned) ------------------------------
    def observe(self, lengths: Iterable[int], weights: Optional[Iterable[float]] = None) -> None:
        """Record natural micro-batch lengths (weights: rows that pay for each length's padding)."""

    def maybe_refresh(self, step: int) -> bool:
        """Refit boundaries if due at ``step``; True when boundaries changed."""
        return False

    # ---- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-serialisable state (ints, floats, lists)."""
        return {"policy": self.name, "alignment": self.alignment, "max_length": self.max_length,
                "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        if state.get("policy") != self.name:
            raise ConfigError(
                f"the checkpoint's bucket policy is {state.get('policy')!r} but "
                f"engine.pad_to_length_policy is {self.name!r}; set engine.pad_to_length_policy="
                f"{state.get('policy')} to resume with the same shapes, or start a new run.")
        self.overflows = int(state.get("overflows", 0))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(alignment={self.alignment}, max_length={self.max_length})"


class MultiplePolicy(BucketPolicy):
    """Every multiple of the alignment is a boundary (``none`` when pad_to_length is off)."""

    def __init__(self, alignment: int, max_length: int, name: str = "multiple"):
        super().__init__(alignment, max_length)
        self.name = name

    def _bucket(self, n: int) -> int:
        return round_up(n, self.alignment)

    def boundaries(self) -> list[int]:
        return list(range(self.alignment, self.max_length + 1, self.alignment))


class GeometricPolicy(BucketPolicy):
    """Boundaries alignment * 2^(k/2) rounded up to the alignment, capped by max_length."""

    name = "geometric"

    def __init__(self, alignment: int, max_length: int):
        super().__init__(alignment, max_length)
        ladder, k = [], 0
        while not ladder or ladder[-1] < self.max_length:
            v = min(round_up(math.ceil(self.alignment * 2 ** (k / 2)), self.alignment), self.max_length)
            if not ladder or v > ladder[-1]:
                ladder.append(v)
            k += 1
        self._ladder = ladder

    def _bucket(self, n: int) -> int:
        return self._ladder[bisect_left(self._ladder, n)]

    def boundaries(self) -> list[int]:
        return list(self._ladder)


class LearnedPolicy(BucketPolicy):
    """At most ``max_shapes`` boundaries, fitted to the lengths observed so far.

    Starts with one boundary, ``max_length`` (so before the first refit it behaves as a fixed
    budget). After the first step, then every ``refresh_steps`` steps, it solves, over the
    distribution of observed lengths, the exact problem "which new boundaries, added to the existing ones, minimise padded tokens"
    with a dynamic programme over candidate boundaries. The distribution is the observed
    histogram smoothed by nearest neighbours (``smoothed_histogram``): fitting the raw points
    puts boundaries exactly on lengths seen once, which later lengths almost never hit. Each
    refit may fill at most half of the free slots (rounded up), keeping room for the
    distribution to drift (RL responses lengthen during training), and adds a boundary only if
    it earns its compiled shape (``LEARNED_MIN_GAIN``). Boundaries are never removed.
    """

    name = "learned"

    def __init__(self, alignment: int, max_length: int, max_shapes: int, refresh_steps: int):
        super().__init__(alignment, max_length)
        if max_shapes < 1:
            raise ValueError(f"max_shapes must be >= 1, got {max_shapes}")
        self.max_shapes = int(max_shapes)
        self.refresh_steps = max(1, int(refresh_steps))
        self._boundaries = [self.max_length]
        # aligned length -> [sum of weights, sum of weight*n, number of observations]
        self._hist: dict[int, list[float]] = {}
        self._last_refresh = 0
        self.refreshes = 0        # refreshes that added boundaries
        self.refreshes_tried = 0

    def _bucket(self, n: int) -> int:
        return self._boundaries[bisect_left(self._boundaries, n)]

    def boundaries(self) -> list[int]:
        return list(self._boundaries)

    def observe(self, lengths, weights=None) -> None:
        lengths = [int(n) for n in lengths]
        weights = [1.0] * len(lengths) if weights is None else [float(w) for w in weights]
        for n, w in zip(lengths, weights):
            key = round_up(n, self.alignment)
            if key > self.max_length:
                continue  # overflows are counted in bucket_length; no boundary can cover them
            cell = self._hist.setdefault(key, [0.0, 0.0, 0.0])
            cell[0] += w
            cell[1] += w * n
            cell[2] += 1

    def maybe_refresh(self, step: int) -> bool:
        """Refit at the first call that has observations (so the fixed-budget warm-up lasts one
        step), then every ``refresh_steps`` steps."""
        if not self._hist or (self.refreshes_tried and step - self._last_refresh < self.refresh_steps):
            return False
        self._last_refresh = step
        self.refreshes_tried += 1
        free = self.max_shapes - len(self._boundaries)
        if free <= 0:
            return False
        smoothed = smoothed_histogram(self._hist, self.alignment, self.max_length, self._boundaries)
        added = fit_new_boundaries(smoothed, self._boundaries, max_new=math.ceil(free / 2),
                                   min_gain=LEARNED_MIN_GAIN)
        if not added:
            return False
        self._boundaries = sorted(set(self._boundaries) | set(added))
        self.refreshes += 1
        assert len(self._boundaries) <= self.max_shapes
        return True

    def state_dict(self) -> dict:
        out = super().state_dict()
        out.update({"max_shapes": self.max_shapes, "boundaries": list(self._boundaries),
                    "histogram": [[k, w, s, c] for k, (w, s, c) in sorted(self._hist.items())],
                    "last_refresh": self._last_refresh, "refreshes": self.refreshes,
                    "refreshes_tried": self.refreshes_tried})
        return out

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        loaded = [int(b) for b in state.get("boundaries", [])]
        bad = [b for b in loaded if b % self.alignment]
        if bad:
            raise ConfigError(
                f"the checkpoint's learned bucket boundaries {bad} are not multiples of the "
                f"alignment this config requires ({self.alignment}: lcm of "
                f"engine.pad_to_length_bucket and the parallel/FP8 sizes); resume with the "
                f"parallel layout and bucket the run was saved with, or start a new run.")
        # Boundaries above this run's top can never be used again; the top itself must stay.
        kept = sorted({b for b in loaded if b < self.max_length} | {self.max_length})
        if len(kept) > self.max_shapes:
            raise ConfigError(
                f"the checkpoint holds {len(kept)} learned bucket boundaries but "
                f"engine.pad_to_length_max_shapes={self.max_shapes}; boundaries are never removed "
                f"(their shapes are compiled), so set engine.pad_to_length_max_shapes>={len(kept)}.")
        self._boundaries = kept
        self._hist = {int(row[0]): [float(row[1]), float(row[2]), float(row[3]) if len(row) > 3 else 1.0]
                      for row in state.get("histogram", []) if int(row[0]) <= self.max_length}
        self._last_refresh = int(state.get("last_refresh", 0))
        self.refreshes = int(state.get("refreshes", 0))
        self.refreshes_tried = int(state.get("refreshes_tried", self.refreshes))

    def __repr__(self) -> str:
        return (f"LearnedPolicy(alignment={self.alignment}, max_length={self.max_length}, "
                f"max_shapes={self.max_shapes}, boundaries={self._boundaries})")


SMOOTHING_MAX_POINTS = 512


def smoothed_histogram(hist: dict, alignment: int, top: int, extra_points: Iterable[int] = (),
                       max_points: int = SMOOTHING_MAX_POINTS) -> dict:
    """The observed length distribution, smoothed, on a grid of candidate boundaries.

    ``hist`` maps an aligned length to [W, S, C] (summed weight, summed weight*length, number of
    observations). Each observation stands for the lengths nearer to it than to any other
    observation (its nearest-neighbour cell, between the midpoints to its neighbours): an
    isolated length spreads over a wide cell, a dense region stays narrow, and of C repeated
    observations of one length only the two outermost spread (half a cell each side), the rest
    stay exactly there. The result maps grid points (multiples of the alignment, coarsened so
    there are at most ``max_points``, plus ``extra_points`` and ``top``) to the [W, S] of the
    smoothed mass in (previous grid point, grid point]. Total W is preserved; S moves with the
    smoothing (a cell's mean is its midpoint, not the observed length).
    """
    step = alignment * max(1, math.ceil(top / alignment / max_points))
    grid = sorted(set(range(step, top + 1, step)) | {int(p) for p in extra_points if p <= top} | {top})
    keys = sorted(k for k in hist if k <= top and hist[k][0] > 0)
    out: dict[int, list[float]] = {}

    def deposit(g: int, w: float, s: float) -> None:
        cell = out.setdefault(g, [0.0, 0.0])
        cell[0] += w
        cell[1] += s

    xs = [hist[k][1] / hist[k][0] for k in keys]  # mean length of each observed cell
    pieces = []                                    # (lo, hi, weight): uniform on [lo, hi]
    for i, k in enumerate(keys):
        w, count = hist[k][0], (hist[k][2] if len(hist[k]) > 2 else 1.0)
        x = xs[i]
        lo = (xs[i - 1] + x) / 2 if i > 0 else (max(0.0, x - (xs[1] - x) / 2) if len(xs) > 1 else x)
        hi = (x + xs[i + 1]) / 2 if i + 1 < len(xs) else (min(float(top), x + (x - xs[i - 1]) / 2)
                                                          if len(xs) > 1 else x)
        if count <= 1:
            pieces.append((lo, hi, w))
        else:
            pieces += [(lo, x, w / count), (x, hi, w / count), (x, x, w * (count - 2) / count)]
    for lo, hi, w in pieces:
        if w <= 0:
            continue
        if hi - lo < 1e-9:
            deposit(grid[min(bisect_left(grid, lo), len(grid) - 1)], w, w * lo)
            continue
        j, a = bisect_left(grid, lo), lo
        while a < hi and j < len(grid):
            b = min(hi, float(grid[j]))
            if b > a:
                part = w * (b - a) / (hi - lo)
                deposit(grid[j], part, part * (a + b) / 2)
            a, j = max(a, b), j + 1
    return out


def fit_new_boundaries(hist: dict, existing: list[int], max_new: int, min_gain: float = 0.0) -> list[int]:
    """New boundaries (at most ``max_new``) that, with ``existing``, minimise padding of ``hist``.

    ``hist`` maps a candidate length c to [W, S, ...]: the summed weight and weight*length of the
    lengths that c is the smallest candidate >= to. Assigning them to boundary B costs B*W - S padded tokens.
    Exact DP over candidates (observed aligned lengths and existing boundaries, ascending):
    f[k][j] = least cost of covering every candidate <= c_j with c_j a boundary and k new
    boundaries used; the previous boundary c_i may not skip an existing boundary. The largest
    existing boundary must cover every observation (callers keep max_length in ``existing``).
    Returns the smallest set whose cost is within ``min_gain`` * (observed real tokens) of the
    best reachable with ``max_new`` new boundaries.
    """
    existing_set = set(existing)
    top = max(existing)
    cands = sorted({k for k in hist if k <= top} | existing_set)
    m = len(cands)
    c = np.array([0] + cands, dtype=np.float64)                      # 1-indexed candidates
    w = np.array([0.0] + [hist[k][0] if k in hist else 0.0 for k in cands])
    s = np.array([0.0] + [hist[k][1] if k in hist else 0.0 for k in cands])
    wp, sp = np.cumsum(w), np.cumsum(s)                             # wp[j] = sum of w[1..j]
    forced = [False] + [k in existing_set for k in cands]
    inf = float("inf")
    f = np.full((max_new + 1, m + 1), inf)
    arg = np.zeros((max_new + 1, m + 1), dtype=np.int64)
    f[0, 0] = 0.0
    lo = 0                                                          # last forced index before j
    for j in range(1, m + 1):
        prev = np.arange(lo, j)
        cost = c[j] * (wp[j] - wp[prev]) - (sp[j] - sp[prev])
        new = 0 if forced[j] else 1
        for k in range(new, max_new + 1):
            tot = f[k - new, lo:j] + cost
            i = int(np.argmin(tot))
            f[k, j], arg[k, j] = tot[i], lo + i
        if forced[j]:
            lo = j
    best_by_k = f[:, m]
    reachable = np.minimum.accumulate(best_by_k)
    tolerance = min_gain * float(sp[m])
    k_pick = int(np.argmax(reachable <= reachable[-1] + tolerance))
    k_pick = int(np.argmin(best_by_k[: k_pick + 1]))                # the exact-k solution achieving it
    chosen, j, k = [], m, k_pick
    while j > 0:
        if not forced[j]:
            chosen.append(int(cands[j - 1]))
        i = int(arg[k, j])
        k -= 0 if forced[j] else 1
        j = i
    return sorted(chosen)


def make_bucket_policy(engine_cfg, max_length: Optional[int] = None) -> BucketPolicy:
    """The policy ``engine_cfg`` asks for.

    ``max_length``: the longest natural length a micro-batch can have. Padded layout: the
    longest sequence (data.max_prompt_length + rollout.max_new_tokens). Packed layout: leave it
    None, the token budget is the longest packed length. policy=learned keeps it as its top
    boundary, so it never needs more than ``pad_to_length_max_shapes`` shapes.
    With ``engine.pad_to_length`` off this is the ``none`` policy: lengths are only rounded to
    the hard (parallel/FP8) alignment.
    """
    align = required_alignment(engine_cfg)
    top = default_max_length(engine_cfg) if max_length is None else int(max_length)
    if not engine_cfg.pad_to_length:
        return MultiplePolicy(align, top, name="none")
    policy = engine_cfg.pad_to_length_policy
    if policy == "multiple":
        return MultiplePolicy(align, top)
    if policy == "geometric":
        return GeometricPolicy(align, top)
    if policy == "learned":
        return LearnedPolicy(align, top, engine_cfg.pad_to_length_max_shapes,
                             engine_cfg.pad_to_length_refresh_steps)
    raise ConfigError(f"engine.pad_to_length_policy={policy!r} is not one of multiple, geometric, "
                      f"learned; pick one of those.")
