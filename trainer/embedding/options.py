"""How a PS table is created and read: ``TableOptions`` and the wire compressions it accepts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tigana import ps
from tigana.trainer.cache import POLICIES
from tigana.trainer.compression import AdaptiveConfig

__all__ = ["COMPRESSIONS", "TableOptions"]

COMPRESSIONS = (None, "none", "fp32", "fp16", "bf16", "int8", "adaptive")


@dataclass(frozen=True)
class TableOptions:
    """How a PS table is created and read: its server-side optimizer and initializer, staleness bound, seed,
    the wire compression of its rows (None: float32; a codec for both directions; "adaptive": chosen per
    step by ``AdaptiveCompressor`` with the knobs of ``adaptive``) and the trainer's hot-row cache
    (``cache_rows`` rows, 0: none; ``cache_max_age`` steps a copy may serve, None: no age bound;
    ``cache_policy`` lfu or lru); ``unseen``: what evaluation reads for an id the table does not hold
    (``zeros``, ``initial`` or a number: ``tigana.embeddings.unseen``, the policy ``tigana serve`` shares);
    ``durability``: "sync" or "async" on a cluster with a scheduler (None: the cluster's default, sync where
    slots have replicas), as ``ps.Client.create_table`` takes it."""

    optimizer: Any = field(default_factory=lambda: ps.Adagrad(lr=0.05))
    initializer: Any = field(default_factory=lambda: ps.Normal(std=0.01))
    staleness: int = 1
    seed: int = 0
    compression: str | None = None
    adaptive: AdaptiveConfig | None = None
    cache_rows: int = 0
    cache_max_age: int | None = None
    cache_policy: str = "lfu"
    unseen: str = "zeros"
    durability: str | None = None

    def __post_init__(self) -> None:
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if self.compression not in COMPRESSIONS:
            raise ps.InvalidArgument(f"table options: field 'compression' must be one of {COMPRESSIONS}, "
                                     f"got {self.compression!r}")
        if self.adaptive is not None and not isinstance(self.adaptive, AdaptiveConfig):
            raise ps.InvalidArgument(f"table options: field 'adaptive' must be an AdaptiveConfig, got "
                                     f"{type(self.adaptive).__name__}")
        if isinstance(self.cache_rows, bool) or not isinstance(self.cache_rows, int) or self.cache_rows < 0:
            raise ps.InvalidArgument(f"table options: field 'cache_rows' must be an integer >= 0, got "
                                     f"{self.cache_rows!r}")
        if self.cache_max_age is not None and (isinstance(self.cache_max_age, bool)
                                               or not isinstance(self.cache_max_age, int) or self.cache_max_age < 0):
            raise ps.InvalidArgument(f"table options: field 'cache_max_age' must be None or an integer >= 0, got "
                                     f"{self.cache_max_age!r}")
        try:
            ps.Unseen.parse(self.unseen, what="table options: field 'unseen'")
        except ValueError as exc:  # the storage engine's InvalidArgument
            raise ps.InvalidArgument(str(exc)) from None
        if self.durability not in (None, "sync", "async"):
            raise ps.InvalidArgument(f"table options: field 'durability' must be None, 'sync' or 'async', got "
                                     f"{self.durability!r}")
        if self.cache_policy not in POLICIES:
            raise ps.InvalidArgument(f"table options: field 'cache_policy' must be one of {POLICIES}, got "
                                     f"{self.cache_policy!r}")
