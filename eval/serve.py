"""`mtp-serve`: an OpenAI-compatible server (`/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/metrics`)
over the model, with MTP speculative decoding.

    mtp-serve                                   # (or `python -m mtp_eval.serve`) the bundled model on the CPU, port 8000
    mtp-serve model=dsv32 model.path=/ckpt runtime=cuda runtime.mode=overlap draft=eagle draft.k=3 port=8080

Configuration is `conf/serve.yaml` with the groups of `mtp-eval` and `mtp-chat` (model, draft, verify, runtime),
built by `eval.common` like theirs; the draft / verify settings are the defaults of requests that do not set their
own (`mtp` field). Requests run one at a time at batch 1. The application is `mtp/serve/` (no Hydra there); a
multi-GPU runtime takes the place of its `LocalBackend` (one `generate` call, driven from rank 0).
"""

from __future__ import annotations

import sys



def run(cfg) -> int:
    from mtp.utils import MissingExtraError, require

    try:
        uvicorn = require("uvicorn", "serve", "mtp-serve")
        for module in ("fastapi", "prometheus_client"):
            require(module, "serve", "mtp-serve")
    except MissingExtraError as e:
        print(f"mtp-serve: {e}", file=sys.stderr)
        return 2
    from mtp.serve.app import create_app
    from mtp.serve.backend import LocalBackend
    from mtp.serve.protocol import Defaults

    from .common import build, generate_kwargs, model_label
    from .schema import validate

    try:
        cfg = validate(cfg)
        model, tokenizer = build(cfg)
        kwargs = generate_kwargs(cfg, tokenizer)
        defaults = Defaults(max_new_tokens=cfg.max_new_tokens, thinking=cfg.thinking, options=kwargs,
                            max_model_len=cfg.runtime.max_model_len)
        name = cfg.served_model_name or model_label(cfg.model)
        app = create_app(LocalBackend(model), tokenizer, defaults, name, model)
    except Exception as e:  # bad path, bad value, no GPU: one line, no traceback
        print(f"mtp-serve: cannot start: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(f"mtp-serve: {name} on {model.device}, http://{cfg.host}:{cfg.port}/v1 (requests run one at a time, "
          "batch 1)", flush=True)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="info")
    return 0


def main() -> None:
    from .common import hydra_entry, serve_other_ranks

    serve_other_ranks()  # under torchrun ranks > 0 serve rank 0, which runs the HTTP server

    hydra_entry("serve", run)


if __name__ == "__main__":
    main()
