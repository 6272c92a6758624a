"""Regenerate the committed protobuf/gRPC modules from the ``.proto`` files in this folder.

``python -m tigana.proto.generate [OUT_DIR]`` writes ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py``;
without OUT_DIR it overwrites the committed ones. The include mapping ``tigana/proto=<this folder>`` makes
the generated imports read ``from tigana.proto import ...``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = sorted(p.name for p in HERE.glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto here into ``out_dir``; returns the files written."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-Itigana/proto={HERE}",
            f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[f"tigana/proto/{name}" for name in PROTOS],
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed for {PROTOS}")
        written = []
        out_dir.mkdir(parents=True, exist_ok=True)
        for path in sorted((Path(tmp) / "tigana" / "proto").iterdir()):
            target = out_dir / path.name
            shutil.copyfile(path, target)
            written.append(target)
        return written


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    for f in generate(out):
        print(f)
