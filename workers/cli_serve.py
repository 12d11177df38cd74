"""`gmlx serve` and the client side of `gmlx generate --server`.

workers/cli.py registers `serve` (`main.add_command(serve)`), and `generate --server ADDR`
calls `generate_via_server(address, prompt, params, as_json=...)`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tomllib

import click

from gmlx.config import SERVE_DRAFTER  # no mlx behind it

logger = logging.getLogger(__name__)

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"


def _load_model_entry(config_file: str | None, model: str | None) -> dict:
    """The [models.<id>] table to serve: the one named by --model, or the only one."""
    if config_file is None:
        return {}
    try:
        with open(config_file, "rb") as f:
            models = tomllib.load(f).get("models", {})
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise click.BadParameter(str(e), param_hint="--config") from None
    if not isinstance(models, dict) or not all(isinstance(v, dict) for v in models.values()):
        raise click.BadParameter("expected [models.<id>] tables", param_hint="--config")
    if model is not None:
        entry = dict(models.get(model, {}))  # {} when --model is a folder, not an id
    elif len(models) > 1:
        raise click.BadParameter(f"the config has several models ({', '.join(models)}); "
                                 "pick one with --model ID", param_hint="--model")
    else:
        entry = dict(next(iter(models.values()), {}))
    unknown = set(entry) - {"path", "drafter", "speculative_width_cap", "prefill_budget_ms"}
    if unknown:
        raise click.BadParameter(f"unknown keys {sorted(unknown)} in [models]", param_hint="--config")
    for key in ("path", "drafter"):
        if key in entry and not isinstance(entry[key], str):
            raise click.BadParameter(f"{key} must be a string, got {entry[key]!r}", param_hint="--config")
    cap = entry.get("speculative_width_cap")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        raise click.BadParameter(f"speculative_width_cap must be an integer >= 0, got {cap!r}", param_hint="--config")
    if "path" in entry:  # relative to the config file, like any path written in a file
        folder = os.path.dirname(os.path.abspath(config_file))
        entry["path"] = os.path.join(folder, os.path.expanduser(entry["path"]))
    return entry


def _check_drafter(drafter: str) -> str:
    from gmlx.drafters import parse_drafter  # no mlx behind it

    try:
        _, path = parse_drafter(drafter)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--drafter") from None
    if path is not None and not os.path.isdir(os.path.expanduser(path)):  # before a worker fails on it
        raise click.BadParameter(f"drafter {drafter!r}: no folder {path}", param_hint="--drafter")
    return drafter


@click.command("serve", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", default=None, help="Model folder, or a [models.<id>] of --config (default: built-in).")
@click.option("--drafter", default=None, help=f"none | mtp | draft[:PATH] | ngram  [default: {SERVE_DRAFTER}]")
@click.option("--address", default=DEFAULT_ADDRESS, show_default=True, help="Where clients connect.")
@click.option("--workers", "num_workers", type=click.IntRange(min=0), default=1, show_default=True,
              help="Worker processes to start (0 = wait for gmlx-worker processes started by hand).")
@click.option("--speculative-width-cap", type=click.IntRange(min=0), default=None,
              help="Speculate only while at most N rows decode (0 = uncapped).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="TOML file with [models.<id>] path / drafter / speculative_width_cap.")
@click.option("--worker-address", default="tcp://127.0.0.1:*", show_default=True,
              help="Where workers connect (port * = any free port).")
@click.option("--drain-timeout-s", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="After SIGTERM, how long in-flight requests get to finish.")
@click.option("--supervise/--no-supervise", default=True, show_default=True,
              help="Run the front-end as a child that is started again if it dies.")
@click.option("--curve-dir", type=click.Path(file_okay=False), default=None,
              help="`gmlx keys` folder: clients must authenticate with CURVE (needed off loopback).")
@click.option("--insecure", is_flag=True, help="Serve a non-loopback address without authentication.")
@click.option("--prefill-budget-ms", default=None,
              help="Prefill time per round while rows decode: 'auto' (half a decode round for chunks packed "
                   "into plain rounds, two for chunks of their own), N ms, or 0 (off, the default: fixed "
                   "256-token chunks). TOML: prefill_budget_ms.")
@click.option("--max-pending-requests", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Accepted requests waiting for a worker; past it GENERATE is answered 'busy'.")
@click.option("--worker-secret-file", type=click.Path(dir_okay=False), default=None,
              help="Owner-only file with the worker link's secret (default: a fresh one, path logged).")
@click.option("--worker-curve-dir", type=click.Path(file_okay=False), default=None,
              help="`gmlx keys` folder: workers authenticate with CURVE (required when --worker-address "
                   "is not loopback, for workers on other hosts).")
@click.option("--http", "http_url", default=None,
              help="Also serve the OpenAI-compatible HTTP API at this URL (http://HOST:PORT); off by default.")
@click.option("--http-port", type=click.IntRange(1, 65535), default=None,
              help="Shorthand for --http http://127.0.0.1:PORT.")
@click.option("--http-api-key-file", type=click.Path(dir_okay=False), default=None,
              help="File whose first line is the HTTP bearer token (else GMLX_HTTP_API_KEY).")
def serve(model, drafter, address, num_workers, speculative_width_cap, config_file, worker_address,
          drain_timeout_s, supervise, curve_dir, insecure, worker_secret_file, prefill_budget_ms,
          max_pending_requests, worker_curve_dir, http_url, http_port, http_api_key_file) -> None:
    """Serve a model: a front-end at ADDRESS and N decode workers."""
    from workers.frontend import Frontend, FrontendConfig
    from workers.supervisor import WorkerSpec

    entry = _load_model_entry(config_file, model)
    model_path = entry.get("path") if entry else model
    if model_path is not None:  # a folder, a .gguf file, or a short name such as smollm2
        from gmlx.models.source import check_model_source, resolve_model_path

        try:
            resolved = resolve_model_path(model_path)
            check_model_source(resolved)
            model_path = str(resolved)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--model") from None
    drafter = _check_drafter(drafter or entry.get("drafter", SERVE_DRAFTER))
    from ipc.auth import insecure_bind_message, is_loopback

    if not is_loopback(address) and curve_dir is None and not insecure:
        raise click.UsageError(insecure_bind_message(address))
    if not is_loopback(worker_address) and worker_curve_dir is None:
        from ipc.auth import insecure_worker_bind_message

        raise click.UsageError(insecure_worker_bind_message(worker_address))
    if speculative_width_cap is None:
        speculative_width_cap = entry.get("speculative_width_cap")
    if prefill_budget_ms is None and "prefill_budget_ms" in entry:
        prefill_budget_ms = str(entry["prefill_budget_ms"])
    if prefill_budget_ms is not None:
        from workers.worker import parse_prefill_budget

        try:
            parse_prefill_budget(prefill_budget_ms)
        except click.BadParameter as e:
            raise click.BadParameter(e.message, param_hint="--prefill-budget-ms") from None
    gateway = _make_gateway(http_url, http_port, http_api_key_file, model_path)
    _configure_logging()
    if supervise:
        from workers.supervisor import supervise_frontend

        command = _frontend_command(model_path, drafter, address, num_workers, speculative_width_cap,
                                    worker_address, drain_timeout_s)
        command += ["--max-pending-requests", str(max_pending_requests)]
        if prefill_budget_ms is not None:
            command += ["--prefill-budget-ms", prefill_budget_ms]
        if gateway is not None:  # the gateway runs beside the (re)started front-end, as its child
            command += ["--http", gateway.http_url]
        for option, value in (("--curve-dir", curve_dir), ("--worker-secret-file", worker_secret_file),
                              ("--worker-curve-dir", worker_curve_dir),
                              ("--http-api-key-file", http_api_key_file)):
            if value is not None:
                command += [option, os.path.abspath(os.path.expanduser(value))]
        sys.exit(supervise_frontend(command + (["--insecure"] if insecure else [])))
    spec = WorkerSpec(model_path=model_path and os.path.abspath(os.path.expanduser(model_path)),
                      drafter=drafter, speculative_width_cap=speculative_width_cap,
                      prefill_budget_ms=prefill_budget_ms, num_memory_sharers=max(1, num_workers))
    config = FrontendConfig(address=address, worker_address=worker_address, num_workers=num_workers,
                            drain_timeout_s=drain_timeout_s, curve_dir=curve_dir, is_insecure=insecure,
                            worker_secret_file=worker_secret_file, max_pending_requests=max_pending_requests,
                            worker_curve_dir=worker_curve_dir and os.path.abspath(os.path.expanduser(worker_curve_dir)))
    frontend = Frontend(config, spec)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: frontend.request_stop())

    def on_ready(bound_address: str) -> None:
        click.echo(f"gmlx serve ready at {bound_address} (workers: {num_workers}, drafter: {drafter})")
        sys.stdout.flush()
        if gateway is not None:
            gateway.start(bound_address)

    try:
        code = frontend.run(on_ready)
    except ValueError as e:  # an address that cannot be bound
        raise click.UsageError(str(e)) from None
    finally:
        if gateway is not None:  # after the drain: streams still finishing reach their HTTP clients
            gateway.stop()
    sys.exit(code)


@click.command("keys", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("folder", type=click.Path(file_okay=False))
def keys(folder: str) -> None:
    """Make CURVE keys in FOLDER for `gmlx serve --curve-dir FOLDER` and its clients."""
    from ipc.auth import make_keys

    try:
        path = make_keys(folder)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"keys written to {path}: the server uses the folder as is; a client needs server.key "
               f"and client.key_secret (Client(address, curve_dir=...)); add more clients' public keys "
               f"to {path / 'authorized_clients'}; a worker on another host needs server.key and "
               f"worker.key_secret (gmlx-worker --curve-dir, beside gmlx serve --worker-curve-dir {path})")


def _frontend_command(model_path, drafter, address, num_workers, speculative_width_cap, worker_address,
                      drain_timeout_s) -> list[str]:
    """The supervised child: this command with every option resolved, and --no-supervise."""
    cmd = [sys.executable, "-m", "workers.cli_serve", "--no-supervise", "--address", address,
           "--workers", str(num_workers), "--drafter", drafter, "--worker-address", worker_address,
           "--drain-timeout-s", str(drain_timeout_s)]
    if model_path is not None:
        cmd += ["--model", os.path.abspath(os.path.expanduser(model_path))]
    if speculative_width_cap is not None:
        cmd += ["--speculative-width-cap", str(speculative_width_cap)]
    return cmd


def _make_gateway(http_url: str | None, http_port: int | None, api_key_file: str | None, model_path: str | None):
    """The HTTP gateway to start once the front-end is ready, or None without --http."""
    if http_url is not None and http_port is not None:
        raise click.BadParameter("give --http or --http-port, not both", param_hint="--http-port")
    if http_port is not None:
        http_url = f"http://127.0.0.1:{http_port}"
    if http_url is None:
        return None
    from workers.http_config import GatewayConfig, parse_http_url, read_api_key
    from workers.http_process import GatewayProcess

    try:
        host, port = parse_http_url(http_url)
        api_key = read_api_key(api_key_file)
        GatewayConfig(server_address="", host=host, port=port, api_key=api_key).validate()
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--http") from None

    def on_ready(url: str) -> None:
        click.echo(f"gmlx http ready at {url}/v1")
        sys.stdout.flush()

    path = model_path and os.path.abspath(os.path.expanduser(model_path))
    return GatewayProcess(http_url, host, port, path, api_key, on_ready)


def _configure_logging() -> None:
    if not logging.getLogger().handlers:
        from gmlx.config import log_level

        logging.basicConfig(level=log_level(), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s [front-end] %(name)s: %(message)s")


def _client_sampling(params) -> dict:
    """generate()'s sampling arguments of a SamplingParams: the wire's Sampling fields, by name."""
    from ipc import messages as m

    sampling = {name: getattr(params, name) for name in m.Sampling.__struct_fields__}
    sampling["logit_bias"] = None if params.logit_bias is None else dict(params.logit_bias)
    return sampling


def generate_via_server(address: str, prompt: str | None, params, as_json: bool = False, *,
                        token_ids=None, messages=None, timeout_s: float = 60.0) -> None:
    """`gmlx generate --server`: one request against a running server, printed like the
    in-process path (streamed text, or one JSON object). Exits non-zero on failure."""
    from ipc.client import Client, RequestError

    token_ids_out, texts, logprobs, finish_reason, stats = [], [], [], "error", {}
    code = 0
    with Client(address, timeout_s=timeout_s) as client:
        try:
            for chunk in client.generate(prompt, token_ids=token_ids, messages=messages,
                                         stop=list(params.stop) or None, **_client_sampling(params)):
                token_ids_out.extend(chunk.token_ids)
                logprobs.extend(chunk.logprobs or ())
                texts.append(chunk.text)
                if not as_json:
                    click.echo(chunk.text, nl=False)
                if chunk.finish_reason is not None:
                    finish_reason, stats = chunk.finish_reason, dict(chunk.stats or {})
        except RequestError as e:
            if e.field is not None:  # the server named a request field: name the option
                option = ("PROMPT" if e.field in ("prompt", "token_ids", "messages")
                          else "--" + e.field.replace("_", "-"))
                click.echo(f"error: {option}: {e}", err=True)
                sys.exit(2)
            click.echo(f"error: {e}", err=True)
            code = 1
        except TimeoutError as e:
            click.echo(f"error: --server {address}: {e}", err=True)
            sys.exit(1)
    if as_json:
        result = {"model": stats.pop("model", None), "token_ids": token_ids_out, "text": "".join(texts),
                  "finish_reason": finish_reason, "stats": stats}
        if params.logprobs is not None:
            result["logprobs"] = logprobs
        click.echo(json.dumps(result))
    else:
        click.echo()
    if code:
        sys.exit(code)


if __name__ == "__main__":
    serve()
