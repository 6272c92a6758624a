"""Which ``TIGANA_*`` environment variables some ``tigana`` command reads; the others are likely typos.

A command reads ``TIGANA_<SETTING>`` for each setting of its configuration (``tigana.ps.settings``: the
setting's one name, ``TIGANA_SNAPSHOT_EVERY``, or its field name, ``TIGANA_SNAPSHOT_EVERY_S``), the scheduler
also ``TIGANA_SCHEDULER_<SETTING>``, and a few variables are read by name. A misspelled variable used to be
ignored without a word; ``tigana`` now warns about it (``unknown``), whatever the command, since one environment
often serves several (a Kubernetes pod, a SLURM job).

The trainer's settings are read from ``tigana/trainer/config.py`` without importing it (that would import
torch, which a server install lacks).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
from collections.abc import Iterable, Mapping
from functools import cache

from tigana.ps.settings import ENV_PREFIX, public_name

# read by name, not as a configuration field
BY_NAME = frozenset({
    "SCHEDULER", "PS", "CONFIG", "SCHEDULER_CONFIG", "ADMIN_TOKEN_FILE", "AUTH_TOKEN_FILE", "TLS_CA", "TLS_CERT",
    "TLS_KEY", "ALLOW_INSECURE_LOOPBACK", "ELASTIC_DIR", "RESTART_COUNT", "JOB_ID", "SNAPSHOT_ON_SHUTDOWN", "SRUN",
})
PREFIXES = ("SLURM_",)  # tools/slurm/tigana.sbatch's own variables (TIGANA_SLURM_*)


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _train_fields() -> list[str]:
    """TrainConfig's field names, parsed from its source (no torch import); [] when the module is absent."""
    # the package's folder without executing its __init__ (find_spec of "tigana.trainer.config" would)
    spec = importlib.util.find_spec("tigana.trainer")
    if spec is None or not spec.submodule_search_locations:
        return []
    path = os.path.join(list(spec.submodule_search_locations)[0], "config.py")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "TrainConfig":
            return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    return []


@cache
def known() -> frozenset[str]:
    """Every ``TIGANA_*`` suffix some command reads (``SNAPSHOT_EVERY``, ``SCHEDULER_REPLICAS``, ...)."""
    from tigana.ps.scheduler import SchedulerConfig
    from tigana.ps.serving import ServeConfig
    from tigana.ps.shard.config import ServerConfig

    names: set[str] = set(BY_NAME)
    for fields, prefixes in ((_fields(ServerConfig), ("",)), (_fields(SchedulerConfig), ("", "SCHEDULER_")),
                             (_fields(ServeConfig), ("",)), (_train_fields(), ("",))):
        for field in fields:
            for prefix in prefixes:
                names.update({prefix + field.upper(), prefix + public_name(field).upper()})
    return frozenset(names)


def unknown(environ: Mapping[str, str], names: Iterable[str] | None = None) -> list[str]:
    """The ``TIGANA_*`` variables of ``environ`` that no command reads, sorted."""
    have = known() if names is None else frozenset(names)
    out = []
    for var in environ:
        if not var.startswith(ENV_PREFIX):
            continue
        suffix = var[len(ENV_PREFIX):]
        if suffix not in have and not suffix.startswith(PREFIXES):
            out.append(var)
    return sorted(out)
