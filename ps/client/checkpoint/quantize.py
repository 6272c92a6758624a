"""Row codecs of checkpoint parts: ``none`` (float32, exact), ``fp16`` and ``int8`` (per row, asymmetric:
``lo + q * scale`` with ``q`` in 0..255, as Check-N-Run's uniform quantization).

int8 keeps each value within ``scale / 2`` of the original (``scale = (max - min) / 255`` of its row); fp16 keeps
11 significant bits. A value a codec cannot carry (not finite; beyond fp16's range) is refused with the table and
field named, so a diverged model is checkpointed exactly (without ``--quantize``), never silently clipped.
"""

from __future__ import annotations

import numpy as np

from tigana.ps.errors import InvalidArgument

__all__ = ["CODECS", "decode", "encode"]

CODECS = ("none", "fp16", "int8")
_FP16_MAX = float(np.finfo(np.float16).max)


def encode(values: np.ndarray, codec: str, *, table: str, field: str) -> dict[str, np.ndarray]:
    """``values`` ((n, d) float32) as the arrays of ``codec``: ``{field: ...}`` plus, for int8,
    ``{field}_lo`` and ``{field}_scale`` ((n,) float32)."""
    values = np.ascontiguousarray(values, np.float32)
    if codec == "none":
        return {field: values}
    if codec not in CODECS:
        raise InvalidArgument(f"checkpoint: field 'quantize' must be one of {list(CODECS)}, got {codec!r}")
    if values.size and not np.isfinite(values).all():
        bad = int((~np.isfinite(values).all(axis=1)).sum())
        raise InvalidArgument(f"table {table!r}: field {field!r}: {bad} row(s) are not finite; --quantize {codec} "
                              "cannot carry them (take this checkpoint without --quantize)")
    if codec == "fp16":
        if values.size and float(np.abs(values).max()) > _FP16_MAX:
            raise InvalidArgument(f"table {table!r}: field {field!r}: values beyond fp16's range {_FP16_MAX:g}; "
                                  "use --quantize int8 or none")
        return {field: values.astype(np.float16)}
    if values.shape[1] == 0:
        return {field: np.zeros(values.shape, np.uint8), f"{field}_lo": np.zeros(values.shape[0], np.float32),
                f"{field}_scale": np.zeros(values.shape[0], np.float32)}
    # In float64: a finite row may span more than float32's range (max - min overflows), and lo + q * scale
    # must come back within scale / 2 of every value of it.
    wide = values.astype(np.float64)
    lo = wide.min(axis=1)
    # The scale as stored (float32, rounded up: q never passes 255, also where the float64 scale is below
    # float32's smallest subnormal), so decode's lo + q * scale is the value q was rounded for.
    exact = (wide.max(axis=1) - lo) / 255.0
    scale = exact.astype(np.float32)
    scale = np.where(scale.astype(np.float64) < exact, np.nextafter(scale, np.float32(np.inf)), scale)
    safe = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float64)
    q = np.rint((wide - lo[:, None]) / safe[:, None])
    return {field: np.clip(q, 0, 255).astype(np.uint8), f"{field}_lo": lo.astype(np.float32),
            f"{field}_scale": scale}


def decode(arrays: dict[str, np.ndarray], field: str) -> np.ndarray:
    """The (n, d) float32 values ``encode`` wrote under ``field`` (any codec: told apart by dtype)."""
    values = arrays[field]
    if values.dtype == np.uint8:
        lo, scale = arrays[f"{field}_lo"], arrays[f"{field}_scale"]
        wide = lo.astype(np.float64)[:, None] + values.astype(np.float64) * scale.astype(np.float64)[:, None]
        return wide.astype(np.float32)
    return np.ascontiguousarray(values, np.float32)
