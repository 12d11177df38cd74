"""Wire messages: one frozen msgspec Struct per message type, each with a one-byte tag.

Every message travels as two ZeroMQ frames, ``[tag, body]``. Bodies on the client link
(client <-> front-end) are JSON, so a client needs nothing but pyzmq and a JSON library;
bodies on the worker link (front-end <-> worker) are msgpack. No pickle anywhere.
docs/protocol.md is the reference for every field.
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar

import msgspec
import numpy as np


MAX_MESSAGE_BYTES = 1 << 20  # largest client message body answered with an ERROR
MAX_FRAME_BYTES = 64 << 20  # ZMQ_MAXMSGSIZE: a peer sending more is disconnected
MAX_CLIENT_FRAME_BYTES = 2 << 20  # the client link's ZMQ_MAXMSGSIZE: one message costs at most this
# Every limit below is checked before any work and documented in docs/protocol.md, "Limits".
MAX_NESTING_DEPTH = 16  # JSON arrays/objects inside each other; a GENERATE needs 2
MAX_REF_CHARS = 256  # `ref` and `request_id` strings, checked as the body is decoded
U32_MAX = 2**32 - 1  # the widest max_tokens and top_k a request may carry
# gmlx.request's (ipc imports nothing of gmlx); workers/validate.py checks they agree.
MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_TOKEN_IDS = 300, 64
MAX_DETOKENIZE_TOKENS = 1 << 17  # token ids one DETOKENIZE may ask for: above any context gmlx serves


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    TAG: ClassVar[bytes] = b""


Key = Annotated[str, msgspec.Meta(max_length=MAX_REF_CHARS)]  # a client's ref or a request id
TokenId = Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]  # the model's vocabulary bounds it further


# --- client link (JSON) -----------------------------------------------------------------


class Sampling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How one request samples: the only spelling of these fields from the wire to the engine.

    GENERATE carries them flat (it extends this struct), the bus slot carries this struct
    encoded, and the worker builds gmlx.request.SamplingParams from it by field name."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    speculate: bool = True  # False pins the request to plain decoding (it never drafts)
    logprobs: int | None = None  # N in 0..20: each token's logprob and its position's N likeliest
    prompt_logprobs: int | None = None  # N in 0..20: the same for the prompt's tokens, in the first chunk
    presence_penalty: float = 0.0  # OpenAI's, in [-2, 2]: off a token's logit once generated
    frequency_penalty: float = 0.0  # OpenAI's, in [-2, 2]: off a token's logit per time generated
    # OpenAI's: token id -> a number in [-100, 100] added to its logit; JSON keys are the ids as text.
    logit_bias: Annotated[dict[TokenId, float], msgspec.Meta(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    repetition_penalty: float = 1.0  # vLLM's, in (0, 10]: prompt and generated tokens' logits / it (x it if < 0)
    ignore_eos: bool = False  # vLLM's: the model's EOS tokens end nothing
    min_tokens: int = 0  # vLLM's: EOS and stop_token_ids are not sampled before this many tokens
    stop_token_ids: Annotated[tuple[TokenId, ...], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)] = ()  # end it as EOS does


def sampling_of(msg: Sampling) -> Sampling:
    """The bare Sampling part of a GENERATE (or of any Sampling)."""
    return Sampling(**{name: getattr(msg, name) for name in Sampling.__struct_fields__})


class BusPayload(msgspec.Struct, frozen=True):
    """What a request carries to a worker (stop strings stay in the front-end): through a
    shared-memory bus slot (ipc/bus.py) for a local worker, inline in INJECT for a remote one."""

    token_ids: list[int]
    sampling: Sampling
    # The last num_generated of token_ids are the request's own tokens, streamed by a worker that
    # was lost (a carry-over): the next one counts them as generated (penalties, min_tokens, max_tokens).
    num_generated: int = 0


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One turn of a chat request, rendered with the model's chat template by the front-end."""

    role: str
    content: str


class Generate(Message, Sampling, frozen=True, kw_only=True, omit_defaults=True):
    """Client -> front-end: start a request. Exactly one of prompt / token_ids / messages.

    Fields at their defaults stay off the wire (the server fills the same ones): a client
    that sets no newer option is read by servers from before that option."""

    TAG: ClassVar[bytes] = b"G"
    ref: Key  # the client's key for this request, echoed in ACCEPTED and ERROR
    prompt: str | None = None
    token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    stop: list[str] | None = None


class Cancel(Message, frozen=True):
    """Client -> front-end: end a request early."""

    TAG: ClassVar[bytes] = b"C"
    request_id: Key


class StatsRequest(Message, frozen=True):
    TAG: ClassVar[bytes] = b"S"
    ref: Key


class Tokenize(Message, frozen=True, kw_only=True, omit_defaults=True):
    """Client -> front-end: the token ids of a prompt, or of a chat rendered with the model's
    template, exactly as GENERATE would prefill them. Exactly one of prompt / messages."""

    TAG: ClassVar[bytes] = b"Z"
    ref: Key  # echoed in TOKENS or ERROR
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class Detokenize(Message, frozen=True):
    """Client -> front-end: the text of token ids, as the streams decode it (special tokens kept)."""

    TAG: ClassVar[bytes] = b"D"
    ref: Key  # echoed in TEXT or ERROR
    token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_DETOKENIZE_TOKENS)]


class Accepted(Message, frozen=True):
    """Front-end -> client: the request passed validation and has an id."""

    TAG: ClassVar[bytes] = b"A"
    ref: str
    request_id: str
    prompt_tokens: int
    model: str


class Chunk(Message, frozen=True):
    """Front-end -> client: one round's new tokens of one request."""

    TAG: ClassVar[bytes] = b"K"
    request_id: str
    seq: int  # 0, 1, 2, ... per request: a gap means a lost chunk
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: dict | None = None
    emitted_at_ns: int | None = None  # server host CLOCK_MONOTONIC when the worker sent the round
    # Where the request asked: one {token_id, token, logprob, top_logprobs} per token of token_ids.
    logprobs: list[dict] | None = None
    # Where it asked, in its first chunk: one per prompt token (the first's logprob null).
    prompt_logprobs: list[dict] | None = None


class Error(Message, frozen=True):
    """Front-end -> client: a rejected request (ref set) or a failed one (request_id set)."""

    TAG: ClassVar[bytes] = b"E"
    message: str
    ref: str | None = None
    request_id: str | None = None
    field: str | None = None  # the offending request field, when one is to blame
    retry_after_ms: int | None = None  # set when the server is busy: try again after this long


class StatsReply(Message, frozen=True):
    TAG: ClassVar[bytes] = b"T"
    ref: str
    stats: dict


class Tokens(Message, frozen=True):
    """Front-end -> client: TOKENIZE's answer."""

    TAG: ClassVar[bytes] = b"N"
    ref: str
    token_ids: list[int]
    max_prompt_tokens: int  # the longest prompt a GENERATE may carry


class Text(Message, frozen=True):
    """Front-end -> client: DETOKENIZE's answer."""

    TAG: ClassVar[bytes] = b"X"
    ref: str
    text: str


# --- worker link (msgpack) --------------------------------------------------------------


class Hello(Message, frozen=True):
    """Worker -> front-end (DEALER), once the engine is loaded."""

    TAG: ClassVar[bytes] = b"h"
    pid: int
    model_path: str
    max_context_tokens: int
    vocab_size: int
    drafter: str
    has_bus: bool = True  # False (gmlx-worker --no-bus): send this worker its payloads inline


class Welcome(Message, frozen=True):
    """Front-end -> worker: its id, where to connect its PUB socket, and the bus."""

    TAG: ClassVar[bytes] = b"w"
    worker_id: int
    pub_address: str
    bus_name: str
    heartbeat_interval_s: float


class Ready(Message, frozen=True):
    """Worker -> front-end (PUB), repeated until START: proves the PUB path is up."""

    TAG: ClassVar[bytes] = b"r"
    worker_id: int
    has_bus: bool = True  # the worker attached the bus; False: INJECT must carry the payload


class Start(Message, frozen=True):
    TAG: ClassVar[bytes] = b"s"


class Inject(Message, frozen=True):
    """Front-end -> worker: a request's payload waits in bus slot `slot`, or, for a worker
    without the bus (another host), travels here in `payload` (then slot is -1)."""

    TAG: ClassVar[bytes] = b"i"
    request_id: str
    slot: int
    generation: int
    payload: BusPayload | None = None


class Abort(Message, frozen=True):
    """Front-end -> worker: end a request now (client cancel, stop string, lost client)."""

    TAG: ClassVar[bytes] = b"c"
    request_id: str
    is_stop: bool = False  # a stop string matched: finish as "stop", not "cancelled"


class Taken(Message, frozen=True):
    """Worker -> front-end (DEALER): these slots were copied out and may be reused."""

    TAG: ClassVar[bytes] = b"t"
    worker_id: int
    slots: list[int]


class StatsQuery(Message, frozen=True):
    TAG: ClassVar[bytes] = b"q"
    query_id: int


class StatsAnswer(Message, frozen=True):
    TAG: ClassVar[bytes] = b"a"
    worker_id: int
    query_id: int
    stats: dict


class RowOutput(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    seq: int  # per request, from 0
    token_ids: list[int]
    finish_reason: str | None = None
    stats: dict | None = None
    error: str | None = None
    logprobs: list | None = None  # where the request asked: [logprob, [[token id, logprob], ...]] per token
    prompt_logprobs: list | None = None  # the same for prompt positions 1.., on the request's first row


class Round(Message, frozen=True):
    """Worker -> front-end (PUB): every row's new tokens from one engine step."""

    TAG: ClassVar[bytes] = b"o"
    worker_id: int
    round_index: int
    emitted_at_ns: int
    outputs: list[RowOutput]


class Heartbeat(Message, frozen=True):
    TAG: ClassVar[bytes] = b"b"
    worker_id: int
    num_unfinished: int


class Ping(Message, frozen=True):
    """Front-end -> worker: the front-end is alive (workers exit when these stop)."""

    TAG: ClassVar[bytes] = b"p"


class Shutdown(Message, frozen=True):
    TAG: ClassVar[bytes] = b"x"


class Dead(Message, frozen=True):
    """Worker -> front-end (PUB and DEALER): a fatal error; the worker exits."""

    TAG: ClassVar[bytes] = b"d"
    worker_id: int
    message: str


CLIENT_TO_SERVER = (Generate, Cancel, StatsRequest, Tokenize, Detokenize)
SERVER_TO_CLIENT = (Accepted, Chunk, Error, StatsReply, Tokens, Text)
WORKER_LINK = (Hello, Welcome, Ready, Start, Inject, Abort, Taken, StatsQuery, StatsAnswer,
               Round, Heartbeat, Ping, Shutdown, Dead)

_ALL = {cls.TAG: cls for cls in CLIENT_TO_SERVER + SERVER_TO_CLIENT + WORKER_LINK}
assert len(_ALL) == len(set(CLIENT_TO_SERVER + SERVER_TO_CLIENT + WORKER_LINK)), "tags must be unique"
assert all(len(tag) == 1 for tag in _ALL)



def _enc_hook(obj):
    # Engine stats may hold numpy scalars; everything on the wire is plain data.
    if hasattr(obj, "item"):
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


_json_encoder = msgspec.json.Encoder(enc_hook=_enc_hook)
_msgpack_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_json_decoders = {cls.TAG: msgspec.json.Decoder(cls) for cls in CLIENT_TO_SERVER + SERVER_TO_CLIENT}
_msgpack_decoders = {cls.TAG: msgspec.msgpack.Decoder(cls) for cls in WORKER_LINK}


class WireError(ValueError):
    """A message that cannot be decoded; `field` names the culprit when there is one."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


# A CHUNK goes out without its logprobs fields where they are null, byte for byte what clients
# from before them read (they forbid unknown fields).
_OPTIONAL_CHUNK_FIELDS = ("logprobs", "prompt_logprobs")
_ChunkWithoutLogprobs = msgspec.defstruct(
    "ChunkWithoutLogprobs",
    [(f.name, f.type, f.default) for f in msgspec.structs.fields(Chunk) if f.name not in _OPTIONAL_CHUNK_FIELDS],
    frozen=True)


def encode_json(msg: Message) -> list[bytes]:
    if type(msg) is Chunk and msg.logprobs is None and msg.prompt_logprobs is None:
        fields = msgspec.structs.asdict(msg)
        for name in _OPTIONAL_CHUNK_FIELDS:
            del fields[name]
        return [msg.TAG, _json_encoder.encode(_ChunkWithoutLogprobs(**fields))]
    return [msg.TAG, _json_encoder.encode(msg)]


def encode_msgpack(msg: Message) -> list[bytes]:
    return [msg.TAG, _msgpack_encoder.encode(msg)]


def decode_json(frames: list[bytes]) -> Message:
    """Decode a client-link message; raises WireError naming the bad field."""
    return _decode(frames, _json_decoders, "JSON")


def decode_msgpack(frames: list[bytes]) -> Message:
    return _decode(frames, _msgpack_decoders, "msgpack")


def _decode(frames: list[bytes], decoders: dict, codec: str) -> Message:
    if len(frames) != 2:
        raise WireError(f"expected 2 frames [tag, body], got {len(frames)}")
    tag, body = frames
    decoder = decoders.get(bytes(tag))
    if decoder is None:
        raise WireError(f"unknown message type {bytes(tag)[:8]!r}", field="type")
    if len(body) > MAX_MESSAGE_BYTES:
        raise WireError(f"message body is {len(body)} bytes, over the limit of {MAX_MESSAGE_BYTES}")
    if codec == "JSON" and json_depth(body) > MAX_NESTING_DEPTH:
        raise WireError(f"message body nests deeper than {MAX_NESTING_DEPTH} levels")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:
        raise WireError(str(e), field=field_of(str(e))) from None
    except msgspec.DecodeError as e:
        raise WireError(f"body is not valid {codec}: {e}") from None
    except RecursionError:  # msgpack bodies are not pre-scanned; the decoder's own guard trips
        raise WireError("message body nests too deeply to decode") from None


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(body: bytes) -> int:
    """How deeply arrays and objects nest in a JSON body (brackets inside strings excluded).

    Linear and recursion-free, so a hostile body costs microseconds per KiB, not a stack."""
    body = bytes(body)
    if body.count(b"[") + body.count(b"{") <= MAX_NESTING_DEPTH:
        return body.count(b"[") + body.count(b"{")  # an upper bound, and cheap
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def peek_ref(body: bytes) -> str | None:
    """Best-effort `ref` of a JSON body that failed validation, so its ERROR can carry it."""
    if len(body) > MAX_MESSAGE_BYTES or json_depth(body) > MAX_NESTING_DEPTH:
        return None
    try:
        obj = _ref_decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    ref = obj.ref
    return ref if isinstance(ref, str) and len(ref) <= MAX_REF_CHARS else None


class _RefOnly(msgspec.Struct):
    ref: object = None  # any type: the caller keeps it only if it is a short string


_ref_decoder = msgspec.json.Decoder(_RefOnly)


_FIELD_PATTERNS = (re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)"), re.compile(r"field `([^`]+)`"))


def field_of(message: str) -> str | None:
    """The field a msgspec or SamplingParams error message is about, if it names one."""
    for pattern in _FIELD_PATTERNS:
        match = pattern.search(message)
        if match:
            return match.group(1)
    first = re.match(r"[A-Za-z_]+", message)  # "max_tokens must be > 0", "token_ids: ..."
    return first.group(0) if first and first.group(0) in _REQUEST_FIELDS else None


_REQUEST_FIELDS = frozenset(Generate.__struct_fields__)


def readable_ref(frames: list[bytes]) -> str | None:
    """The `ref` of a GENERATE, STATS, TOKENIZE or DETOKENIZE that failed to decode, when it can
    be read cheaply."""
    if len(frames) != 2 or bytes(frames[0]) not in (Generate.TAG, StatsRequest.TAG, Tokenize.TAG, Detokenize.TAG):
        return None
    return peek_ref(frames[1])
