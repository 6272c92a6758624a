"""Wire form of the cluster: shard maps, table definitions, row blocks and replication items.

The one place (with ``wire`` for the data path) that converts between ``tigana.proto`` messages and our
dataclasses and numpy arrays. Arrays travel as packed little-endian bytes; decoders check lengths and raise
``InvalidArgument`` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from google.protobuf.message import DecodeError

from tigana.embeddings.rows import RowBatch
from tigana.proto import shard_pb2 as pb
from tigana.ps.domains import FailureDomain
from tigana.ps.errors import InvalidArgument
from tigana.ps.routing import ServerEntry, ShardMap, TableDef
from tigana.ps.wire import data as wire

_DURABILITY = {"sync": pb.DURABILITY_SYNC, "async": pb.DURABILITY_ASYNC}
_DURABILITY_NAME = {pb.DURABILITY_SYNC: "sync", pb.DURABILITY_ASYNC: "async", pb.DURABILITY_DEFAULT: "sync"}


def array(data: bytes, dtype: str, *, field: str, count: int | None = None, table: str | None = None) -> np.ndarray:
    """Packed bytes -> a read-only numpy array of ``dtype``, checking the size (and ``count`` when given).
    ``table``: the field is named ``table {table!r}: {field}`` (formatted only for an error: a replicated item
    decodes a dozen fields)."""
    dt = _DTYPES.get(dtype) or np.dtype(dtype)
    itemsize = dt.itemsize
    if len(data) % itemsize:
        raise InvalidArgument(f"field {_named(field, table)!r} has {len(data)} bytes, not a multiple of {itemsize}")
    # an absent field (most of an item's) is the shared read-only empty array: frombuffer costs a microsecond
    a = np.frombuffer(data, dt) if len(data) else _EMPTY[dt]
    if count is not None and a.shape[0] != count:
        raise InvalidArgument(f"field {_named(field, table)!r} has {a.shape[0]} values, expected {count}")
    return a


_DTYPES = {name: np.dtype(name) for name in ("<i4", "<i8", "<u8", "<f4", "<f8", "u1")}
_EMPTY = {dt: np.frombuffer(b"", dt) for dt in _DTYPES.values()}  # read-only, like any frombuffer view


def _named(field: str, table: str | None) -> str:
    return field if table is None else f"table {table!r}: {field}"


def packed(a: np.ndarray, dtype: str) -> bytes:
    """``a`` as packed little-endian bytes of ``dtype`` (C order: ``tobytes`` copies any layout in that order)."""
    dt = _DTYPES.get(dtype)
    if dt is not None and isinstance(a, np.ndarray) and a.dtype == dt:
        return a.tobytes()  # no conversion: one copy (a parsed dtype and a contiguous copy cost more than it)
    return np.ascontiguousarray(a, dtype).tobytes()


# --- tables -------------------------------------------------------------------------------------------------
def table_def_to_pb(t: TableDef) -> pb.TableSpec:
    spec = wire.spec_to_pb(t.config)
    spec.durability = _DURABILITY[t.durability]
    spec.min_copies = t.min_copies
    spec.created_epoch = t.created_epoch
    return spec


def table_def_from_pb(spec: pb.TableSpec) -> TableDef:
    if spec.durability not in _DURABILITY_NAME:
        raise InvalidArgument(f"table {spec.name!r}: field 'durability' has unknown value {spec.durability}")
    try:
        return TableDef(wire.spec_from_pb(spec), _DURABILITY_NAME[spec.durability], max(1, spec.min_copies),
                        int(spec.created_epoch))
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


# --- failure domains ----------------------------------------------------------------------------------------
def domain_to_pb(d: FailureDomain) -> pb.FailureDomain:
    return pb.FailureDomain(zone=d.zone, rack=d.rack, host=d.host)


def domain_from_pb(msg: pb.FailureDomain) -> FailureDomain:
    """A domain from the wire (absent in a map saved before domains: unknown). Its parts are checked as the
    ``--domain`` flag checks them; ``InvalidArgument`` naming the field."""
    d = FailureDomain(msg.zone, msg.rack, msg.host)
    try:
        return FailureDomain.parse(str(d), field="FailureDomain")
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


# --- shard maps ---------------------------------------------------------------------------------------------
def map_to_pb(m: ShardMap) -> pb.ShardMap:
    return pb.ShardMap(
        epoch=m.epoch, num_slots=m.num_slots, replicas=m.replicas,
        servers=[pb.ServerInfo(id=s.id, address=s.address, boot=s.boot, state=pb.SERVER_UP if s.up else pb.SERVER_DEAD,
                               domain=domain_to_pb(s.domain)) for s in m.servers],
        width=m.width, copies=packed(m.copies, "<i4"), states=packed(m.states, "u1"),
        slot_epochs=packed(m.slot_epochs, "<u8"),
        tables=[table_def_to_pb(t) for _, t in sorted(m.tables.items())], cluster_id=m.cluster_id)


def map_from_pb(msg: pb.ShardMap) -> ShardMap:
    n, width = msg.num_slots, msg.width
    if n < 1 or width < 1:
        raise InvalidArgument(f"shard map: field 'num_slots'/'width' must be >= 1, got {n}/{width}")
    copies = array(msg.copies, "<i4", field="ShardMap.copies", count=n * width).reshape(n, width)
    states = array(msg.states, "u1", field="ShardMap.states", count=n * width).reshape(n, width)
    slot_epochs = array(msg.slot_epochs, "<u8", field="ShardMap.slot_epochs", count=n)
    servers = tuple(ServerEntry(s.id, s.address, s.boot, s.state == pb.SERVER_UP, domain_from_pb(s.domain))
                    for s in msg.servers)
    tables = {t.name: table_def_from_pb(t) for t in msg.tables}
    try:
        return ShardMap(msg.epoch, n, msg.replicas, servers, copies, states, slot_epochs, tables, msg.cluster_id)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


# --- rows ---------------------------------------------------------------------------------------------------
def rows_to_pb(b: RowBatch) -> pb.RowBlock:
    return pb.RowBlock(ids=packed(b.ids, "<i8"), weights=packed(b.weights, "<f4"), state=packed(b.state, "<f4"),
                       update_count=packed(b.update_count, "<i8"), last_step=packed(b.last_step, "<i8"),
                       last_time=packed(b.last_time, "<f8"), dim=int(b.weights.shape[1]),
                       state_width=int(b.state.shape[1]))


def rows_from_pb(msg: pb.RowBlock, *, dim: int, state_width: int, table: str) -> RowBatch:
    if msg.dim != dim or msg.state_width != state_width:
        raise InvalidArgument(f"table {table!r}: RowBlock has dim {msg.dim} and state width {msg.state_width}, the table "
                              f"{dim} and {state_width}")
    ids = array(msg.ids, "<i8", field="RowBlock.ids", table=table)
    n = ids.shape[0]
    return RowBatch(
        ids, array(msg.weights, "<f4", field="RowBlock.weights", table=table, count=n * dim).reshape(n, dim),
        array(msg.state, "<f4", field="RowBlock.state", table=table, count=n * state_width).reshape(n, state_width),
        array(msg.update_count, "<i8", field="RowBlock.update_count", table=table, count=n),
        array(msg.last_step, "<i8", field="RowBlock.last_step", table=table, count=n),
        array(msg.last_time, "<f8", field="RowBlock.last_time", table=table, count=n))


# --- replication items ----------------------------------------------------------------------------------
CHANGES, SNAPSHOT_BEGIN, SNAPSHOT_ROWS, SNAPSHOT_END, BARRIER = (
    pb.ITEM_CHANGES, pb.ITEM_SNAPSHOT_BEGIN, pb.ITEM_SNAPSHOT_ROWS, pb.ITEM_SNAPSHOT_END, pb.ITEM_BARRIER)
KIND_NAMES = {CHANGES: "changes", SNAPSHOT_BEGIN: "snapshot_begin", SNAPSHOT_ROWS: "snapshot_rows",
              SNAPSHOT_END: "snapshot_end", BARRIER: "barrier"}


@dataclass(eq=False)
class Item:
    """One replication item, decoded (see ``ReplicationItem`` in shard.proto).

    slots: (k,) int32 routing slots; prev: (k, 2) uint64 (epoch, index) log positions; lsn: (epoch, index)."""

    kind: int
    table: str
    slots: np.ndarray
    lsn: tuple[int, int] = (0, 0)
    prev: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.uint64))
    rows: RowBatch | None = None
    deletes: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    sightings: tuple[np.ndarray, np.ndarray] | None = None
    step: int = 0
    dedup: list[tuple[str, int, np.ndarray]] = field(default_factory=list)
    nbytes: int = 0  # payload size, for batching
    table_epoch: int = 0  # the table incarnation's created_epoch (set when the item is queued)
    copy_id: int = 0  # SNAPSHOT_*: the slot copy it belongs to (its first SNAPSHOT_BEGIN's change-lane seq)
    after: int = 0  # SNAPSHOT_ROWS: the change lane's last seq when its rows were read (``after_seq``)

    def to_pb(self) -> pb.ReplicationItem:
        msg = pb.ReplicationItem(kind=self.kind, table=self.table, lsn_epoch=self.lsn[0], lsn_index=self.lsn[1],
                                 slots=packed(self.slots, "<i4"), step=self.step)
        if self.prev.size:
            msg.prev_epochs = packed(self.prev[:, 0], "<u8")
            msg.prev_indexes = packed(self.prev[:, 1], "<u8")
        if self.rows is not None and len(self.rows):
            msg.rows.CopyFrom(rows_to_pb(self.rows))
        if self.deletes.size:
            msg.deletes = packed(self.deletes, "<i8")
        if self.sightings is not None and self.sightings[0].size:
            msg.sighting_ids = packed(self.sightings[0], "<i8")
            msg.sighting_counts = packed(self.sightings[1], "<i8")
        for cid, seq, slots in self.dedup:
            msg.dedup.add(client_id=cid, seq=seq, slots=packed(slots, "<i4"))
        msg.table_epoch = self.table_epoch
        msg.copy_id, msg.after_seq = self.copy_id, self.after
        return msg


_NO_PREV = np.zeros((0, 2), np.uint64)
_NO_PREV.flags.writeable = False  # shared by every item without log positions (read only, as decoded arrays are)


def _prev(epochs: np.ndarray, indexes: np.ndarray) -> np.ndarray:
    """(k, 2) uint64 (epoch, index) log positions from the two packed columns (``np.stack`` costs more)."""
    prev = np.empty((epochs.shape[0], 2), np.uint64)
    prev[:, 0], prev[:, 1] = epochs, indexes
    return prev


def item_from_pb(msg: pb.ReplicationItem, *, dim: int, state_width: int) -> Item:
    t = msg.table
    slots = array(msg.slots, "<i4", field="item.slots", table=t)
    prev = _NO_PREV
    epochs, indexes = msg.prev_epochs, msg.prev_indexes
    if epochs or indexes:
        k = slots.shape[0]
        prev = _prev(array(epochs, "<u8", field="item.prev_epochs", table=t, count=k),
                     array(indexes, "<u8", field="item.prev_indexes", table=t, count=k))
    rows = rows_from_pb(msg.rows, dim=dim, state_width=state_width, table=t) if msg.HasField("rows") else None
    sightings = None
    if msg.sighting_ids:
        ids = array(msg.sighting_ids, "<i8", field="item.sighting_ids", table=t)
        sightings = (ids, array(msg.sighting_counts, "<i8", field="item.sighting_counts", table=t,
                                count=ids.shape[0]))
    dedup = [(d.client_id, int(d.seq), array(d.slots, "<i4", field="item.dedup.slots", table=t))
             for d in msg.dedup]
    return Item(msg.kind, t, slots, (int(msg.lsn_epoch), int(msg.lsn_index)), prev, rows,
                array(msg.deletes, "<i8", field="item.deletes", table=t), sightings, int(msg.step), dedup,
                table_epoch=int(msg.table_epoch), copy_id=int(msg.copy_id), after=int(msg.after_seq))


# --- the replication stream, encoded and decoded without protobuf objects -----------------------------------
# A stream carries tens of MiB of rows a second; protobuf objects copy every bytes field three times. These
# write and read the same bytes as ``ReplicateRequest`` (tests/ps/test_cluster_server.py checks them against
# protobuf): rows are joined into the request in one copy and read back as views of the received message.
# Below ``_SMALL_BYTES`` of payload the copies cost less than the Python-level fields: such requests and items
# go through protobuf's own (compiled) coder, which writes and reads the same bytes (a batch of two 16-row
# items: 73 us to encode by hand, 17 through protobuf; an item's header 5.5 us, 1.5).
_SMALL_BYTES = 1 << 16


def _payload_bytes(items: list[Item]) -> int:
    """About how many bytes of arrays ``items`` carry (what the choice of coder goes by)."""
    total = 0
    for item in items:
        total += item.slots.nbytes + item.prev.nbytes + item.deletes.nbytes
        if item.rows is not None:
            r = item.rows
            total += r.ids.nbytes + r.weights.nbytes + r.state.nbytes + 3 * r.ids.nbytes
        if item.sightings is not None:
            total += item.sightings[0].nbytes + item.sightings[1].nbytes
    return total
def _msg_field(field_no: int, parts: list) -> list:
    size = sum(memoryview(p).nbytes for p in parts)
    return [wire._varint((field_no << 3) | 2), wire._varint(size), *parts]


def _bytes_field(field_no: int, a: np.ndarray | bytes, dtype: str | None = None) -> list:
    if isinstance(a, (bytes, memoryview)):
        return wire._len_field(field_no, a) if memoryview(a).nbytes else []
    if a.size == 0:
        return []
    return wire._len_field(field_no, wire._buffer(np.ascontiguousarray(a, dtype)))


def _item_parts(item: Item) -> list:
    v = wire._varint_field
    parts: list = [v(1, item.kind), *wire._len_field(2, item.table.encode()), v(3, item.lsn[0]), v(4, item.lsn[1]),
                   *_bytes_field(5, item.slots, "<i4")]
    if item.prev.size:
        parts += _bytes_field(6, item.prev[:, 0], "<u8") + _bytes_field(7, item.prev[:, 1], "<u8")
    if item.rows is not None and len(item.rows):
        r = item.rows
        block = (_bytes_field(1, r.ids, "<i8") + _bytes_field(2, r.weights, "<f4") + _bytes_field(3, r.state, "<f4")
                 + _bytes_field(4, r.update_count, "<i8") + _bytes_field(5, r.last_step, "<i8")
                 + _bytes_field(6, r.last_time, "<f8") + [v(7, int(r.weights.shape[1])), v(8, int(r.state.shape[1]))])
        parts += _msg_field(8, block)
    parts += _bytes_field(9, item.deletes, "<i8")
    if item.sightings is not None and item.sightings[0].size:
        parts += _bytes_field(10, item.sightings[0], "<i8") + _bytes_field(11, item.sightings[1], "<i8")
    parts.append(v(12, item.step))
    for cid, seq, slots in item.dedup:
        parts += _msg_field(13, [*wire._len_field(1, cid.encode()), v(2, seq), *_bytes_field(3, slots, "<i4")])
    if item.table_epoch:
        parts.append(v(14, item.table_epoch))
    if item.copy_id:
        parts.append(v(15, item.copy_id))
    if item.after:
        parts.append(v(16, item.after))
    return parts


def encode_replicate_request(source: str, boot: str, generation: int, epoch: int, first_seq: int,
                             items: list[Item], lane: int = 0) -> bytes:
    """A serialized ``ReplicateRequest`` (one copy of the rows) of ``lane`` (0: changes, 1: a slot copy's)."""
    if _payload_bytes(items) < _SMALL_BYTES:
        return pb.ReplicateRequest(source=source, source_boot=boot, generation=generation, epoch=epoch,
                                   first_seq=first_seq, items=[item.to_pb() for item in items],
                                   lane=lane).SerializeToString()
    v = wire._varint_field
    parts: list = [*wire._len_field(1, source.encode()), *wire._len_field(2, boot.encode()), v(3, generation),
                   v(4, epoch), v(5, first_seq)]
    for item in items:
        parts += _msg_field(6, _item_parts(item))
    if lane:
        parts.append(v(7, lane))
    return b"".join(p for p in parts if memoryview(p).nbytes)


class RawReplicate:
    """A ``ReplicateRequest`` parsed into its header and the items' undecoded views (``decode_item``)."""

    __slots__ = ("source", "source_boot", "generation", "epoch", "first_seq", "items", "lane")

    def __init__(self) -> None:
        self.source, self.source_boot = "", ""
        self.generation = self.epoch = self.first_seq = self.lane = 0
        self.items: list = []


def decode_replicate_request(raw: bytes) -> RawReplicate | pb.ReplicateRequest:
    """Parse the header and keep each item as a view; anything the fast parser does not take goes to
    protobuf (which the server reads the same way). A small request (below ``_SMALL_BYTES``, whose items
    would each be parsed by protobuf anyway, once for the header and once for the item) is parsed by protobuf
    whole, once; one it refuses (a malformed item) goes the same way as a large one, so that each item is
    refused on its own, as before."""
    if len(raw) < _SMALL_BYTES:
        try:
            return pb.ReplicateRequest.FromString(raw)
        except DecodeError:
            pass
    out = RawReplicate()
    try:
        for field_no, value in wire.message_fields(memoryview(raw), "ReplicateRequest"):
            if field_no == 1:
                out.source = str(wire._len_value(value, 1), "utf-8")
            elif field_no == 2:
                out.source_boot = str(wire._len_value(value, 2), "utf-8")
            elif field_no == 3:
                out.generation = wire._int_value(value, 3)
            elif field_no == 4:
                out.epoch = wire._int_value(value, 4)
            elif field_no == 5:
                out.first_seq = wire._int_value(value, 5)
            elif field_no == 6:
                out.items.append(wire._len_value(value, 6))
            elif field_no == 7:
                out.lane = wire._int_value(value, 7)
    except (wire._NotCanonical, InvalidArgument, UnicodeDecodeError):
        return pb.ReplicateRequest.FromString(raw)
    return out


def _view_array(view: memoryview, dtype: str, field: str, count: int | None = None) -> np.ndarray:
    a = array(view, dtype, field=field, count=count)
    return a if a.flags.aligned else a.copy()  # the kernels want aligned rows


def decode_item(view: memoryview | pb.ReplicationItem, *, dim: int, state_width: int) -> Item:
    """One item (a view from ``decode_replicate_request``, or a protobuf message) as an ``Item``; arrays are
    read-only views of the message where aligned."""
    if not isinstance(view, memoryview):
        return item_from_pb(view, dim=dim, state_width=state_width)
    if view.nbytes < _SMALL_BYTES:
        return item_from_pb(pb.ReplicationItem.FromString(view), dim=dim, state_width=state_width)
    kind, table, lsn_e, lsn_i, step, table_epoch, copy_id, after = 0, "", 0, 0, 0, 0, 0, 0
    f: dict[int, memoryview] = {}
    rows_view = None
    dedup = []
    for field_no, value in wire.message_fields(view, "ReplicationItem"):
        if field_no == 1:
            kind = wire._int_value(value, 1)
        elif field_no == 2:
            table = str(wire._len_value(value, 2), "utf-8")
        elif field_no == 3:
            lsn_e = wire._int_value(value, 3)
        elif field_no == 4:
            lsn_i = wire._int_value(value, 4)
        elif field_no == 8:
            rows_view = wire._len_value(value, 8)
        elif field_no == 12:
            step = wire._int_value(value, 12)
        elif field_no == 14:
            table_epoch = wire._int_value(value, 14)
        elif field_no == 15:
            copy_id = wire._int_value(value, 15)
        elif field_no == 16:
            after = wire._int_value(value, 16)
        elif field_no == 13:
            cid, seq, slots = "", 0, memoryview(b"")
            for g, w in wire.message_fields(wire._len_value(value, 13), "DedupRecord"):
                if g == 1:
                    cid = str(wire._len_value(w, 1), "utf-8")
                elif g == 2:
                    seq = wire._int_value(w, 2)
                elif g == 3:
                    slots = wire._len_value(w, 3)
            dedup.append((cid, int(seq), array(slots, "<i4", field=f"table {table!r}: item.dedup.slots")))
        elif field_no in (5, 6, 7, 9, 10, 11):
            f[field_no] = wire._len_value(value, field_no)
    where = f"table {table!r}: item"
    empty = memoryview(b"")
    slots = array(f.get(5, empty), "<i4", field="item.slots", table=table)
    prev = _NO_PREV
    if 6 in f or 7 in f:
        k = slots.shape[0]
        prev = _prev(array(f.get(6, empty), "<u8", field="item.prev_epochs", table=table, count=k),
                     array(f.get(7, empty), "<u8", field="item.prev_indexes", table=table, count=k))
    rows = None
    if rows_view is not None:
        g: dict[int, memoryview] = {}
        rdim = rwidth = 0
        for field_no, value in wire.message_fields(rows_view, "RowBlock"):
            if field_no == 7:
                rdim = wire._int_value(value, 7)
            elif field_no == 8:
                rwidth = wire._int_value(value, 8)
            elif 1 <= field_no <= 6:
                g[field_no] = wire._len_value(value, field_no)
        if rdim != dim or rwidth != state_width:
            raise InvalidArgument(f"{where}.rows has dim {rdim} and state width {rwidth}, the table {dim} and "
                                  f"{state_width}")
        ids = _view_array(g.get(1, empty), "<i8", f"{where}.rows.ids")
        n = ids.shape[0]
        rows = RowBatch(ids, _view_array(g.get(2, empty), "<f4", f"{where}.rows.weights", n * dim).reshape(n, dim),
                        _view_array(g.get(3, empty), "<f4", f"{where}.rows.state", n * state_width
                                    ).reshape(n, state_width),
                        _view_array(g.get(4, empty), "<i8", f"{where}.rows.update_count", n),
                        _view_array(g.get(5, empty), "<i8", f"{where}.rows.last_step", n),
                        _view_array(g.get(6, empty), "<f8", f"{where}.rows.last_time", n))
    sightings = None
    if 10 in f:
        sid = array(f[10], "<i8", field="item.sighting_ids", table=table)
        sightings = (sid, array(f.get(11, empty), "<i8", field="item.sighting_counts", table=table,
                                count=sid.shape[0]))
    return Item(kind, table, slots, (int(lsn_e), int(lsn_i)), prev, rows,
                array(f.get(9, empty), "<i8", field="item.deletes", table=table), sightings, int(step), dedup,
                table_epoch=int(table_epoch), copy_id=int(copy_id), after=int(after))


def item_header(view: memoryview | pb.ReplicationItem) -> tuple[str, int]:
    """The table an item is about and its incarnation (``table_epoch``), read before the table's dims are
    known."""
    if not isinstance(view, memoryview):
        return view.table, int(view.table_epoch)
    if view.nbytes < _SMALL_BYTES:
        msg = pb.ReplicationItem.FromString(view)
        return msg.table, int(msg.table_epoch)
    table, table_epoch = "", 0
    for field_no, value in wire.message_fields(view, "ReplicationItem"):
        if field_no == 2:
            table = str(wire._len_value(value, 2), "utf-8")
        elif field_no == 14:
            table_epoch = wire._int_value(value, 14)
    return table, table_epoch
