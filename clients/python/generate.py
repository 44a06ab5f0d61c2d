#!/usr/bin/env python3
"""Generates the package's protobuf and gRPC modules from proto/outbox/v1/outbox.proto.

The stubs land in src/outbox_gateway/_proto/outbox/v1/ and are committed, so that the
package installs without grpcio-tools. grpc_tools writes absolute imports
(`from outbox.v1 import outbox_pb2`); they are rewritten to point inside the package.

    python generate.py            # regenerate in place
    python generate.py --check    # exit 1 when the committed stubs differ from the proto

Needs grpcio-tools, pinned in requirements-dev.txt: its version is part of the output.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO_ROOT = HERE.parent.parent / "proto"
PROTO = "outbox/v1/outbox.proto"
PACKAGE = HERE / "src" / "outbox_gateway" / "_proto"
IMPORT_FROM = "from outbox.v1 import"
IMPORT_TO = "from outbox_gateway._proto.outbox.v1 import"
INIT = '"""Generated from proto/outbox/v1/outbox.proto by generate.py; do not edit."""\n'


def generate(out: Path) -> None:
    """Writes the generated package (with its __init__ files) under `out`."""
    from grpc_tools import protoc  # only the generator needs grpcio-tools

    import importlib.resources

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    status = protoc.main(
        [
            "grpc_tools.protoc",
            f"--proto_path={PROTO_ROOT}",
            f"--proto_path={well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            PROTO,
        ]
    )
    if status != 0:
        raise SystemExit(f"protoc failed with status {status}")
    for directory in (out, out / "outbox", out / "outbox" / "v1"):
        (directory / "__init__.py").write_text(INIT)
    for path in (out / "outbox" / "v1").glob("*.py*"):
        text = path.read_text()
        path.write_text(text.replace(IMPORT_FROM, IMPORT_TO))


def files(root: Path) -> dict[str, str]:
    """The generated files under `root`, by relative path."""
    return {
        str(path.relative_to(root)): path.read_text()
        for path in sorted(root.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def stale() -> list[str]:
    """The files that differ between the committed stubs and a fresh generation."""
    with tempfile.TemporaryDirectory() as scratch:
        fresh = Path(scratch) / "_proto"
        generate(fresh)
        wanted, committed = files(fresh), files(PACKAGE) if PACKAGE.exists() else {}
    names = sorted(set(wanted) | set(committed))
    return [name for name in names if wanted.get(name) != committed.get(name)]


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--check", action="store_true", help="only compare, write nothing")
    check = args.parse_args().check
    if check:
        differing = stale()
        if differing:
            sys.exit(
                "the generated stubs are stale (" + ", ".join(differing) + "): "
                "run `python clients/python/generate.py`"
            )
        print("the generated stubs are up to date")
        return
    for path in PACKAGE.rglob("*"):
        if path.is_file():
            path.unlink()
    generate(PACKAGE)
    print(f"generated {PACKAGE.relative_to(HERE)}")


if __name__ == "__main__":
    main()
