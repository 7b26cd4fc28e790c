"""Generate `specdec_proto/` from `protos/` with grpcio-tools; `--check` fails if stale.

Usage: python scripts/gen_protos.py [--check]
"""
import filecmp
import pathlib
import sys
import tempfile

from grpc_tools import protoc
import grpc_tools

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
PACKAGE = "specdec_proto"


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    files = sorted(PROTOS.glob(f"{PACKAGE}/v*/*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={out}",
            f"--pyi_out={out}", f"--grpc_python_out={out}"] + [str(f) for f in files]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for d in [out / PACKAGE] + sorted(p.parent for p in (out / PACKAGE).glob("v*/*.py")):
        (d / "__init__.py").touch()
    return sorted(p.relative_to(out) for p in (out / PACKAGE).rglob("*") if p.is_file())


def main() -> int:
    check = "--check" in sys.argv
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        produced = generate(tmp)
        if check:
            stale = [str(p) for p in produced
                     if not (ROOT / p).exists() or not filecmp.cmp(tmp / p, ROOT / p, shallow=False)]
            if stale:
                print("generated code is stale; run python scripts/gen_protos.py:", *stale)
                return 1
            print("generated code matches protos/")
            return 0
        generate(ROOT)
        print("generated", len(produced), "files into", PACKAGE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
