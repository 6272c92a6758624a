"""``tigana admin``: operate a live cluster through its scheduler.

    tigana admin status                          servers, slots, epoch, tables, degraded slots, domains
    tigana admin top [--interval S] [--once]     the same, live: rows, load and lag per server
    tigana admin drain SERVER                    move every copy off SERVER and wait until it holds nothing
    tigana admin rebalance [--plan]              even out the measured load (rows and request rate)
    tigana admin move-slot SLOT --to SERVER      move one slot's copy (its primary by default)
    tigana admin checkpoint --dir DIR            a consistent checkpoint of every table
        [--incremental [--base DIR]] [--quantize int8|fp16]
    tigana admin restore DIR                     load a checkpoint onto the servers the cluster has now
    tigana admin export TABLE --out PATH [--since OLD]   ids and float32 rows for serving
    tigana admin export TABLE --follow --out DIR [--interval S]   a full export, then a delta every S seconds
                                                 (the export log ``tigana serve --from DIR`` follows)
    tigana admin export --follow --model DIR     the same for every table of the model a trainer publishes in
                                                 DIR, and its versions (``tigana serve --model DIR`` serves them)
    tigana admin publish rollback --model DIR [--to VERSION]   every server of DIR back to an earlier version
    tigana admin publish resume --model DIR      servers back to the newest version their gate accepts
    tigana admin verify                          compare every copy's per-slot checksums with its primary's

The scheduler comes from ``--scheduler HOST:PORT`` or ``TIGANA_SCHEDULER``. Each command prints a readable
report, or with ``--json`` a single JSON object as its last line, and exits non-zero when what it was asked
to do did not happen (a verify that finds a difference, a drain that times out...). Placement commands are
idempotent: one whose end state already holds (a slot already led by ``--to``, a server already drained, a
balanced placement) succeeds, changes nothing and says what holds (``note`` in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from tigana import ps
from tigana.proto import scheduler_pb2 as spb
from tigana.ps.errors import PSError
from tigana.ps.ops import admin
from tigana.ps.security import Security
from tigana.ps.wire import cluster as cluster_wire


def _group_flags(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """The flags every action shares. ``suppress``: the copy on each action's parser, so that they work after
    the action too (``tigana admin status --json``); given there, they override the ones before it."""
    env = os.environ.get

    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    add = parser.add_argument
    if suppress:  # the copy after the action: its default is whatever was given before it
        def add(*names: str, help: str, **kwargs: object) -> None:  # noqa: A002 - argparse's keyword
            parser.add_argument(*names, help=f"{help} (default: as given before the action)", **kwargs)

    add("--scheduler", default=default(env("TIGANA_SCHEDULER")),
        help="HOST:PORT of the scheduler (default: $TIGANA_SCHEDULER)")
    add("--json", action="store_true", default=default(False), help="print one JSON object as the last line")
    add("--timeout", type=float, default=default(600.0), help="seconds to wait for moves (default 600)")
    add("--tls-ca", default=default(env("TIGANA_TLS_CA")), help="PEM CA that verifies the cluster (TLS)")
    add("--tls-cert", default=default(env("TIGANA_TLS_CERT")), help="PEM client certificate (mutual TLS)")
    add("--tls-key", default=default(env("TIGANA_TLS_KEY")), help="PEM key of --tls-cert")
    add("--auth-token-file", default=default(env("TIGANA_ADMIN_TOKEN_FILE") or env("TIGANA_AUTH_TOKEN_FILE")),
        help="file with the admin token (default: $TIGANA_ADMIN_TOKEN_FILE)")
    add("--allow-insecure-loopback", action="store_true",
        default=default(env("TIGANA_ALLOW_INSECURE_LOOPBACK", "") in ("1", "true")),
        help="send the token without TLS (loopback only)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _group_flags(parser)
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    sub.add_parser("status", help="servers, slots, epoch, tables, degraded slots")
    p = sub.add_parser("top", help="a live view: rows, load and replication lag per server (Ctrl-C to quit)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--once", action="store_true", help="print one frame and exit (scripts, tests)")
    p = sub.add_parser("drain", help="move every copy off a server, wait until it holds nothing")
    p.add_argument("server", help="server id or address")
    p.add_argument("--undrain", action="store_true", help="let placement use the server again")
    p.add_argument("--no-wait", action="store_true", help="return once the moves are planned")
    p = sub.add_parser("rebalance", help="even out the measured load across servers")
    p.add_argument("--plan", action="store_true", help="only show the moves and the predicted load")
    p.add_argument("--row-weight", type=float, default=1.0, help="load of a row held (default 1)")
    p.add_argument("--rate-weight", type=float, default=0.0,
                   help="load of a row/s pulled or pushed (default: the mean slot's rows and rate weigh the same)")
    p.add_argument("--link-bandwidth", type=float, default=100e6, help="bytes/s, to predict move time")
    p.add_argument("--no-wait", action="store_true", help="return once the moves are planned")
    p = sub.add_parser("move-slot", help="move a slot's copy to another server")
    p.add_argument("slot", type=int, help="the slot (0 to the number of slots - 1)")
    p.add_argument("--to", required=True, help="server id or address")
    p.add_argument("--from", dest="from_", default="", help="the copy to move (default: the primary)")
    p.add_argument("--primary", action="store_true", help="the slot's primary ends on --to")
    p.add_argument("--no-wait", action="store_true", help="return once the move is planned")
    p = sub.add_parser("checkpoint", help="write a consistent checkpoint of every table")
    p.add_argument("--dir", required=True, help="the checkpoint folder to write (shared storage)")
    p.add_argument("--table", action="append", help="only these tables (repeatable)")
    p.add_argument("--incremental", action="store_true",
                   help="only the rows changed since --base (default: the newest checkpoint beside --dir; "
                        "none there: a full one)")
    p.add_argument("--base", help="the checkpoint an --incremental one builds on")
    p.add_argument("--quantize", choices=("none", "fp16", "int8"), default="none",
                   help="write the weights at lower precision (the optimizer state stays exact)")
    p.add_argument("--quantize-state", action="store_true",
                   help="with --quantize: the optimizer state at that precision too")
    p = sub.add_parser("restore", help="load a checkpoint onto the servers the cluster has now")
    p.add_argument("dir", help="a checkpoint folder written by admin checkpoint")
    p.add_argument("--table", action="append", help="only these tables (repeatable)")
    p = sub.add_parser("export", help="a table's ids and float32 rows for serving (.npy pairs)")
    p.add_argument("table", nargs="?", help="the table to export")
    p.add_argument("--out", help="the export folder (with --follow: the export log)")
    p.add_argument("--model", metavar="DIR",
                   help="with --follow, instead of TABLE and --out: every table of the model published in DIR "
                        "(tigana train --publish-dir DIR), each into DIR/tables/TABLE")
    p.add_argument("--since", default=None, help="an earlier export: only rows updated after it")
    p.add_argument("--follow", action="store_true",
                   help="keep going: write the export log into --out (a full export, then the rows changed since "
                        "the previous entry every --interval seconds) until SIGTERM or Ctrl-C")
    p.add_argument("--interval", type=float, default=None,
                   help="--follow: seconds between deltas (default 2; with --model 0.25, so that a pushed row "
                        "reaches predictions within a second)")
    p.add_argument("--overlap", type=float, default=0.5,
                   help="--follow: each delta re-reads rows updated this many seconds before the previous cut "
                        "(covers clock skew between servers; default 0.5)")
    p.add_argument("--full-every", type=int, default=100,
                   help="--follow: a new full export (compaction: drops deleted rows, prunes old deltas) every N "
                        "deltas; 0 never (default 100)")
    p = sub.add_parser("publish", help="the versions a published model's servers serve: rollback, resume")
    p.add_argument("what", choices=("rollback", "resume"),
                   help="rollback: pin every server to an earlier version; resume: unpin")
    p.add_argument("--model", required=True, metavar="DIR", help="the published model's folder")
    p.add_argument("--to", type=int, default=None,
                   help="rollback: the version (default: the one before the version served now)")
    p = sub.add_parser("verify", help="compare the copies' checksums slot by slot")
    p.add_argument("--table", default="", help="only this table (default: every table)")
    for action in sub.choices.values():
        _group_flags(action, suppress=True)


def run(args: argparse.Namespace) -> int:
    if not args.scheduler and args.action != "publish":  # publish acts on the model folder alone
        print("tigana admin: no scheduler: give --scheduler HOST:PORT or set TIGANA_SCHEDULER", file=sys.stderr)
        return 2
    try:
        args.security = Security.of_files(tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
                                          token_file=args.auth_token_file, allow_insecure=args.allow_insecure_loopback)
        ok, report = _ACTIONS[args.action](args)
    except PSError as exc:
        ok, report = False, {"error": f"{type(exc).__name__}: {exc}"}
        print(f"tigana admin {args.action}: {report['error']}", file=sys.stderr)
    if args.json:
        print(json.dumps({"action": args.action, "ok": ok, **report}), flush=True)
    return 0 if ok else 1


def _say(args: argparse.Namespace, text: str) -> None:
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)


def _status(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    s = admin.cluster_status(args.scheduler, security=args.security)
    if s is None:
        raise ps.Unavailable(f"scheduler {args.scheduler}: not reachable")
    reply = admin.status(args.scheduler, security=args.security)
    s["moving_slots"], s["draining"] = int(reply.moving_slots), list(reply.draining)
    _say(args, f"cluster {s['cluster_id']}  epoch {s['epoch']}  {s['num_slots']} slots  {s['replicas']} replica(s)  "
               f"degraded {s['degraded_slots']}  unavailable {s['unavailable_slots']}  moving {s['moving_slots']}  "
               f"domain-degraded {s['domain_degraded_slots']}")
    if not s["servers"]:
        _say(args, "no shard server has registered with the scheduler yet: start `tigana server --scheduler "
                   f"{args.scheduler}`")
    elif s["degraded_slots"]:
        _say(args, f"UNDER-REPLICATED: {s['degraded_slots']} slot(s) have fewer than {1 + s['replicas']} in-sync "
                   f"copies ({s['unprotected_slots']} only their primary): losing a server now may lose "
                   "acknowledged updates")
    if s["domain_degraded_slots"]:
        level = s["domain_level"] if s["domain_level"] != "server" else "host"
        _say(args, f"DOMAIN-DEGRADED: {s['domain_degraded_slots']} slot(s) have in-sync copies in one {level}"
                   + (f" (fewer {level}s than the {1 + s['replicas']} copies of a slot)" if s["domain_level"] == "server"
                      else "") + f": losing that {level} may lose acknowledged updates")
    _say(args, f"{'server':<14}{'address':<22}{'state':<9}{'primary':>8}{'replica':>8}{'catchup':>8}{'rows':>12}"
               f"{'bytes':>14}{'rate r/s':>12}{'lag':>8}{'heartbeat':>10}  domain")
    for srv in s["servers"]:
        st = srv["stats"]
        state = "draining" if srv["id"] in s["draining"] else ("up" if srv["up"] else "DEAD")
        _say(args, f"{srv['id']:<14}{srv['address']:<22}{state:<9}{srv['primaries']:>8}{srv['replicas']:>8}"
                   f"{srv['catching_up']:>8}{st.get('rows', 0):>12.0f}{st.get('bytes', 0):>14.0f}"
                   f"{st.get('request_rate', 0):>12.0f}{st.get('replication_lag_items', 0):>8.0f}"
                   f"{srv['last_heartbeat_s']:>9.1f}s  {srv['domain'] or '-'}")
    _say(args, f"tables: {', '.join(s['tables']) or '(none)'}")
    return True, s


def _top(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    from rich.console import Console

    from tigana.tools.admin_top import run_top

    if args.interval <= 0:
        raise ps.InvalidArgument(f"top: --interval must be > 0 seconds, got {args.interval}")
    console = Console(file=sys.stderr) if args.json else None
    status = run_top(args.scheduler, interval=args.interval, once=args.once, security=args.security,
                     console=console)
    if status is None:
        raise ps.Unavailable(f"scheduler {args.scheduler}: not reachable")
    return True, status


def _wait_moves(args: argparse.Namespace, done, what: str) -> bool:
    """Wait (with progress) until ``done(status) -> bool``; False on timeout."""
    deadline = time.monotonic() + args.timeout
    last = ""
    while True:
        reply = admin.status(args.scheduler, security=args.security)
        sent = sum(s.stats.get("slot_copy_rows_sent", 0) for s in reply.servers)
        total = sum(s.stats.get("slot_copy_rows_total", 0) for s in reply.servers)
        catching = sum(s.catching_up for s in reply.servers)
        line = (f"{what}: {reply.moving_slots} slot(s) to move, {catching} cop(ies) catching up"
                + (f", {sent:.0f}/{total:.0f} rows copied" if total else ""))
        if line != last:
            _say(args, line)
            last = line
        if done(reply):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)


def _plan_report(reply: spb.PlanResponse) -> dict[str, Any]:
    return {"moves": len(reply.moves), "bytes_moved": reply.bytes_moved,
            "predicted_seconds": round(reply.predicted_seconds, 3),
            "load_before": {"max": reply.before.max, "mean": reply.before.mean},
            "load_after": {"max": reply.after.max, "mean": reply.after.mean}, "epoch": reply.epoch,
            "note": reply.note}


def _drain(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    reply = admin.drain(args.scheduler, args.server, undrain=args.undrain, security=args.security)
    report = _plan_report(reply)
    if reply.note:  # nothing was needed, or the drain already runs: what holds
        _say(args, reply.note)
    if args.undrain or args.no_wait:
        if not reply.note:
            _say(args, f"{'undrained' if args.undrain else 'draining'} {args.server}: {len(reply.moves)} slot(s) "
                       "to move")
        return True, report
    if not reply.note:
        _say(args, f"draining {args.server}: {len(reply.moves)} slot(s) to move")

    def empty(status: spb.StatusResponse) -> bool:
        srv = next((s for s in status.servers if args.server in (s.info.id, s.info.address)), None)
        return srv is not None and srv.primaries + srv.replicas + srv.catching_up == 0 and status.moving_slots == 0

    ok = _wait_moves(args, empty, f"drain {args.server}")
    _say(args, f"{args.server} holds nothing: it can be stopped" if ok else f"drain of {args.server} timed out")
    return ok, report


def _rebalance(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    load = admin.slot_load(args.scheduler, security=args.security)
    reply = admin.rebalance(args.scheduler, plan_only=args.plan, load=load, row_weight=args.row_weight,
                            rate_weight=args.rate_weight, link_bytes_per_s=args.link_bandwidth, security=args.security)
    report = _plan_report(reply)
    if reply.note:
        _say(args, reply.note)
    _say(args, f"{len(reply.moves)} move(s), {reply.bytes_moved} bytes to copy (~{reply.predicted_seconds:.1f}s); "
               f"load max/mean {reply.before.max:.0f}/{reply.before.mean:.0f} -> {reply.after.max:.0f}/"
               f"{reply.after.mean:.0f}")
    for m in list(reply.moves)[:20]:
        _say(args, f"  slot {m.slot}: +{','.join(m.add) or '-'} -{','.join(m.remove) or '-'}"
                   + (f" primary {m.primary_from}->{m.primary_to}" if m.primary_from != m.primary_to else ""))
    if len(reply.moves) > 20:
        _say(args, f"  ... {len(reply.moves) - 20} more")
    if args.plan or args.no_wait:
        return True, report
    ok = _wait_moves(args, lambda s: s.moving_slots == 0 and not sum(x.catching_up for x in s.servers), "rebalance")
    return ok, report


def _move_slot(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    reply = admin.move_slot(args.scheduler, args.slot, args.to, from_=args.from_, primary=args.primary,
                            security=args.security)
    report = _plan_report(reply)
    if reply.note:  # the end state already holds (or is already planned): nothing new was asked
        _say(args, reply.note)
    if args.no_wait:
        return True, report
    to = args.to

    def moved(status: spb.StatusResponse) -> bool:
        m = cluster_wire.map_from_pb(status.map)
        i = next((k for k, s in enumerate(m.servers) if to in (s.id, s.address)), -1)
        held = i >= 0 and bool((m.copies[args.slot] == i).any()) and \
            m.states[args.slot][m.copies[args.slot] == i][0] == 0
        return held and (not args.primary or int(m.copies[args.slot, 0]) == i) and status.moving_slots == 0

    ok = _wait_moves(args, moved, f"move slot {args.slot}")
    _say(args, f"slot {args.slot} {'moved to ' + to if ok else 'move timed out'}")
    return ok, report


def _client(args: argparse.Namespace) -> ps.Client:
    return ps.connect(scheduler=args.scheduler, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                      auth_token_file=args.auth_token_file, allow_insecure_loopback=args.allow_insecure_loopback)


def _checkpoint(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    with _client(args) as client:
        t = time.monotonic()
        manifest = client.checkpoint(args.dir, args.table, incremental=args.incremental, base=args.base,
                                     quantize=args.quantize, quantize_state=args.quantize_state)
        seconds = time.monotonic() - t
    rows = {name: t["rows"] for name, t in manifest["tables"].items()}
    base = manifest["base"]["path"] if manifest.get("base") else None
    _say(args, f"checkpoint {args.dir} ({manifest['kind']}{', on ' + base if base else ''}, "
               f"quantize {manifest['quantize']}): {len(rows)} table(s), {sum(rows.values())} rows, "
               f"{manifest['bytes']} bytes in {seconds:.1f}s")
    return True, {"dir": args.dir, "rows": rows, "seconds": round(seconds, 3), "epoch": manifest["epoch"],
                  "kind": manifest["kind"], "base": base, "bytes": manifest["bytes"],
                  "quantize": manifest["quantize"], "cut_time": manifest["cut"]["time"]}


def _restore(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    with _client(args) as client:
        t = time.monotonic()
        rows = client.restore_checkpoint(args.dir, args.table)
        seconds = time.monotonic() - t
    _say(args, f"restored {args.dir}: {len(rows)} table(s), {sum(rows.values())} rows in {seconds:.1f}s")
    return True, {"dir": args.dir, "rows": rows, "seconds": round(seconds, 3)}


def _export(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    if args.interval is None:
        args.interval = 0.25 if args.model is not None else 2.0
    if args.model is not None:
        if not args.follow or args.table or args.out or args.since:
            raise ps.InvalidArgument("export --model DIR: give --follow, and no TABLE, --out or --since (the "
                                     "model's tables go to DIR/tables/TABLE)")
        return _export_model(args)
    if not args.table or not args.out:
        raise ps.InvalidArgument("export: give TABLE and --out (or --follow --model DIR)")
    if args.follow:
        return _export_follow(args)
    with _client(args) as client:
        meta = client.export(args.table, args.out, args.since)
    _say(args, f"exported {meta['rows']} row(s) of {args.table!r} (dim {meta['dim']}) to {args.out}"
               + (" (changed since the earlier export)" if args.since else ""))
    return True, {"out": args.out, "rows": meta["rows"], "dim": meta["dim"], "time": meta["time"]}


def _export_follow(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    """``export --follow``: the export log (``tigana.ps.serving.exportlog``) until SIGTERM/SIGINT, then exit 0."""
    import contextlib

    from tigana.ps.serving.exportlog import ExportFollower
    from tigana.tools.signals import StopSignal

    if args.since:
        raise ps.InvalidArgument("export --follow: --since does not apply (the log's own cuts are used)")
    stop = StopSignal()
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(_client(args))
        follower = ExportFollower(client, args.table, args.out, interval_s=args.interval, overlap_s=args.overlap,
                                  full_every=args.full_every)
        stack.callback(follower.close)

        def said(entry: dict[str, Any]) -> None:
            if entry.get("path"):  # an empty delta only advances the manifest's time: not worth a line
                _say(args, f"{entry['path']}: {entry['rows']} row(s) of {args.table!r}, cut {entry['time']:.3f}, "
                           f"{entry['seconds']:.3f}s")

        _say(args, f"following {args.table!r} into {args.out} every {args.interval:g}s (SIGTERM or Ctrl-C stops)")
        follower.run(stop, on_entry=said)
    m = follower.manifest or {}
    return True, {"out": args.out, "seq": m.get("seq", 0), "time": m.get("time"), "entries": follower.entries_written,
                  "rows": follower.rows_written}


def _export_model(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    """``export --follow --model DIR``: every table of the published model, until SIGTERM/SIGINT, then exit 0."""
    from tigana.ps.serving.modeldir import follow_tables
    from tigana.tools.signals import StopSignal

    stop = StopSignal()

    def said(table: str, entry: dict[str, Any]) -> None:
        if not table:
            _say(args, f"model version {entry['version']}: dense weights of step {entry['step']}, tables at "
                       f"{ {t: p['seq'] for t, p in entry['tables'].items()} }, cut {entry['time']:.3f}")
        elif entry.get("path"):
            _say(args, f"{table}/{entry['path']}: {entry['rows']} row(s), cut {entry['time']:.3f}, "
                       f"{entry['seconds']:.3f}s")

    _say(args, f"following the tables of the model in {args.model} every {args.interval:g}s (once its model.json "
               "is published; SIGTERM or Ctrl-C stops)")
    with _client(args) as client:
        result = follow_tables(client, args.model, stop, interval_s=args.interval, overlap_s=args.overlap,
                               full_every=args.full_every, on_entry=said)
    return True, {"model": args.model, **result}


def _publish(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    """``publish rollback|resume --model DIR``: written to DIR (``live.json``); every server follows it."""
    from tigana.ps.serving import modeldir

    if args.what == "resume":
        if args.to is not None:
            raise ps.InvalidArgument("publish resume: --to applies to rollback only")
        modeldir.resume(args.model)
        _say(args, f"publish: {args.model} unpinned; servers go back to the newest version their gate accepts")
        return True, {"model": args.model, "live": None}
    version = modeldir.rollback(args.model, args.to)
    _say(args, f"publish: every server of {args.model} rolls back to version {version} at its next poll")
    return True, {"model": args.model, "live": version}


def _verify(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    result = admin.verify(args.scheduler, args.table, security=args.security)
    for d in result["differing"][:50]:
        at = (f"at log position {d['primary_lsn']}" if d["primary_lsn"] and d["copy_lsn"] else
              f"(the {'copy' if d['copy_lsn'] is None else 'primary'} holds nothing of the slot under the map)")
        _say(args, f"slot {d['slot']} of {d['table']!r}: copy on {d['copy']} differs from the primary {d['primary']} "
                   f"{at} (rows: primary {d['primary_rows']}, copy {d['copy_rows']})")
    behind = result["behind"]
    if behind:  # still written, replication lagging, or a map not installed, after the settle time: not compared
        _say(args, f"{len(behind)} cop(ies) still behind their primary's log position (replication in flight) or on "
                   "a server not under the scheduler's map, not compared; e.g. slot "
                   f"{behind[0]['slot']} of {behind[0]['table']!r} on {behind[0]['copy']}")
    ok = not result["differing"] and not result["unreachable"]
    _say(args, f"verify: {result['copies_checked']} cop(ies) checked at epoch {result['epoch']}: "
               + ("all equal" if ok else f"{len(result['differing'])} differ, unreachable {result['unreachable']}"))
    return ok, {**result, "differing": result["differing"][:1000], "slots_differing": len(result["differing"]),
                "behind": behind[:1000], "copies_behind": len(behind)}


_ACTIONS = {"status": _status, "top": _top, "drain": _drain, "rebalance": _rebalance, "move-slot": _move_slot,
            "checkpoint": _checkpoint, "restore": _restore, "export": _export, "publish": _publish,
            "verify": _verify}
