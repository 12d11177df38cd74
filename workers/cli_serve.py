"""`gmlx serve` and the client side of `gmlx generate --server`.

gmlx/cli.py registers `serve` (`main.add_command(serve)`), and `generate --server ADDR`
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
    unknown = set(entry) - {"path", "drafter", "speculative_width_cap"}
    if unknown:
        raise click.BadParameter(f"unknown keys {sorted(unknown)} in [models]", param_hint="--config")
    cap = entry.get("speculative_width_cap")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        raise click.BadParameter(f"speculative_width_cap must be an integer >= 0, got {cap!r}", param_hint="--config")
    if "path" in entry:  # relative to the config file, like any path written in a file
        folder = os.path.dirname(os.path.abspath(config_file))
        entry["path"] = os.path.join(folder, os.path.expanduser(str(entry["path"])))
    return entry


def _check_drafter(drafter: str) -> str:
    from gmlx.drafters import parse_drafter  # no mlx behind it

    try:
        parse_drafter(drafter)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--drafter") from None
    return drafter


@click.command("serve", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", default=None, help="Model folder, or a [models.<id>] of --config (default: built-in).")
@click.option("--drafter", default=None, help="none | mtp | draft[:PATH] | ngram  [default: none]")
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
def serve(model, drafter, address, num_workers, speculative_width_cap, config_file, worker_address,
          drain_timeout_s) -> None:
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
    drafter = _check_drafter(drafter or entry.get("drafter", "none"))
    if speculative_width_cap is None:
        speculative_width_cap = entry.get("speculative_width_cap")
    _configure_logging()
    spec = WorkerSpec(model_path=model_path and os.path.abspath(os.path.expanduser(model_path)),
                      drafter=drafter, speculative_width_cap=speculative_width_cap)
    config = FrontendConfig(address=address, worker_address=worker_address, num_workers=num_workers,
                            drain_timeout_s=drain_timeout_s)
    frontend = Frontend(config, spec)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: frontend.request_stop())

    def on_ready(bound_address: str) -> None:
        click.echo(f"gmlx serve ready at {bound_address} (workers: {num_workers}, drafter: {drafter})")
        sys.stdout.flush()

    try:
        code = frontend.run(on_ready)
    except ValueError as e:  # an address that cannot be bound
        raise click.UsageError(str(e)) from None
    sys.exit(code)


def _configure_logging() -> None:
    if not logging.getLogger().handlers:
        from gmlx.config import log_level

        logging.basicConfig(level=log_level(), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s [front-end] %(name)s: %(message)s")


def generate_via_server(address: str, prompt: str | None, params, as_json: bool = False, *,
                        token_ids=None, timeout_s: float = 60.0) -> None:
    """`gmlx generate --server`: one request against a running server, printed like the
    in-process path (streamed text, or one JSON object). Exits non-zero on failure."""
    from ipc.client import Client, RequestError

    token_ids_out, texts, finish_reason, stats = [], [], "error", {}
    code = 0
    with Client(address, timeout_s=timeout_s) as client:
        try:
            for chunk in client.generate(prompt, token_ids=token_ids, max_tokens=params.max_tokens,
                                         temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                         min_p=params.min_p, seed=params.seed, stop=list(params.stop) or None):
                token_ids_out.extend(chunk.token_ids)
                texts.append(chunk.text)
                if not as_json:
                    click.echo(chunk.text, nl=False)
                if chunk.finish_reason is not None:
                    finish_reason, stats = chunk.finish_reason, dict(chunk.stats or {})
        except RequestError as e:
            if e.field is not None:  # the server named a request field: name the option
                option = "PROMPT" if e.field in ("prompt", "token_ids") else "--" + e.field.replace("_", "-")
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
        click.echo(json.dumps(result))
    else:
        click.echo()
    if code:
        sys.exit(code)


if __name__ == "__main__":
    serve()
