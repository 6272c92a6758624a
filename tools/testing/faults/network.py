"""Network faults: a slow link (a userspace TCP proxy that delays every byte) and a partition (network
namespaces joined by veth pairs to this one, which routes between them; cut by dropping the forwarded
packets between two of them, as root).

Partition layout: the scheduler runs in namespace ``tg<k>-s`` at 10.<n>.100.2, shard i in ``tg<k>-<i>`` at
10.<n>.<i>.2; each namespace's veth peer here is 10.<n>.<i>.1 and its default route. The client (this
process) reaches everyone through the peers, so a partition between namespaces (``ip rule ... blackhole``
on the forwarded packets) leaves the client's own path to a cut-off server open: the case where a deposed
primary still hears from clients, the one fencing must handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from tigana import ps
from tigana.ps.ops import admin
from tigana.ps.ops.local import free_port
from tigana.tools.bench.ledger import PushLoop, audit, create_ledger_table
from tigana.tools.bench.report import log
from tigana.tools.testing.faults.common import (
    Report,
    cluster,
    deaths,
    ids_in_slots,
    leader_of_most,
    ledger_loop,
    percentiles,
    raw_push,
    ready_for_fault,
    wait_settled,
)


# --- a slow link -------------------------------------------------------------------------------------------
class SlowProxy:
    """Listens on a free loopback port and forwards each connection to ``target``, delivering every chunk
    ``delay_s`` after it arrived, in order, in both directions (latency without a bandwidth cap). ``delay_s``
    may be changed while it runs; it applies to chunks read afterwards."""

    def __init__(self, target: tuple[str, int], delay_s: float = 0.0, port: int = 0) -> None:
        self.target, self.delay_s = target, delay_s
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(port,), name="tigana-slow-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(10)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", port))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                wait = due - self._loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    with contextlib.suppress(OSError, RuntimeError):
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(1 << 16)
                await queue.put((self._loop.time() + self.delay_s, data))
                if not data:
                    break
            await sender
        except (OSError, asyncio.CancelledError):
            sender.cancel()
        finally:
            writer.close()

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for task in asyncio.all_tasks(self._loop):
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def slow_link(trials: int, quick: bool, **_: Any) -> Report:
    """Shard 0 of two is reached only through a slow proxy (clients, its replication peer and the
    scheduler's probes), and its own heartbeats go through another. Each trial sets a one-way delay (10% to
    40% of the 2 s replication timeout, so round trips stay under every timeout) and runs ledger loops on a
    sync and an async table: no server may be declared dead, no copy demoted, nothing lost (no primary died,
    so async loses nothing either) and async pushes go on (the primary lease holds over the slow link)."""
    timeout, replication_timeout = 3.0, 2.0
    sched_port, real_port = free_port(), free_port()
    inbound = SlowProxy(("127.0.0.1", real_port))
    to_sched = SlowProxy(("127.0.0.1", sched_port))
    fractions = [0.4, 0.1, 0.3, 0.2]  # the largest first: a quick run of 2 trials still sees it
    latencies: list[float] = []
    async_latencies: list[float] = []
    try:
        def args(i: int) -> list[str]:
            if i:
                return []
            return ["--port", str(real_port), "--advertise", inbound.address, "--scheduler", to_sched.address]

        with cluster(2, heartbeat_timeout=timeout, scheduler_args=["--port", str(sched_port)], shard_args=args) as c, \
                ps.connect(scheduler=c.scheduler, failover_timeout_s=120) as client:
            dead0, demoted0 = deaths(c), _demotions(c)
            with ledger_loop(client, ids_per_push=500) as loop, \
                    ledger_loop(client, "ledger_async", durability="async", ids_per_push=500, seed=1) as async_loop:
                for trial in range(trials):
                    delay = fractions[trial % len(fractions)] * replication_timeout
                    inbound.delay_s = to_sched.delay_s = delay
                    t0 = time.monotonic()
                    time.sleep(4.0 if quick else 8.0)
                    latencies.append(_p50_since(loop, t0 + 2 * delay))
                    async_latencies.append(_p50_since(async_loop, t0 + 2 * delay))
                    log(f"  slow-link trial {trial + 1}/{trials}: one-way delay {delay:.2f}s, push p50 sync "
                        f"{latencies[-1]:.3f}s async {async_latencies[-1]:.3f}s, deaths {deaths(c) - dead0}, "
                        f"copies demoted {_demotions(c) - demoted0}")
                inbound.delay_s = to_sched.delay_s = 0.0
                wait_settled(c)
            result, async_result = audit(client, loop), audit(client, async_loop)
            false_failovers, demoted = deaths(c) - dead0, _demotions(c) - demoted0
            why = _demotion_lines(c)[demoted0:] if demoted else []  # a miss explains itself (its logs go)
    finally:
        inbound.close()
        to_sched.close()
    f = {"false_failovers": false_failovers, "copies_demoted": demoted, "lost": result.lost,
         "doubled": result.doubled, "lost_async": async_result.lost, "doubled_async": async_result.doubled,
         "trials": trials, "delays_s": [round(fractions[t % len(fractions)] * replication_timeout, 3) for t in range(trials)],
         "push_p50_s": [round(x, 3) for x in latencies],
         "async_push_p50_s": [round(x, 3) for x in async_latencies], "heartbeat_timeout_s": timeout,
         "replication_timeout_s": replication_timeout}
    if why:
        f["demotions"] = why
    ok = false_failovers == 0 and demoted == 0 and result.lost == 0 and result.doubled == 0 and \
        async_result.lost == 0 and async_result.doubled == 0  # no primary died: async loses nothing either
    return Report("failovers", false_failovers, "target", 0, ok, f)


def _p50_since(loop: PushLoop, t: float) -> float:
    """Median latency of the pushes a loop sent at ``t`` or later and saw acknowledged (nan: none yet)."""
    sent = [d - s for s, d in loop.events[-400:] if s >= t]  # a slice of a list: atomic under the GIL
    return float(np.median(sent)) if sent else float("nan")


def _demotion_lines(c: ps.LocalCluster) -> list[str]:
    """The scheduler's log lines that demoted copies (each names the reporter and its reason)."""
    path = c.data_dir / "scheduler.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    return [line[:400] for line in text.splitlines() if "out of the in-sync set" in line]


def _demotions(c: ps.LocalCluster) -> int:
    return len(_demotion_lines(c))


# --- a partition --------------------------------------------------------------------------------------------
_NETS = itertools.count(os.getpid() % 50 + 150)


class Namespaces:
    """Network namespaces for a scheduler and ``shards`` servers, routed through this namespace."""

    def __init__(self, shards: int) -> None:
        self.net = next(_NETS)
        self.tag = f"tg{self.net}"
        self.names = {i: f"{self.tag}-{i}" for i in range(shards)} | {"s": f"{self.tag}-s"}
        self.ips = {i: f"10.{self.net}.{i if i != 's' else 100}.2" for i in self.names}
        self.rules: list[list[str]] = []
        self._ip_forward = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
        try:
            _sh("sysctl", "-qw", "net.ipv4.ip_forward=1")
            for key, ns in self.names.items():
                sub = f"10.{self.net}.{key if key != 's' else 100}"
                here, there = f"{self.tag}h{key}", f"{self.tag}n{key}"
                _sh("ip", "netns", "add", ns)
                _sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
                _sh("ip", "link", "set", there, "netns", ns)
                _sh("ip", "addr", "add", f"{sub}.1/24", "dev", here)
                _sh("ip", "link", "set", here, "up")
                _sh("ip", "-n", ns, "addr", "add", f"{sub}.2/24", "dev", there)
                _sh("ip", "-n", ns, "link", "set", there, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                _sh("ip", "-n", ns, "route", "add", "default", "via", f"{sub}.1")
        except BaseException:
            self.close()
            raise

    def prefix(self, key: int | str) -> list[str]:
        return ["ip", "netns", "exec", self.names[key]]

    def cut(self, a: int | str, others: list[int | str]) -> None:
        """Drop every packet between ``a`` and each of ``others`` (both ways), silently."""
        for b in others:
            for src, dst in ((a, b), (b, a)):
                rule = ["ip", "rule", "add", "from", self.ips[src], "to", self.ips[dst], "blackhole"]
                _sh(*rule)
                self.rules.append(rule)

    def heal(self) -> None:
        for rule in self.rules:
            subprocess.run(["ip", "rule", "del", *rule[3:]], check=False, capture_output=True)
        self.rules.clear()

    def close(self) -> None:
        self.heal()
        for key, ns in self.names.items():
            subprocess.run(["ip", "link", "del", f"{self.tag}h{key}"], check=False, capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        subprocess.run(["sysctl", "-qw", f"net.ipv4.ip_forward={self._ip_forward}"], check=False, capture_output=True)


def _sh(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")


@contextlib.contextmanager
def _partitioned_cluster(shards: int, timeout: float) -> Iterator[tuple[ps.LocalCluster, Namespaces]]:
    nets = Namespaces(shards)
    try:
        with cluster(shards, heartbeat_timeout=timeout, scheduler_prefix=nets.prefix("s"),
                     scheduler_args=["--host", nets.ips["s"]], shard_prefix=nets.prefix,
                     shard_args=lambda i: ["--host", nets.ips[i]]) as c:
            yield c, nets
    finally:
        nets.close()


def partition(trials: int, quick: bool, **_: Any) -> Report:
    """Two servers and the scheduler in their own network namespaces. Each trial cuts the primary of most
    slots off from the scheduler and its replica (the client still reaches it) until its slots fail over.
    From the cut until a heartbeat timeout after the failover, pushes stamped with its old epoch are sent to
    it straight, 8 at a time, on a sync and an async table: one it acknowledges after the failover is a
    split-brain write (the async lease must have run out by then). The cut heals and it rejoins as a copy;
    the ledger loop (sync) must balance."""
    timeout = 3.0
    split = probes = async_acked_before = 0
    recoveries: list[float] = []
    with _partitioned_cluster(2, timeout) as (c, nets), \
            ps.connect(scheduler=c.scheduler, failover_timeout_s=120, timeout_s=5) as client:
        create_ledger_table(client, "ledger-async", durability="async")
        with ledger_loop(client, num_ids=20_000, ids_per_push=500) as loop:
            for trial in range(trials):
                ready_for_fault(c, loop)
                victim, led = leader_of_most(c)
                cut_at = time.monotonic()
                answers = _cut_and_probe(c, nets, victim, led, timeout)
                failed_over = answers.pop()
                admin.wait_for(lambda t=cut_at: loop.first_ack_sent_after(t + 0.1) is not None, 60,
                               "pushes after the failover")
                recoveries.append(loop.first_ack_sent_after(cut_at + 0.1) - cut_at)
                probes += len(answers)
                split += sum(ok and sent >= failed_over for sent, ok, _ in answers)
                async_acked_before += sum(ok and sent < failed_over and table != "ledger" for sent, ok, table in answers)
                log(f"  partition trial {trial + 1}/{trials}: shard {victim} cut off, failover after "
                    f"{failed_over - cut_at:.2f}s, split-brain writes so far {split}/{probes}")
            wait_settled(c, 180)
        result = audit(client, loop)
        check = admin.verify(c.scheduler)
    f = {"split_brain_writes": split, "stale_epoch_probes": probes, "async_acked_before_failover": async_acked_before,
         "lost": result.lost, "doubled": result.doubled, **percentiles(recoveries), "trials": trials,
         "heartbeat_timeout_s": timeout, "copies_differing": len(check["differing"])}
    ok = split == 0 and result.lost == 0 and result.doubled == 0 and not check["differing"]
    return Report("writes", split, "target", 0, ok, f)


def _cut_and_probe(c: ps.LocalCluster, nets: Namespaces, victim: int, led: np.ndarray, timeout: float
                   ) -> list[Any]:
    """Cut ``victim`` off from the scheduler and the other servers, probe it with old-epoch pushes until a
    heartbeat timeout after its slots failed over, heal. Returns [(sent, acknowledged, table), ...,
    failover time]."""
    from concurrent.futures import ThreadPoolExecutor

    epoch = admin.shard_map(c.scheduler).epoch
    ids = ids_in_slots(led[:64], 20_000)
    others: list[int | str] = ["s", *[i for i in range(c.shards) if i != victim]]
    answers: list[tuple[float, bool, str]] = []
    failed_over = [float("inf")]
    lock = threading.Lock()
    slots = threading.BoundedSemaphore(8)

    def probe(k: int) -> None:
        table = ("ledger", "ledger-async")[k % 2]
        sent = time.monotonic()
        code = raw_push(c.addresses[victim], table, ids[2 * k % ids.size:2 * k % ids.size + 2], epoch, timeout_s=3.0)
        with lock:
            answers.append((sent, code == grpc.StatusCode.OK, table))

    nets.cut(victim, others)
    try:
        with ThreadPoolExecutor(8) as pool:
            for k in itertools.count():
                now = time.monotonic()
                if failed_over[0] == float("inf") and admin.shard_map(c.scheduler).epoch > epoch:
                    failed_over[0] = now
                if now > failed_over[0] + timeout or k > 10_000:
                    break
                slots.acquire()  # at most 8 in flight: a probe to a cut-off primary may wait its 3 s deadline
                pool.submit(probe, k).add_done_callback(lambda _: slots.release())
                time.sleep(0.05)
    finally:
        nets.heal()
    return [*answers, failed_over[0]]
