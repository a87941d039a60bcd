"""The generated protobuf code is checked in; regenerating it from proto/ must give no diff."""

from pathlib import Path

from grpc_tools import protoc  # a test dependency, pinned in pyproject.toml

ROOT = Path(__file__).resolve().parents[2]
GENERATED = [f"{name}{suffix}" for name in ("swarm", "serve") for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def test_generated_code_matches_the_schema(tmp_path):
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    import os

    cwd = os.getcwd()
    os.chdir(ROOT / "proto")
    try:
        rc = protoc.main(["protoc", "-I.", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                          f"--pyi_out={tmp_path}", *protos])
    finally:
        os.chdir(cwd)
    assert rc == 0
    for name in GENERATED:
        fresh = (tmp_path / "btnode" / "v1" / name).read_text()
        committed = (ROOT / "btnode" / "v1" / name).read_text()
        assert fresh == committed, f"btnode/v1/{name} is stale: run `make proto` and commit the result"
