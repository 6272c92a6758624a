"""Tigana's wire contract (``tigana.v1``): generated protobuf and gRPC modules, committed and kept fresh.

Only the wire module of ``tigana.ps`` imports these; everything else speaks numpy and dataclasses.
"""
