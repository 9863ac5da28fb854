"""`python -m kairox.server`: llama-cpp-python's OpenAI-compatible server with kairox.Llama
underneath, so the hybrid FFN, the VRAM budget and the balancer serve the OpenAI API.

It is llama-cpp-python's own server package (its `[server]` extra: FastAPI, uvicorn), with
its every option, plus kairox's (`--sparse`, `--vram-budget`, `--gpu-slots`, `--balancer`,
...). The runtime balances after every decode by itself, so requests need nothing extra.

    python -m kairox.server --model M.gguf --vram-budget 7GiB --sparse predicted --port 8000
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import Any, Literal, Optional

from .llama import _BASE_KWARGS, Llama, llama_cpp

try:
    import uvicorn
    from llama_cpp.server import app as server_app
    from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
    from llama_cpp.server.model import LlamaProxy
    from llama_cpp.server.settings import ModelSettings, ServerSettings
    from pydantic import Field
except ImportError as e:  # the [server] extra is not installed
    raise ImportError(f"kairox.server needs llama-cpp-python's server packages ({e}); install them with "
                      "`pip install fastapi uvicorn sse-starlette 'starlette-context<0.4' pydantic-settings`") from None


class KairoxModelSettings(ModelSettings):
    """llama-cpp-python's model settings and kairox's, one option each."""
    sparse: Optional[Literal["dense", "exact", "predicted", "threshold"]] = Field(
        default=None, description="kairox: FFN mode (default: dense, or predicted with a pack or a hybrid option)")
    sparse_pack: Optional[str] = Field(default=None, description="kairox: sparse pack (default: MODEL.kxpack.gguf)")
    vram_budget: Optional[str] = Field(
        default=None, description="kairox: hybrid FFN under this GPU memory budget (e.g. 7GiB)")
    gpu_slots: Optional[int] = Field(default=None, ge=0, description="kairox: hybrid FFN with N neurons per layer on the GPU")
    kx_plan: Optional[str] = Field(default=None, description="kairox: hybrid FFN placed by a `kairox plan` file")
    kx_slots_device: Optional[str] = Field(default=None, description="kairox: device of the slots (CPU: host memory)")
    mapped_share: float = Field(default=0.0, ge=0.0, lt=1.0,
                                description="kairox: share of the host side the GPU reads over PCIe")
    balancer: Literal["off", "fixed", "adaptive"] = Field(
        default="off", description="kairox: move neurons between the GPU slots and the CPU while decoding")
    balancer_lambda: float = Field(default=0.5, ge=0.05, le=0.95, description="kairox: the balancer's lambda at start")
    balancer_pipeline: bool = Field(default=False, description="kairox: the balancer decides one layer ahead")
    kx_trace: Optional[str] = Field(default=None, description="kairox: balancer records as JSON lines")
    kx_error_budget: Optional[float] = Field(
        default=None, ge=0.0, le=1.0,
        description="kairox: load-aware thresholds adding at most this share of the FFN output's norm in error")
    kx_fallback: Optional[Literal["dense"]] = Field(
        default=None, description="kairox: run dense (with a warning) when the sparse mode or hybrid cannot run, "
                                  "instead of refusing to start")

    def kairox_kwargs(self) -> dict[str, Any]:
        """kairox.Llama's keyword arguments for these settings."""
        kw: dict[str, Any] = {"sparse": self.sparse, "sparse_pack": self.sparse_pack, "vram_budget": self.vram_budget,
                              "gpu_slots": self.gpu_slots, "plan": self.kx_plan, "slots_device": self.kx_slots_device,
                              "mapped_share": self.mapped_share, "error_budget": self.kx_error_budget,
                              "fallback": self.kx_fallback}
        if self.balancer != "off":
            from .balancer import BalancerConfig
            kw["balancer"] = BalancerConfig(lam=self.balancer_lambda, adaptive=self.balancer == "adaptive")
            kw["balancer_pipeline"] = self.balancer_pipeline
            kw["trace"] = self.kx_trace
        return {k: v for k, v in kw.items() if v is not None}


class KairoxSettings(ServerSettings, KairoxModelSettings):
    pass


_load_lock = threading.Lock()


class KairoxProxy(LlamaProxy):
    """LlamaProxy whose models are kairox.Llama objects."""

    @staticmethod
    def load_llama_from_model_settings(settings: ModelSettings) -> llama_cpp.Llama:
        kx = settings.kairox_kwargs() if isinstance(settings, KairoxModelSettings) else {}
        hybrid = any(k in kx for k in ("vram_budget", "gpu_slots", "plan"))

        def make(**kw: Any) -> Llama:
            # the base loader passes settings this llama_cpp.Llama no longer takes (mul_mat_q,
            # rpc_servers), which it ignores; kairox.Llama refuses unknown keywords, so they go here
            for k in [k for k in kw if k not in _BASE_KWARGS and k != "model_path"]:
                v = kw.pop(k)
                if v not in (None, True, False):
                    print(f"kairox.server: warning: {k}={v!r} has no effect with this llama-cpp-python",
                          file=sys.stderr)
            if hybrid:
                # the base settings' defaults (no GPU layers, mapped weights, no flash attention)
                # would undo the hybrid placement's own: dense tensors on the GPU, page-locked
                # host weights
                if kw.get("n_gpu_layers") == 0:
                    kw["n_gpu_layers"] = -1
                for k, default in (("use_mmap", True), ("flash_attn", False)):
                    if kw.get(k) == default:
                        kw.pop(k)
            return Llama(**kw, **kx)
        # the base loader names its class through the llama_cpp module: kairox.Llama stands in
        # for the one call (a subclass, so every isinstance check holds)
        with _load_lock:
            base = llama_cpp.Llama
            llama_cpp.Llama = make  # type: ignore[assignment]
            try:
                return LlamaProxy.load_llama_from_model_settings(settings)
            finally:
                llama_cpp.Llama = base  # type: ignore[assignment]


def create_app(server_settings: ServerSettings, model_settings: list[KairoxModelSettings]):
    """The FastAPI app of llama-cpp-python's server, on kairox models."""
    server_app.LlamaProxy = KairoxProxy  # the app builds its proxy by this name
    return server_app.create_app(server_settings=server_settings, model_settings=model_settings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kairox.server",
        description="OpenAI-compatible server (llama-cpp-python's) on kairox: every llama-cpp-python server "
                    "option, plus kairox's hybrid FFN, VRAM budget and balancer.")
    add_args_from_model(parser, KairoxSettings)
    args = parser.parse_args(argv)
    try:
        server_settings = parse_model_from_args(ServerSettings, args)
        model_settings = [parse_model_from_args(KairoxModelSettings, args)]
    except Exception as e:  # pydantic's validation errors name the option
        print(f"kairox.server: error: {e}", file=sys.stderr)
        return 2
    if not model_settings[0].model or not os.path.isfile(model_settings[0].model):
        print(f"kairox.server: error: model file not found: {model_settings[0].model}", file=sys.stderr)
        return 2
    try:
        app = create_app(server_settings, model_settings)
    except ValueError as e:  # ModelLoadError, VramBudgetError, bad kairox options
        print(f"kairox.server: error: {e}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=os.getenv("HOST", server_settings.host), port=int(os.getenv("PORT", server_settings.port)),
                ssl_keyfile=server_settings.ssl_keyfile, ssl_certfile=server_settings.ssl_certfile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
