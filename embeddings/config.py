"""Typed, frozen configuration of a table: optimizer, initializer, admission, eviction, storage.

Each component has a ``kind`` (its wire name) and numeric hyper-parameters; ``from_kind`` rebuilds one from
the wire form ``(kind, {name: value})`` and raises ``InvalidArgument`` naming the unknown field.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Union

from tigana.embeddings.errors import InvalidArgument


@dataclass(frozen=True)
class _Component:
    kind: ClassVar[str] = ""

    def params(self) -> dict[str, float]:
        """Numeric hyper-parameters by name (the wire form)."""
        return {f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)}


# --- optimizers (applied server-side to deduplicated (ids, grads) batches) -----------------------------
@dataclass(frozen=True)
class SGD(_Component):
    """w -= lr * g."""

    kind: ClassVar[str] = "sgd"
    lr: float = 0.01


@dataclass(frozen=True)
class Adagrad(_Component):
    """Element-wise Adagrad as torch.optim.Adagrad: G += g²; w -= lr * g / (sqrt(G) + eps)."""

    kind: ClassVar[str] = "adagrad"
    lr: float = 0.01
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10


@dataclass(frozen=True)
class RowWiseAdagrad(_Component):
    """Adagrad with one accumulator per row (mean of g² over the row), as in FBGEMM/TorchRec."""

    kind: ClassVar[str] = "rowwise_adagrad"
    lr: float = 0.01
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10


@dataclass(frozen=True)
class Adam(_Component):
    """Lazy Adam: only touched rows update, each with its own step count for bias correction."""

    kind: ClassVar[str] = "adam"
    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass(frozen=True)
class FTRL(_Component):
    """FTRL-Proximal (McMahan et al., 2013), per coordinate, with per-coordinate learning rate alpha/beta."""

    kind: ClassVar[str] = "ftrl"
    alpha: float = 0.05
    beta: float = 1.0
    l1: float = 0.0
    l2: float = 0.0


Optimizer = Union[SGD, Adagrad, RowWiseAdagrad, Adam, FTRL]
OPTIMIZERS: dict[str, type] = {c.kind: c for c in (SGD, Adagrad, RowWiseAdagrad, Adam, FTRL)}


# --- initializers (deterministic by (seed, id, column)) -------------------------------------------------
@dataclass(frozen=True)
class Zeros(_Component):
    kind: ClassVar[str] = "zeros"


@dataclass(frozen=True)
class Uniform(_Component):
    kind: ClassVar[str] = "uniform"
    low: float = -0.01
    high: float = 0.01


@dataclass(frozen=True)
class Normal(_Component):
    kind: ClassVar[str] = "normal"
    mean: float = 0.0
    std: float = 0.01


Initializer = Union[Zeros, Uniform, Normal]
INITIALIZERS: dict[str, type] = {c.kind: c for c in (Zeros, Uniform, Normal)}


def from_kind(registry: dict[str, type], kind: str, params: dict[str, Any], *, what: str) -> Any:
    """Build a component from its wire form; unknown kinds or parameter names raise InvalidArgument."""
    cls = registry.get(kind)
    if cls is None:
        raise InvalidArgument(f"{what}: unknown kind {kind!r}; expected one of {sorted(registry)}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(params) - names)
    if unknown:
        raise InvalidArgument(f"{what} {kind!r}: unknown parameter(s) {unknown}; expected {sorted(names)}")
    values = {}
    for k, v in params.items():
        try:
            values[k] = float(v)
        except (TypeError, ValueError):
            raise InvalidArgument(f"{what} {kind!r}: parameter {k!r} must be a number, got {v!r}") from None
    return cls(**values)


# Allowed ranges of hyper-parameters by name (as torch.optim checks them); every one must be finite.
_AT_LEAST_ZERO = frozenset({"lr", "eps", "initial_accumulator_value", "weight_decay", "beta", "l1", "l2", "std"})
_POSITIVE = frozenset({"alpha"})
_UNIT_INTERVAL = frozenset({"beta1", "beta2"})  # [0, 1)


def _hyper_parameter_problem(component: _Component) -> tuple[str, str] | None:
    """(field, why) of the first out-of-range hyper-parameter of an optimizer or initializer, or None: a NaN or
    negative learning rate would otherwise corrupt every row it touches without an error."""
    params = component.params()
    for name, value in params.items():
        if not math.isfinite(value):
            return name, f"must be finite, got {value!r}"
        if name in _AT_LEAST_ZERO and value < 0:
            return name, f"must be >= 0, got {value!r}"
        if name in _POSITIVE and value <= 0:
            return name, f"must be > 0, got {value!r}"
        if name in _UNIT_INTERVAL and not 0 <= value < 1:
            return name, f"must be in [0, 1), got {value!r}"
    if "low" in params and params["low"] > params["high"]:
        return "low", f"must be <= high ({params['high']!r}), got {params['low']!r}"
    return None


# --- admission, eviction, the table ---------------------------------------------------------------------
@dataclass(frozen=True)
class Admission:
    """Admit a new id after ``min_count`` sightings and/or with ``probability``; others read as their init."""

    min_count: int = 0
    probability: float = 1.0
    max_tracked: int = 1 << 22  # sighting counters kept for not-yet-admitted ids; cleared past this


@dataclass(frozen=True)
class Eviction:
    """Evict rows not updated for ``ttl_steps`` steps or ``ttl_seconds``; cap resident+spilled rows at ``max_rows``."""

    ttl_steps: int | None = None
    ttl_seconds: float | None = None
    max_rows: int | None = None
    policy: Literal["lru", "lfu"] = "lru"


@dataclass(frozen=True)
class TableConfig:
    """Everything that defines a table. Two tables with equal configs hold identical rows for identical pushes."""

    name: str
    dim: int
    optimizer: Optimizer = field(default_factory=SGD)
    initializer: Initializer = field(default_factory=Normal)
    seed: int = 0
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    admission: Admission = field(default_factory=Admission)
    eviction: Eviction = field(default_factory=Eviction)
    memory_budget: int | None = None  # bytes of resident rows; past it cold rows spill to disk
    spill_dir: str | None = None  # where the spill file lives (a temp dir when None and a budget is set)
    spill_max_bytes: int | None = None  # cap on the spill file's bytes (None: grows until the disk is full)
    nonfinite_grads: Literal["reject", "skip_rows"] = "reject"  # NaN/Inf in a push: reject it, or drop those rows
    backend: Literal["auto", "numba", "numpy"] = "auto"  # kernels: numba when importable, or the numpy fallback

    def __post_init__(self) -> None:
        def bad(field_name: str, why: str) -> InvalidArgument:
            return InvalidArgument(f"table {self.name!r}: field {field_name!r} {why}")

        if not isinstance(self.name, str) or not self.name:
            raise bad("name", "must be a non-empty string")
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim <= 0:
            raise bad("dim", f"must be a positive int, got {self.dim!r}")
        if not isinstance(self.optimizer, tuple(OPTIMIZERS.values())):
            raise bad("optimizer", f"must be one of {sorted(OPTIMIZERS)}, got {self.optimizer!r}")
        if not isinstance(self.initializer, tuple(INITIALIZERS.values())):
            raise bad("initializer", f"must be one of {sorted(INITIALIZERS)}, got {self.initializer!r}")
        for part in ("optimizer", "initializer"):
            problem = _hyper_parameter_problem(getattr(self, part))
            if problem is not None:
                raise bad(f"{part}.{problem[0]}", problem[1])
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise bad("dtype", f"must be float32, float16 or bfloat16, got {self.dtype!r}")
        if not 0.0 <= self.admission.probability <= 1.0:
            raise bad("admission.probability", f"must be in [0, 1], got {self.admission.probability!r}")
        if self.admission.min_count < 0:
            raise bad("admission.min_count", f"must be >= 0, got {self.admission.min_count!r}")
        if self.admission.max_tracked < 1:
            raise bad("admission.max_tracked", f"must be >= 1, got {self.admission.max_tracked!r}")
        # A TTL of zero or less (or NaN) would evict every row at the next step: a typo must not wipe a table.
        if self.eviction.ttl_steps is not None and self.eviction.ttl_steps < 1:
            raise bad("eviction.ttl_steps", f"must be None or >= 1, got {self.eviction.ttl_steps!r}")
        if self.eviction.ttl_seconds is not None and not 0 < self.eviction.ttl_seconds < math.inf:
            raise bad("eviction.ttl_seconds", f"must be None or a finite number > 0, got {self.eviction.ttl_seconds!r}")
        if self.eviction.policy not in ("lru", "lfu"):
            raise bad("eviction.policy", f"must be 'lru' or 'lfu', got {self.eviction.policy!r}")
        if self.eviction.max_rows is not None and self.eviction.max_rows <= 0:
            raise bad("eviction.max_rows", f"must be positive, got {self.eviction.max_rows!r}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise bad("memory_budget", f"must be positive, got {self.memory_budget!r}")
        if self.spill_max_bytes is not None and self.spill_max_bytes < (1 << 20):
            raise bad("spill_max_bytes", f"must be None or >= 1 MiB, got {self.spill_max_bytes!r}")
        if self.nonfinite_grads not in ("reject", "skip_rows"):
            raise bad("nonfinite_grads", f"must be 'reject' or 'skip_rows', got {self.nonfinite_grads!r}")
        if self.backend not in ("auto", "numba", "numpy"):
            raise bad("backend", f"must be 'auto', 'numba' or 'numpy', got {self.backend!r}")
