"""The `gmlx` command: generate, serve, doctor, bench."""

from __future__ import annotations

import json
import logging
import sys

import click

from gmlx import config
from gmlx.platform.blas import ensure_fast_blas

logger = logging.getLogger(__name__)


def _setup_logging() -> None:
    logging.basicConfig(
        level=config.log_level(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@click.group()
def main() -> None:
    """gmlx: speculative decoding and continuous batching together, on MLX."""
    _setup_logging()


def _check_cap(ctx, param, value):
    if value is not None and value < 0:
        raise click.BadParameter(f"must be >= 0, got {value}")
    return value


def _parse_logit_bias(ctx, param, values) -> dict[int, float] | None:
    """--logit-bias ID=BIAS options as SamplingParams.logit_bias (None when none are given)."""
    bias = {}
    for value in values:
        token_id, _, number = value.partition("=")
        try:
            bias[int(token_id)] = float(number)
        except ValueError:
            raise click.BadParameter(f"expected ID=BIAS (a token id and a number), got {value!r}") from None
    return bias or None


@main.command()
@click.argument("prompt")
@click.option("--model", default=None,
              help="mlx-lm model folder, .gguf file, or smollm2 (default: the built-in model)")
@click.option("--drafter", default="none", show_default=True, help="none | mtp | draft[:PATH] | ngram")
@click.option("--chat", is_flag=True, help="send PROMPT as one user message through the model's chat template "
              "(with --server, the server renders it)")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--speculative-width-cap", type=int, default=None, callback=_check_cap)
@click.option("--speculate/--no-speculate", default=True, show_default=True,
              help="--no-speculate pins this request to plain decoding")
@click.option("--presence-penalty", type=float, default=0.0, show_default=True,
              help="in [-2, 2]: taken off a token's logit once it was generated (OpenAI's)")
@click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
              help="in [-2, 2]: taken off a token's logit per time it was generated (OpenAI's)")
@click.option("--logit-bias", multiple=True, callback=_parse_logit_bias, metavar="ID=BIAS",
              help="add BIAS (in [-100, 100]) to token ID's logit before sampling (repeatable; OpenAI's logit_bias)")
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True,
              help="in (0, 10]: a prompt's or an earlier answer token's logit is divided by it (transformers')")
@click.option("--ignore-eos", is_flag=True, help="the model's EOS tokens end nothing (vLLM's ignore_eos)")
@click.option("--min-tokens", type=int, default=0, show_default=True,
              help="EOS and --stop-token-id tokens are not sampled before this many tokens (vLLM's)")
@click.option("--stop-token-id", "stop_token_ids", type=int, multiple=True,
              help="a token id that ends the answer as EOS does (repeatable; vLLM's stop_token_ids)")
@click.option("--logprobs", type=int, default=None,
              help="N in 0..20, with --json: each token's logprob and its position's N likeliest tokens")
@click.option("--server", default=None, help="send to a running gmlx server at this address")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object as the last line")
def generate(prompt, model, drafter, max_tokens, temperature, top_p, top_k, min_p, seed, stop,
             speculative_width_cap, speculate, presence_penalty, frequency_penalty, logit_bias, repetition_penalty,
             ignore_eos, min_tokens, stop_token_ids, logprobs, server, chat, as_json) -> None:
    """Generate a completion for PROMPT, streaming text to stdout."""
    from gmlx.request import SamplingParams, check_text

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            min_p=min_p, seed=seed, stop=tuple(stop), speculate=speculate, logprobs=logprobs,
                            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                            logit_bias=logit_bias, repetition_penalty=repetition_penalty, ignore_eos=ignore_eos,
                            min_tokens=min_tokens, stop_token_ids=tuple(stop_token_ids))
    try:
        if logprobs is not None and not as_json:
            raise ValueError("logprobs: --logprobs prints them in the --json object; add --json")
        params.validate()
        if not prompt:
            raise ValueError("prompt: must be a non-empty string")
        check_text("prompt", prompt)
    except ValueError as exc:
        _fail(exc)
    if server is not None:
        from workers.cli_serve import generate_via_server

        if chat:
            generate_via_server(server, None, params, as_json=as_json,
                                messages=[{"role": "user", "content": prompt}])
        else:
            generate_via_server(server, prompt, params, as_json=as_json)
        return
    from gmlx.config import EngineConfig

    ensure_fast_blas()  # before the engine imports mlx
    from gmlx.engine import Engine
    from gmlx.generate import render_chat, stream_generate
    from gmlx.textstream import TokenTexts, logprob_entries

    try:
        engine = Engine.load(EngineConfig(model_path=model, drafter=drafter,
                                          speculative_width_cap=speculative_width_cap))
        if chat:
            try:
                prompt = render_chat(engine.tokenizer, [{"role": "user", "content": prompt}])
            except ValueError as exc:
                raise ValueError(f"--chat: {exc}") from exc
        chunks = stream_generate(engine, prompt, params)
        token_ids, text, token_entries, last = [], [], [], None
        token_texts = TokenTexts(engine.tokenizer)
        for chunk in chunks:
            if chunk.logprobs is not None:
                pairs = [(e.logprob, e.top) for e in chunk.logprobs]
                token_entries += logprob_entries(token_texts, chunk.token_ids, pairs)
            token_ids += chunk.token_ids
            text.append(chunk.text)
            if not as_json:
                click.echo(chunk.text, nl=False)
            last = chunk
    except ValueError as exc:
        _fail(exc)
    if as_json:
        result = {"model": engine.model_path, "token_ids": token_ids, "text": "".join(text),
                  "finish_reason": last.finish_reason, "stats": last.stats}
        if logprobs is not None:
            result["logprobs"] = token_entries
        click.echo(json.dumps(result))
    else:
        click.echo("")
        stats = last.stats
        click.echo(
            f"[{last.finish_reason}] {stats['generated_tokens']} tokens, "
            f"ttft {stats['ttft_s']:.3f}s, {stats['decode_tok_per_s']:.1f} tok/s"
            + (f", acceptance {stats['acceptance_rate']:.2f}" if stats.get("acceptance_rate") is not None else ""),
            err=True,
        )


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.option("--model", default=None, help="with --drafter: show this model's speculation calibration")
@click.option("--drafter", default="none", help="mtp | draft[:PATH] | ngram: show the calibration table "
              "(measured now if it is not cached; GMLX_CALIBRATE=measure re-measures)")
def doctor(as_json, model, drafter) -> None:
    """Report the CPU, the BLAS core chosen and why, the interposer, the MLX device and the CPU kernels;
    with --drafter, the calibration that sets draft depth and width cap."""
    ensure_fast_blas()
    from gmlx.platform.doctor import describe_platform, format_report

    report = describe_platform()
    calibration = None
    if drafter != "none":
        from gmlx.config import EngineConfig
        from gmlx.drafters import make_drafter
        from gmlx.models.loader import load_model
        from gmlx.spec.calibration import format_table, load_or_measure
        from gmlx.spec.depth import PRIOR_ACCEPTANCE

        try:
            target = load_model(model)
            drafter_obj = make_drafter(drafter, target)
        except (ValueError, OSError) as exc:
            _fail(exc)
        if hasattr(drafter_obj, "describe"):
            report["drafter"] = drafter_obj.describe()
        max_rows = EngineConfig().max_num_rows
        table = load_or_measure(target, drafter_obj, max_rows)
        if table is None:
            calibration = "calibration off (GMLX_CALIBRATE=off): the drafter's fixed depth and width cap apply"
        else:
            report["calibration"] = table.describe(PRIOR_ACCEPTANCE, max_rows)
            calibration = (f"calibration: {target.path} + {drafter} drafter\n"
                           + format_table(table, PRIOR_ACCEPTANCE, max_rows))
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    if "drafter" in report:
        described = report["drafter"]
        calibration = (f"MTP head {described['path']}: products {described['products']}, drafts from "
                       f"{described['draft_vocab_size']} tokens\n{calibration or ''}")
    click.echo(format_report(report) + (f"\n{calibration}" if calibration else ""))


@main.command()
@click.argument("gguf_file")
@click.argument("out_dir", type=click.Path(file_okay=False))
def convert(gguf_file, out_dir) -> None:
    """Write GGUF_FILE (or smollm2) as an mlx-lm model folder OUT_DIR (config, safetensors, tokenizer)."""
    ensure_fast_blas()
    from gmlx.models.gguf import write_mlx_lm_folder
    from gmlx.models.source import is_gguf_path, resolve_model_path

    try:
        source = resolve_model_path(gguf_file)
        if not is_gguf_path(source):
            raise ValueError(f"GGUF_FILE: {gguf_file!r} is not a .gguf file")
        out = write_mlx_lm_folder(source, out_dir)
    except ValueError as exc:
        _fail(exc)
    click.echo(f"wrote {out}")


def _fail(exc: Exception) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(2)


# The serving and benchmark commands live with their packages.
from workers.bench.cli import bench  # noqa: E402
from workers.cli_serve import keys, serve  # noqa: E402

main.add_command(serve)
main.add_command(keys)
main.add_command(bench)


if __name__ == "__main__":
    main()
