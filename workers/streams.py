"""One client request as the front-end tracks it: routing, sequence checks, detokenization.

The worker sends token ids only; text is made here, off the decode loop, with
gmlx.textstream (which imports nothing from mlx). Stop strings are matched here too: on a
hit the stream ends at the token that completed the match, the worker is told to cancel,
and the final chunk (finish_reason "stop") goes out when the worker's last output arrives
with the request's stats.

A request whose worker dies mid-stream is carried over: the next worker prefills the prompt
and every token already streamed, and decodes the rest. The front-end pins every request's
seed and sampling draws from (seed, position) alone, so the continuation is the stream the
lost worker would have sent.
"""

from __future__ import annotations

import enum
import random
import time
from dataclasses import dataclass, field

import msgspec

from gmlx.textstream import TextStream, logprob_entries
from ipc import messages as m
from ipc.bus import BusPayload


class Phase(enum.IntEnum):
    PENDING = 0  # validated and accepted; waiting for a ready worker and a bus slot
    INJECTED = 1  # descriptor sent to a worker; tokens streaming
    STOPPING = 2  # a stop string matched or the client cancelled; waiting for the worker's final output
    FINISHED = 3

    @property
    def is_finished(self) -> bool:
        return self == Phase.FINISHED


@dataclass(slots=True)
class Outcome:
    """What one worker row means for the client and the worker."""

    messages: list[m.Message] = field(default_factory=list)
    is_cancel_needed: bool = False


# Worker losses a request survives. Bounded so a request that itself kills workers (or dies
# with every one it is placed on) ends with an error instead of a restart loop.
MAX_WORKER_LOSSES = 2


@dataclass(eq=False)
class ClientRequest:
    request_id: str
    ref: str
    client_id: bytes  # the client's ZeroMQ routing id
    payload: BusPayload
    text_stream: TextStream
    model: str
    has_stop: bool
    phase: Phase = Phase.PENDING
    worker_id: int | None = None
    next_row_seq: int = 0  # the sequence number the worker's next row must carry
    next_chunk_seq: int = 0
    num_delivered: int = 0  # tokens sent to the client
    stop_reason: str | None = None  # "stop" once a stop string matched; None: the worker's reason
    accepted_s: float = field(default_factory=time.monotonic)
    generated_token_ids: list[int] = field(default_factory=list)  # every token a worker streamed
    num_worker_losses: int = 0  # workers lost while this request was on them
    client_payload: BusPayload = field(init=False)  # as the client sent it; payload grows on a carry-over

    def __post_init__(self) -> None:
        if self.payload.sampling.seed is None:  # pinned so a carried-over request draws what it would have
            sampling = msgspec.structs.replace(self.payload.sampling, seed=random.getrandbits(63))
            self.payload = BusPayload(token_ids=self.payload.token_ids, sampling=sampling)
        self.client_payload = self.payload

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.client_payload.token_ids)

    def carry_over(self) -> bool:
        """Its worker died: make it ready for the next one, whose payload holds the prompt and
        the tokens streamed so far, marked as generated (so its penalties, min_tokens and
        max_tokens go on counting them); False when it cannot go on."""
        num_left = self.client_payload.sampling.max_tokens - len(self.generated_token_ids)
        if self.phase != Phase.INJECTED or self.num_worker_losses >= MAX_WORKER_LOSSES or num_left <= 0:
            return False
        sampling = self.client_payload.sampling
        if self.next_chunk_seq > 0:  # the prompt's logprobs went out with the first chunk
            sampling = msgspec.structs.replace(sampling, prompt_logprobs=None)
        self.payload = BusPayload(token_ids=self.client_payload.token_ids + self.generated_token_ids,
                                  sampling=sampling, num_generated=len(self.generated_token_ids))
        self.num_worker_losses += 1
        self.phase, self.worker_id, self.next_row_seq = Phase.PENDING, None, 0
        return True

    def on_row(self, row: m.RowOutput, emitted_at_ns: int) -> Outcome:
        out = Outcome()
        if row.seq != self.next_row_seq:
            out.is_cancel_needed = row.finish_reason is None
            out.messages.append(self.fail(f"token stream gap: expected seq {self.next_row_seq}, got {row.seq}"))
            return out
        self.next_row_seq += 1
        self.generated_token_ids += row.token_ids
        if self.phase == Phase.STOPPING:
            # Tokens decoded after the stop string matched are dropped; only the stats matter.
            if row.finish_reason is not None:
                reason = self.stop_reason or row.finish_reason
                out.messages.append(self._chunk([], "", emitted_at_ns, reason, row.stats))
            return out
        if row.finish_reason == "error":
            out.messages.append(self.fail(row.error or "the engine failed the request"))
            return out
        problem = self._logprobs_problem(row)
        if problem is not None:  # a worker of another version
            out.is_cancel_needed = row.finish_reason is None
            out.messages.append(self.fail(problem))
            return out
        prompt_logprobs = self._prompt_logprobs(row.prompt_logprobs)
        token_ids, text = self.text_stream.take(row.token_ids, is_final=row.finish_reason is not None)
        logprobs = self._logprobs(token_ids, row.logprobs)
        if self.text_stream.is_stopped:
            if row.finish_reason is None:
                self.phase, self.stop_reason = Phase.STOPPING, "stop"
                out.is_cancel_needed = True
                out.messages.append(self._chunk(token_ids, text, emitted_at_ns, logprobs=logprobs,
                                                prompt_logprobs=prompt_logprobs))
            else:
                out.messages.append(self._chunk(token_ids, text, emitted_at_ns, "stop", row.stats, logprobs,
                                                prompt_logprobs))
            return out
        out.messages.append(self._chunk(token_ids, text, emitted_at_ns, row.finish_reason, row.stats, logprobs,
                                        prompt_logprobs))
        return out

    def _logprobs_problem(self, row: m.RowOutput) -> str | None:
        if self.is_logprobs and len(row.logprobs or ()) != len(row.token_ids):
            return "the worker sent no logprobs for the request's tokens"
        is_prompt_due = self.payload.sampling.prompt_logprobs is not None and self.next_chunk_seq == 0
        num_prompt = len(row.prompt_logprobs) + 1 if row.prompt_logprobs is not None else None
        if is_prompt_due and row.finish_reason != "cancelled" and num_prompt != self.num_prompt_tokens:
            return "the worker sent no logprobs for the request's prompt"
        return None

    def _prompt_logprobs(self, row_prompt_logprobs: list | None) -> list[dict] | None:
        """The client's entries of the whole prompt: its first token has no logprob (nothing precedes it)."""
        if row_prompt_logprobs is None or self.next_chunk_seq > 0:
            return None
        prompt = self.client_payload.token_ids
        token_texts = self.text_stream.token_texts
        first = logprob_entries(token_texts, prompt[:1], [(None, [])])
        return first + logprob_entries(token_texts, prompt[1:], row_prompt_logprobs)

    def _logprobs(self, token_ids: list[int], row_logprobs: list | None) -> list[dict] | None:
        """The client's entries of the tokens delivered (a stop string may cut the row's short)."""
        if not self.is_logprobs:
            return None
        return logprob_entries(self.text_stream.token_texts, token_ids, row_logprobs)

    @property
    def is_logprobs(self) -> bool:
        return self.client_payload.sampling.logprobs is not None

    def cancelled(self) -> m.Chunk:
        """The final chunk of a request the client cancelled while no worker held it."""
        return self._chunk([], "", None, "cancelled", {})

    def stopped_without_worker(self) -> m.Chunk:
        """The final chunk of a stopping request whose worker died before its last output."""
        assert self.phase == Phase.STOPPING
        return self._chunk([], "", None, self.stop_reason or "cancelled", {})

    def fail(self, message: str, field_name: str | None = None) -> m.Error:
        self.phase = Phase.FINISHED
        return m.Error(message=message, ref=self.ref, request_id=self.request_id,
                       field=field_name or m.field_of(message))

    def _chunk(self, token_ids, text, emitted_at_ns, finish_reason=None, stats=None, logprobs=None,
               prompt_logprobs=None) -> m.Chunk:
        self.num_delivered += len(token_ids)
        if logprobs is None and self.is_logprobs:
            logprobs = []  # every chunk of a request that asked carries a list, one entry per token
        if finish_reason is not None:
            self.phase = Phase.FINISHED
            stats = dict(stats or {})
            # A carried-over request's last worker saw the streamed tokens as prompt.
            stats["prompt_tokens"] = self.num_prompt_tokens
            stats["generated_tokens"] = self.num_delivered  # tokens past a stop string were dropped
            stats["num_worker_losses"] = self.num_worker_losses
            stats["model"] = self.model
        chunk = m.Chunk(request_id=self.request_id, seq=self.next_chunk_seq, token_ids=list(token_ids),
                        text=text, finish_reason=finish_reason, stats=stats, emitted_at_ns=emitted_at_ns,
                        logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        self.next_chunk_seq += 1
        return chunk
