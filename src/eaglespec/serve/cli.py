"""`eaglespec serve` (and `python -m eaglespec.serve`): options, model loading, uvicorn.

The model, draft and tree options are generate's own (the same argparse helpers in cli.py), so an
option added there appears here too. Importing this module is cheap: the server's
packages load when the command runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading


def register(sub) -> None:
    from ..cli import add_model_args, add_tree_args

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with streaming, metrics and a chat page")
    add_model_args(p)
    add_tree_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $EAGLESPEC_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's name)")
    p.add_argument("--max-batch", type=int, default=8, help="rows per speculation setting stepped together")
    p.add_argument("--max-waiting", type=int, default=128,
                   help="requests that may wait for a row; more are answered 429")
    p.add_argument("--max-lanes", type=int, default=4,
                   help="speculation settings (method, tree) kept allocated at once; idle extra ones are dropped")
    p.add_argument("--shutdown-timeout", type=int, default=30,
                   help="on SIGTERM, seconds in-flight requests get to finish before they are cancelled")
    p.add_argument("--prefix-reuse", default="auto", choices=["auto", "on", "off"],
                   help="prefill only what a chat's next turn adds to its history (auto: on, except in the "
                        "bf16 int4/int8 mode, where it would give up greedy output that is bit-identical "
                        "whatever ran before)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from ..cli import UsageError, check_tree_options, tree_from

    check_tree_options(args)
    tree = tree_from(args)
    for flag, value, low in (("--port", args.port, 0), ("--max-batch", args.max_batch, 1),
                             ("--max-waiting", args.max_waiting, 0), ("--max-lanes", args.max_lanes, 1),
                             ("--shutdown-timeout", args.shutdown_timeout, 0)):
        if value < low or (flag == "--port" and value > 65535):
            raise UsageError(f"{flag} must be >= {low}" + (" and <= 65535" if flag == "--port" else "")
                             + f", got {value}")
    import uvicorn

    from ..api import EagleSpec, default_head_path, set_threads
    from .app import ServeSettings, create_app

    set_threads()
    spec = EagleSpec.load(args.model, dtype=args.dtype, device=args.device, quant=args.quant)
    spec.engine.max_batch = args.max_batch  # before any lane exists: lanes take it when made
    if args.prefix_reuse != "auto":
        spec.engine.reuse_prefix = args.prefix_reuse == "on"
    draft = args.draft
    if draft is None and (args.method != "vanilla" or (default_head_path(spec.source.name) / "config.json").is_file()):
        draft = "default"  # the shipped head, so clients can ask for eagle2 per request
    if draft is not None:
        spec.set_draft(draft)
    name = args.served_model_name or spec.source.name
    settings = ServeSettings(model_name=name, api_key=args.api_key or os.environ.get("EAGLESPEC_API_KEY") or None,
                             max_waiting=args.max_waiting, max_lanes=args.max_lanes, method=args.method, tree=tree)
    print(f"# eaglespec serve: {name} ({spec.target.dtype}, {args.device}, draft {spec.head_name or 'none'}, "
          f"default method {args.method}) on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    config = uvicorn.Config(create_app(spec, settings), host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    _server_class()(config).run()
    return 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, except that a SIGTERM or SIGINT that it turned into a graceful shutdown is not
        raised again afterwards: a server that stopped cleanly exits 0, not killed by the signal."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    return Server


def main(argv: list[str] | None = None) -> int:
    from ..cli import main as cli_main

    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])
