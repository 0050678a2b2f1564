"""Regenerate the gRPC stubs beside this file from `grpc_predict_v2.proto` (see `__init__`).

python -m hpcml.serve.oip_pb.generate            # rewrite the stubs
python -m hpcml.serve.oip_pb.generate --check    # exit 1 if the committed ones differ
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[2]  # .../src: protoc names modules by their path under it
PROTO = HERE / "grpc_predict_v2.proto"
OUTPUTS = ("grpc_predict_v2_pb2.py", "grpc_predict_v2_pb2.pyi", "grpc_predict_v2_pb2_grpc.py")
DEFAULT_POOL = "_descriptor_pool.Default().AddSerializedFile("
PRIVATE_POOL = "_POOL.AddSerializedFile("


def generate(out_root: Path) -> dict[str, str]:
    """Run protoc into `out_root` and return {file name: text} after the private-pool edit."""
    from grpc_tools import protoc  # dev extra

    rel = PROTO.relative_to(SRC)
    args = [
        "protoc",
        f"-I{SRC}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        str(rel),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see its message above.")
    texts = {}
    for name in OUTPUTS:
        text = (out_root / rel.parent / name).read_text()
        if name.endswith("_pb2.py"):
            if DEFAULT_POOL not in text:
                raise SystemExit(f"protoc's {name} no longer uses the default pool as expected.")
            text = text.replace(
                DEFAULT_POOL,
                PRIVATE_POOL,
            ).replace(
                "_sym_db = _symbol_database.Default()\n",
                "_sym_db = _symbol_database.Default()\n"
                "# hpcml: a private pool (see hpcml/serve/oip_pb/__init__.py).\n"
                "_POOL = _descriptor_pool.DescriptorPool()\n",
            )
        texts[name] = text
    return texts


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        texts = generate(Path(tmp))
    if "--check" in argv:
        stale = [n for n, t in texts.items() if (HERE / n).read_text() != t]
        if stale:
            print(
                f"stale gRPC stubs: {', '.join(stale)}; run python -m hpcml.serve.oip_pb.generate"
            )
            return 1
        return 0
    for name, text in texts.items():
        (HERE / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
