#!/usr/bin/env python3
"""kairox-server (llama-server with kairox's flags) under concurrent OpenAI streams: every
stream's decode tok/s (first to last streamed token, client side), errors, and the
balancer's trace when the server writes one. Talks to 127.0.0.1 only, bounded in requests
and time; the server is started and stopped here.

    python3 bench/server_streams.py --bin BUILD/bin --model M.gguf --streams 4 --out OUT -- \\
        --vram-budget 7GiB --sparse predicted --balancer adaptive --kx-trace OUT/server-trace.jsonl
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
from kairox.bench import LocalServer, free_port, git_commit  # noqa: E402

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a steam engine works.",
           "List ten uses for a paperclip.", "Describe the water cycle to a child.",
           "Summarize the plot of a detective novel.", "What makes bread rise?",
           "Give advice for a first job interview.", "Tell me about the history of maps."]


def stream(port: int, prompt: str, n: int, out: dict) -> None:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    times: list[float] = []
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if d.get("choices") and d["choices"][0].get("text"):
                    times.append(time.perf_counter())
                if d.get("usage"):
                    out["tokens"] = d["usage"]["completion_tokens"]
        # a chunk carries the text of one or more tokens (a character split over tokens waits)
        out["chunks"] = len(times)
        out["ttft_s"] = times[0] - t0 if times else None
        n_tok = out.get("tokens", len(times))
        out["decode_tok_s"] = (n_tok - 1) / (times[-1] - times[0]) if len(times) > 1 else None
    except Exception as e:  # noqa: BLE001 (reported, never hidden)
        out["error"] = repr(e)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=1024,
                    help="total context of the server's slots (its KV cache counts against a VRAM budget)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="server-streams")
    ap.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: kairox-server's own flags")
    args = ap.parse_args()
    extra = [a for a in args.server_args if a != "--"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [str(Path(args.bin) / "llama-server"), "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-c", str(args.ctx), "--parallel", str(args.streams), "--no-webui", *extra]
    with LocalServer(cmd, port, out / f"{args.name}-server.log"):
        results = [dict(stream=i, prompt=PROMPTS[i % len(PROMPTS)]) for i in range(args.streams)]
        threads = [threading.Thread(target=stream, args=(port, r["prompt"], args.tokens, r)) for r in results]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        wall = time.perf_counter() - t0
    errors = [r for r in results if "error" in r or r.get("tokens") != args.tokens]
    rates = [r["decode_tok_s"] for r in results if r.get("decode_tok_s")]
    res = {"command": " ".join(cmd), "commit": git_commit(), "streams": args.streams, "tokens": args.tokens, "wall_s": wall,
           "results": results, "errors": len(errors),
           "aggregate_tok_s": sum(r.get("tokens") or 0 for r in results) / wall}
    (out / f"{args.name}.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = [f"# kairox-server: {args.streams} concurrent OpenAI streams of {args.tokens} tokens", "",
             f"`{' '.join(cmd)}`", "", "| stream | tokens | time to first token s | decode tok/s |", "|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['stream']} | {r.get('tokens', '-')} | {r.get('ttft_s') or 0:.3f} | "
                     f"{r.get('decode_tok_s') or 0:.2f} |" + (f" error: {r['error']}" if "error" in r else ""))
    if rates:
        lines += ["", f"median per stream {statistics.median(rates):.2f} tok/s ({min(rates):.2f}-{max(rates):.2f}); "
                  f"all streams together {res['aggregate_tok_s']:.2f} tok/s over {wall:.1f} s; errors: {len(errors)}"]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
