"""The gmlx command as a user runs it: a real subprocess."""

import os
import json
import subprocess
import sys

import pytest

from gmlx.config import BUILTIN_TARGET_DIR


def run_gmlx(*args, timeout_s=120):
    return subprocess.run([sys.executable, "-m", "workers.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.mark.parametrize("drafter", ["none", "mtp"])
def test_generate_json_prints_one_object_last(drafter):
    done = run_gmlx("generate", "def main(", "--max-tokens", "12", "--drafter", drafter, "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["model"] == str(BUILTIN_TARGET_DIR)
    assert 0 < len(result["token_ids"]) <= 12
    assert result["finish_reason"] in ("stop", "length")
    for key in ("prompt_tokens", "generated_tokens", "ttft_s", "decode_tok_per_s", "num_rounds",
                "num_drafted", "num_accepted"):
        assert key in result["stats"]


@pytest.mark.parametrize("args, name", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "2"], "top_p"),
    (["--model", "/no/such/model"], "/no/such/model"),
    (["--drafter", "medusa"], "medusa"),
    (["--logprobs", "21", "--json"], "logprobs"),
    (["--logprobs", "2"], "--json"),  # they are printed in the JSON object only
    (["--logit-bias", "7"], "ID=BIAS"),
    (["--logit-bias", "7=200"], "logit_bias"),
    (["--logit-bias", "99999999=1"], "logit_bias: 99999999 is not a token id"),
    (["--min-tokens", "65"], "min_tokens"),
    (["--stop-token-id", "99999999"], "stop_token_ids: 99999999 is not a token id"),
])
def test_bad_options_exit_nonzero_naming_the_option(args, name):
    done = run_gmlx("generate", "x", *args)
    assert done.returncode != 0
    assert name in done.stderr


@pytest.mark.parametrize("args, name", [([b"ab\xffcd"], "prompt"), ([b"\xff", "--chat"], "prompt"),
                                        (["x", "--stop", b"\xfe"], "stop")])
def test_text_that_is_not_utf8_exits_2_naming_it(args, name):
    """A shell's non-UTF-8 bytes reach argv as lone surrogates: a message, not a tokenizer's TypeError."""
    done = subprocess.run([sys.executable, "-m", "workers.cli", "generate", *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and f"error: {name} must be valid UTF-8 text" in done.stderr, done.stderr


@pytest.mark.parametrize("toml, message", [
    ("[models.x\n", "Expected ']'"),
    ("[models.x]\npath = 1\n", "path must be a string, got 1"),
    ("[models.x]\ndrafter = 5\n", "drafter must be a string, got 5"),
    ("[models.x]\nspeculative_width_cap = -1\n", "speculative_width_cap must be an integer >= 0"),
    ("[models.x]\nwidth = 2\n", "unknown keys ['width']"),
])
def test_serve_refuses_a_bad_config_file_naming_it(toml, message, tmp_path):
    config = tmp_path / "gmlx.toml"
    config.write_text(toml)
    done = run_gmlx("serve", "--config", str(config), timeout_s=60)
    assert done.returncode == 2 and "--config" in done.stderr and message in done.stderr, done.stderr


def test_serve_refuses_a_drafter_folder_that_is_not_there():
    done = run_gmlx("serve", "--drafter", "draft:/no/such/draft", timeout_s=60)
    assert done.returncode == 2 and "no folder /no/such/draft" in done.stderr, done.stderr  # not a worker's failure


def test_doctor_shows_the_calibration_table(tmp_path):
    env = {**os.environ, "GMLX_CALIBRATE": "auto", "GMLX_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "workers.cli", "doctor", "--drafter", "ngram", "--json"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    table = json.loads(done.stdout)["calibration"]
    assert table["widths"][0] == 1 and len(table["best_depth"]) == len(table["widths"])
    assert len(table["plain_round_ms"]) == len(table["widths"])
    assert all(len(row) == len(table["spec_round_ms"][0]) >= 2 for row in table["spec_round_ms"])
    text = subprocess.run([sys.executable, "-m", "workers.cli", "doctor", "--drafter", "ngram"],
                          capture_output=True, text=True, timeout=300, env=env)  # the cached table now
    assert text.returncode == 0, text.stderr
    assert "| width | plain round ms | depth 0 ms" in text.stdout and "speculate up to width" in text.stdout
    assert "transparent huge pages: " in text.stdout


def test_doctor_shows_how_an_mtp_head_runs():
    env = {**os.environ, "GMLX_CALIBRATE": "off"}
    done = subprocess.run([sys.executable, "-m", "workers.cli", "doctor", "--drafter", "mtp", "--json"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    described = json.loads(done.stdout)["drafter"]
    # The built-in target is float32: its head stays float32, over the whole 2,048-token vocabulary.
    assert described["kind"] == "mtp" and described["products"].startswith("float32")
    assert described["draft_vocab_size"] == 2048
    text = subprocess.run([sys.executable, "-m", "workers.cli", "doctor", "--drafter", "mtp"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert "MTP head " in text.stdout and "drafts from 2048 tokens" in text.stdout, text.stdout
