"""``tigana admin top``: a live view of a cluster, refreshed every ``--interval`` seconds (``--once``: one frame,
for scripts and tests).

``render`` is a pure function of ``tigana.ps.ops.admin.cluster_status``'s dict (plus ``moving_slots`` and ``draining``
when known): a header with the map's epoch and slot health, then one row per server with its state, copies,
rows, memory, request rate and share of the cluster's load, replication lag and heartbeat age.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from tigana.ps.errors import PSError
from tigana.ps.ops import admin

__all__ = ["fetch", "render", "run_top"]


def _size(n: float) -> str:
    """Bytes as a short human figure (1.5 GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _count(n: float) -> str:
    """A count as a short figure (12.3k, 4.5M)."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= limit:
            return f"{n / limit:.1f}{suffix}"
    return f"{n:.0f}"


def render(status: dict[str, Any] | None, *, now: str | None = None) -> RenderableType:
    """One frame of ``top`` for ``status`` (``tigana.ps.ops.admin.cluster_status``'s dict; None: the scheduler did not
    answer). ``now``: a clock shown in the header."""
    if status is None:
        return Text("scheduler not reachable; retrying", style="bold red")
    draining = set(status.get("draining", []))
    degraded, unavailable = status.get("degraded_slots", 0), status.get("unavailable_slots", 0)
    header = Text()
    header.append(f"cluster {status.get('cluster_id', '?')}  ", style="bold")
    header.append(f"epoch {status.get('epoch', 0)}  {status.get('num_slots', 0)} slots  "
                  f"{status.get('replicas', 0)} replica(s)  ")
    header.append(f"degraded {degraded}  ", style="yellow" if degraded else "green")
    header.append(f"unavailable {unavailable}", style="bold red" if unavailable else "green")
    if "moving_slots" in status:
        header.append(f"  moving {status['moving_slots']}", style="cyan" if status["moving_slots"] else "")
    if now:
        header.append(f"  {now}", style="dim")

    servers = status.get("servers", [])
    total_rate = sum(float(s.get("stats", {}).get("request_rate", 0.0)) for s in servers if s.get("up"))
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, expand=False, header_style="bold", pad_edge=False)
    for name, justify in (("server", "left"), ("address", "left"), ("state", "left"), ("primary", "right"),
                          ("replica", "right"), ("catchup", "right"), ("rows", "right"), ("memory", "right"),
                          ("rate r/s", "right"), ("load", "right"), ("lag items", "right"), ("lag s", "right"),
                          ("heartbeat", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    rows = totals = 0.0
    for s in servers:
        st = s.get("stats", {})
        up = bool(s.get("up"))
        state, style = ("draining", "cyan") if s["id"] in draining else (("up", "green") if up else ("DEAD", "bold red"))
        rate = float(st.get("request_rate", 0.0))
        lag_items, lag_s = float(st.get("replication_lag_items", 0.0)), float(st.get("replication_lag_s", 0.0))
        beat = float(s.get("last_heartbeat_s", -1.0))
        rows += float(st.get("rows", 0.0))
        totals += float(st.get("bytes", 0.0))
        table.add_row(
            s["id"], s.get("address", ""), Text(state, style=style), str(s.get("primaries", 0)),
            str(s.get("replicas", 0)),
            Text(str(s.get("catching_up", 0)), style="yellow" if s.get("catching_up") else ""),
            _count(float(st.get("rows", 0.0))), _size(float(st.get("bytes", 0.0))), _count(rate),
            f"{100.0 * rate / total_rate:.0f}%" if total_rate > 0 and up else "-",
            Text(_count(lag_items), style="yellow" if lag_items else ""),
            Text(f"{lag_s:.1f}", style="yellow" if lag_s >= 1.0 else ""),
            "-" if beat < 0 else f"{beat:.1f}s")
    footer = Text(f"{len(servers)} server(s), {_count(rows)} rows, {_size(totals)} held (copies included); tables: "
                  f"{', '.join(status.get('tables', [])) or '(none)'}", style="dim")
    return Group(header, table, footer)


def fetch(scheduler: str, security: Any = None, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """The scheduler's status as ``render`` takes it (with moving and draining slots); None when it does not
    answer."""
    kwargs = {} if security is None else {"security": security}
    try:
        status = admin.cluster_status(scheduler, timeout_s, **kwargs)
        if status is not None:
            reply = admin.status(scheduler, timeout_s, **kwargs)
            status["moving_slots"], status["draining"] = int(reply.moving_slots), list(reply.draining)
    except PSError:
        return None
    return status


def run_top(scheduler: str, *, interval: float = 1.0, once: bool = False, security: Any = None,
            console: Console | None = None, frames: int | None = None,
            clock: Callable[[], str] = lambda: time.strftime("%H:%M:%S")) -> dict[str, Any] | None:
    """Show the cluster every ``interval`` seconds until Ctrl-C (or ``frames`` frames); with ``once``, print
    one frame and return. Returns the last status (None: the scheduler never answered)."""
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    if once:
        status = fetch(scheduler, security)
        console.print(render(status, now=clock()))
        return status
    from rich.live import Live

    status = None
    shown = 0
    try:
        with Live(console=console, auto_refresh=False, screen=console.is_terminal) as live:
            while frames is None or shown < frames:
                current = fetch(scheduler, security)
                status = current if current is not None else status
                live.update(render(current, now=clock()), refresh=True)
                shown += 1
                if frames is not None and shown >= frames:
                    break
                time.sleep(max(0.05, interval))
    except KeyboardInterrupt:
        pass
    return status
