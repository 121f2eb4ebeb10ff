"""Regenerate the gRPC stubs in services/pb from proto/*.proto, or check they are current.

    python -m services.pb.generate           # write the stubs
    python -m services.pb.generate --check   # exit 1 if a committed stub differs from a fresh one

protoc writes ``import common_pb2``; the imports are rewritten to ``from services.pb import
common_pb2`` so the stubs live in a package (a top-level package named ``proto`` would clash
with proto-plus).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
OUT_DIR = Path(__file__).resolve().parent
_IMPORT = re.compile(r"^import (\w+_pb2(?:_grpc)?) as ", re.MULTILINE)
_PYI_IMPORT = re.compile(r"^import (\w+_pb2) as ", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # a dev-time dependency; the stubs are committed

    protos = sorted(PROTO_DIR.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *map(str, protos)]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    written = []
    for path in sorted(out_dir.glob("*_pb2*.py*")):
        text = path.read_text()
        text = _IMPORT.sub(r"from services.pb import \1 as ", text)
        text = _PYI_IMPORT.sub(r"from services.pb import \1 as ", text)
        path.write_text(text)
        written.append(path)
    return written


def stale_files() -> list[str]:
    """Names of stubs that differ from (or are missing next to) a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_text() for p in generate(Path(tmp))}
    current = {p.name: p.read_text() for p in OUT_DIR.glob("*_pb2*.py*")}
    return sorted(name for name in fresh.keys() | current.keys() if fresh.get(name) != current.get(name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the committed stubs")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale gRPC stubs: {', '.join(stale)}; run python -m services.pb.generate",
                  file=sys.stderr)
            return 1
        return 0
    for path in generate(OUT_DIR):
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
