"""The front-end's per-request logic: sequence checks, stop strings, final stats (no sockets)."""

import random

import pytest

from gmlx.textstream import TextStream
from ipc import messages as m
from ipc.bus import BusPayload
from serving_support import model_dir
from workers.streams import ClientRequest, Phase
from workers.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizers():
    return load_tokenizer(str(model_dir()))


def make_request(decoder, stop=()) -> ClientRequest:
    payload = BusPayload([1, 2, 3], m.Sampling())
    return ClientRequest("r1", "ref", b"client", payload, TextStream(decoder, stop), "model", has_stop=bool(stop),
                         phase=Phase.INJECTED)


def test_fast_decode_equals_transformers_decode(tokenizers):
    tokenizer, decoder = tokenizers
    ids = tokenizer.encode("def main(argv):\n    return {'a': [1, 2]}  # é ü 🙂\n")
    for n in range(1, len(ids) + 1):
        assert decoder.decode(ids[:n]) == tokenizer.decode(ids[:n])


def test_a_sequence_gap_fails_the_request(tokenizers):
    req = make_request(tokenizers[1])
    ids = tokenizers[0].encode("x = 1\ny = 2\n")
    first = req.on_row(m.RowOutput("r1", 0, ids[:2]), 0)
    assert first.messages[0].seq == 0 and not first.is_cancel_needed
    gap = req.on_row(m.RowOutput("r1", 2, ids[2:4]), 0)
    assert isinstance(gap.messages[0], m.Error) and "gap" in gap.messages[0].message
    assert gap.is_cancel_needed and req.phase.is_finished


def test_stop_string_trims_to_its_token_and_waits_for_stats(tokenizers):
    tokenizer, decoder = tokenizers
    text = "alpha = 1\nbeta = 2\ngamma = 3\n"
    ids = tokenizer.encode(text)
    req = make_request(decoder, stop=("beta",))
    out = req.on_row(m.RowOutput("r1", 0, ids), 5)
    chunk = out.messages[0]
    assert out.is_cancel_needed and req.phase == Phase.STOPPING and req.stop_reason == "stop"
    assert chunk.text == "alpha = 1\n" and chunk.finish_reason is None
    expected = next(n for n in range(1, len(ids) + 1) if "beta" in tokenizer.decode(ids[:n]))
    assert chunk.token_ids == ids[:expected]
    # Tokens decoded before the worker saw the abort are dropped; its final row brings stats.
    assert req.on_row(m.RowOutput("r1", 1, [5, 6]), 6).messages == []
    final = req.on_row(m.RowOutput("r1", 2, [], "stop", {"generated_tokens": 99, "num_rounds": 3}), 7).messages[0]
    assert final.finish_reason == "stop" and final.seq == 1 and final.token_ids == []
    assert final.stats["generated_tokens"] == expected and final.stats["num_rounds"] == 3
    assert final.stats["model"] == "model" and req.phase.is_finished


def test_final_row_flushes_held_back_text(tokenizers):
    tokenizer, decoder = tokenizers
    ids = tokenizer.encode("value = be")
    req = make_request(decoder, stop=("beta",))
    first = req.on_row(m.RowOutput("r1", 0, ids), 0).messages[0]
    assert not first.text.endswith("be")  # could still become "beta": held back
    final = req.on_row(m.RowOutput("r1", 1, [], "length", {}), 0).messages[0]
    assert first.text + final.text == "value = be" and final.finish_reason == "length"


def test_take_flushes_only_a_final_row_that_no_stop_string_ended(tokenizers):
    tokenizer, decoder = tokenizers
    ids = tokenizer.encode("value = be")
    kept, text = TextStream(decoder, ("beta",)).take(ids)
    assert kept == ids and text == "value = "  # "be" could still become "beta"
    stream = TextStream(decoder, ("beta",))
    assert stream.take(ids, is_final=True) == (ids, "value = be") and not stream.is_stopped
    stream = TextStream(decoder, ("= b",))
    kept, text = stream.take(ids, is_final=True)
    assert stream.is_stopped and text == "value " and "= b" in decoder.decode(kept)
    assert "= b" not in decoder.decode(kept[:-1])  # the stream ends at the token that completes the match


def _streamed_text(decoder, ids, rng) -> str:
    """ids added in random-sized pieces, then flushed: the whole text a client receives."""
    stream, pieces, i = TextStream(decoder), [], 0
    while i < len(ids):
        size = rng.choice([1, 1, 1, 2, 3, 7])
        pieces.append(stream.add(ids[i : i + size]))
        i += size
    return "".join(pieces) + stream.flush()


@pytest.mark.parametrize("model", ["builtin", "smollm2"])
def test_windowed_decode_streams_the_whole_lists_text(tokenizers, model):
    # TextStream decodes only recent tokens; the text must be the whole list's decode, through
    # split UTF-8 sequences, spaces joined to words, and random ids (invalid bytes too).
    if model == "smollm2":
        from gmlx.models.source import smollm2_path

        try:
            tokenizers = load_tokenizer(str(smollm2_path()))
        except (FileNotFoundError, ValueError) as exc:
            pytest.skip(f"SmolLM2 GGUF absent: {exc}")
    tokenizer, fast = tokenizers
    rng = random.Random(7)
    texts = ["def main(argv):\n    return {'a': [1, 2]}  # é ü 🙂 日本語\n" * 6,
             "Hello world . , ' s don't  stop\n\n" * 12, "🙂🙃🤖 ∑∫ Ωμ 中文字符 ☃ " * 12]
    for trial in range(48):
        if trial % 2:
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 90))]
        else:
            ids = tokenizer.encode(rng.choice(texts))
        for decoder in (tokenizer, fast):
            assert _streamed_text(decoder, ids, rng) == decoder.decode(ids), (model, trial)


def test_windowed_decode_keeps_stop_strings_exact(tokenizers):
    # A stop string far into a long stream, past many window slides, ends it where the whole
    # list's decode first contains it.
    tokenizer, decoder = tokenizers
    ids = tokenizer.encode("x = 1\n" * 60 + "alpha beta gamma\n" + "y = 2\n" * 5)
    stream, pieces = TextStream(decoder, ("beta",)), []
    for n, token in enumerate(ids, 1):
        pieces.append(stream.add([token]))
        if stream.is_stopped:
            break
    assert "beta" in decoder.decode(ids[:n]) and "beta" not in decoder.decode(ids[: n - 1])
    assert "".join(pieces) == decoder.decode(ids[:n]).split("beta")[0]
