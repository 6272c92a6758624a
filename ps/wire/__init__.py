"""tigana.ps.wire — the one place that converts between ``tigana.proto`` messages and our arrays and dataclasses.

- ``data``: the data path (pull and push requests and answers, rows in every wire dtype);
- ``frames``: the streaming data path's frames (``Shard/Exchange``), written and read without protobuf objects;
- ``cluster``: shard maps, table definitions, row blocks and replication items.

Ids and rows travel as packed little-endian bytes; decoders check lengths and raise ``InvalidArgument`` naming
the table and field.
"""
