"""Helpers shared by the benchmark scripts in bench/: what machine and commit a result
came from, and writing raw JSON next to a markdown summary."""
from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def machine_facts() -> dict:
    facts = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        facts["cpu"] = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                            if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        # the host buffers ask for huge pages (kx-host.cpp); "never" here gives them 4 KiB pages
        for key, f in (("thp", "enabled"), ("thp_defrag", "defrag")):
            text = Path(f"/sys/kernel/mm/transparent_hugepage/{f}").read_text()
            facts[key] = text[text.index("[") + 1:text.index("]")]
    except (OSError, ValueError):
        pass
    try:
        facts["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        facts["gpu"] = None
    return facts


def git_commit() -> str:
    """The commit measured: $KX_COMMIT (set where the tree is a copy without .git), else HEAD."""
    env = os.environ.get("KX_COMMIT")
    if env:
        return env
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def write_results(out_prefix: str | Path, result: dict, summary_lines: list[str]) -> None:
    """out_prefix.json (raw) and out_prefix.md (summary, ending with the exact command)."""
    out = Path(out_prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = summary_lines + ["", "Command:", "", "```", result["command"], "```", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


def stamp_result(path: str | Path, command: str, commit: str | None = None, machine: dict | None = None) -> dict:
    """Rewrite a tool's raw JSON output (llama-bench -o json, bench/tpot.py, kairox trace
    --json) as {"command", "commit", "machine", "result"}: a result says how it was measured."""
    path = Path(path)
    result = json.loads(path.read_text())
    stamped = {"command": command, "commit": commit or git_commit(),
               "machine": machine if machine is not None else machine_facts(), "result": result}
    path.write_text(json.dumps(stamped, indent=1) + "\n")
    return stamped


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python3 -m kairox.bench",
                                 description="Stamp a raw result file with its command, commit and machine.")
    ap.add_argument("file", help="a JSON result a tool wrote")
    ap.add_argument("--command", required=True, help="the exact command that wrote it")
    ap.add_argument("--commit", help="the commit measured (default: $KX_COMMIT, else HEAD)")
    ap.add_argument("--machine", help="the machine's facts as JSON (default: this machine's)")
    a = ap.parse_args(argv)
    stamp_result(a.file, a.command, a.commit, json.loads(a.machine) if a.machine else None)
    return 0


def rss_bytes(pid: int | str = "self") -> int:
    """Resident memory of a process (Linux /proc), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for process {pid}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """An HTTP server process on 127.0.0.1 (llama-server, kairox.server), up once `ready_path`
    answers 200, its output in `log`. Raises RuntimeError with the log's tail when it exits
    or does not come up within `timeout` seconds; stop() terminates it (then kills)."""

    def __init__(self, cmd: list[str], port: int, log: Path, env: dict[str, str] | None = None,
                 timeout: float = 300, ready_path: str = "/health") -> None:
        self.cmd, self.port, self.log = cmd, port, Path(log)
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{ready_path}", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not come up in {timeout:.0f} s: {self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def counters_per_mode(llm, tokens, modes=("exact", "predicted")) -> dict:
    """For each sparse mode, the sparse kernels' counters (kairox._native.SparseCounters)
    over the same tokens, one token per decode from an empty cache: rows computed
    (density) and nonzero activations met (for ReLU models, predicted / exact is the
    predictor's recall inside the runtime)."""
    from ._native import sparse_counters

    out = {}
    for mode in modes:
        llm.set_sparse(mode)
        llm.reset()
        sparse_counters(reset=True)
        for t in tokens:
            llm.eval([t])
        out[mode] = sparse_counters(reset=True)
    return out


if __name__ == "__main__":
    raise SystemExit(main())


def log_softmax(logits):
    """Rows of logits [n, n_vocab] -> their log-probabilities, float64."""
    import numpy as np
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def logits_agreement(ref, got) -> dict:
    """Teacher-forced logits of a row against a reference row's (the same positions): the share
    of positions with the same top token, and the mean KL(reference || row)."""
    import numpy as np
    n = min(len(ref), len(got))
    a, b = np.asarray(ref[:n]), np.asarray(got[:n])
    la, lb = log_softmax(a), log_softmax(b)
    return {"top1_vs_static": float((a.argmax(1) == b.argmax(1)).mean()),
            "kl_vs_static": float((np.exp(la) * (la - lb)).sum(axis=1).mean())}


def thresholds_summary(llm) -> dict | None:
    """A kairox.Llama's load-aware thresholds over its hybrid layers (None when off): mean grid
    points of θ_g and θ_c, the calibrated error added, the CPU work against the static
    thresholds', the measured CPU costs and the solves so far."""
    from .llama import _C
    layers = [i for il in range(_C.llama_model_n_layer(llm._model.model)) if (i := llm.thresholds(il))]
    if not layers:
        return None
    mean = lambda k: sum(i[k] for i in layers) / len(layers)  # noqa: E731
    return {"layers": len(layers), "kg_mean": mean("kg"), "kc_mean": mean("kc"), "err_added_mean": mean("err_added"),
            "cpu_neurons_vs_static": sum(i["n_cpu"] for i in layers) / max(1e-9, sum(i["n_cpu_static"] for i in layers)),
            "t_cpu_ns": layers[0]["t_cpu_ns"], "o_cpu_ns": layers[0]["o_cpu_ns"], "solves": layers[0]["solves"]}
