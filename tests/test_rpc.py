"""A model spread over machines through llama.cpp's own RPC backend, kept in kairox's build:
kairox-completion --rpc 127.0.0.1:PORT against a local ggml-rpc-server prints what the
local run prints, dense, in exact mode and with the hybrid split.

What the hybrid does with remote layers: their dense tensors (attention, norms) live on the
remote device; a hybrid layer's FFN stays in local host memory (kairox's override) with its
slots on a local device, so the split itself never crosses the network. A sparse mode on a
layer whose FFN weights are remote runs that layer dense (row gathers read host memory).
Traffic stays on 127.0.0.1; the server is stopped at the end.
"""
from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kairox.bench import free_port
from test_hybrid import synth_model  # noqa: F401  (KB-tiny with a pack: a pytest fixture)
from test_kx_args import complete, dense_text  # noqa: F401  (dense_text: a pytest fixture)
from test_sparse import same_text


@pytest.fixture(scope="module")
def rpc_endpoint(native: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    exe = native.parent / "bin" / "ggml-rpc-server"
    if not exe.exists():
        pytest.skip(f"{exe} is not built (KAIROX_RPC=OFF)")
    port = free_port()
    log = tmp_path_factory.mktemp("rpc") / "rpc.log"
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port), "-t", "2"], stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "ggml-rpc-server did not listen: " + log.read_text()[-2000:]
                time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.parametrize("extra", [(), ("--sparse", "exact"),
                                   ("--sparse", "exact", "--gpu-slots", "24", "--kx-slots-device", "CPU")],
                         ids=["dense", "exact", "hybrid"])
def test_remote_layers_print_what_the_local_run_prints(native: Path, synth_model: Path,  # noqa: F811
                                                       dense_text: str, rpc_endpoint: str,  # noqa: F811
                                                       extra: tuple[str, ...]) -> None:
    r = complete(native, synth_model, "--rpc", rpc_endpoint, "-ngl", "99", "-v", *extra)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "layer   1 assigned to device RPC0" in r.stderr  # the layers went to the remote device
    assert same_text(r.stdout, dense_text), (r.stdout, dense_text)
