"""Generate the Python gRPC stubs from proto/ into shared/rpc (committed; a test checks they are current).

    python -m shared.rpc.codegen            # rewrite shared/rpc/pdserve/v1/*_pb2*.py
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "shared" / "rpc"


def generate(out_dir: Path = OUT_DIR) -> list[Path]:
    """Run grpc_tools.protoc; make the generated imports package-absolute (shared.rpc.pdserve.v1)."""
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(["protoc", f"-I{PROTO_DIR}", f"--python_out={tmp}", f"--grpc_python_out={tmp}", *protos])
        if rc != 0:
            raise RuntimeError(f"protoc failed with {rc}")
        written = []
        for src in sorted(Path(tmp).rglob("*.py")):
            rel = src.relative_to(tmp)
            text = re.sub(r"^from pdserve\.v1 import", "from shared.rpc.pdserve.v1 import", src.read_text(), flags=re.M)
            dst = out_dir / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(text)
            written.append(dst)
    for pkg in (out_dir / "pdserve", out_dir / "pdserve" / "v1"):
        (pkg / "__init__.py").touch()
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_DIR):
        print(path)
