"""The socket-free engine core: add a request, abort one, step -> each request's new tokens.

One step is one decode round of the running generation, preceded by the injection drain
when the generation has an admission boundary. The batch's mode (spec/batch.py BatchMode)
picks the loop a round runs in (Loop):
  scalar  - one request speculating alone (no admission boundary: waiters preempt it)
  batch   - speculating rows within the width cap
  gated   - plain decode over the cap, next forward dispatched ahead (no drafter work)
  bare    - an armed batch's round whose rows' evidence asks for no drafts: plain, next forward
            dispatched ahead (a drafter that drafts_past_pending; no gate, no capture after)
  settle  - reads the dispatched-ahead lookahead without a successor (before a capture; a
            gated batch decides to resume once, before it pays for this round)
  capture - one-position verify with the hidden state kept; the drafter cold-starts from it
  plain   - no drafter loaded
Prompts prefilled beside running rows ride the plain, gated and speculative rounds' forwards
(models/packed.py): one pass over the weights for both; a prompt finished there yields its
first token at the next step, where it joins.
"""

from __future__ import annotations

import random
import time
import uuid

import mlx.core as mx
from mlx.utils import tree_flatten

from gmlx import config, logprobs
from gmlx.cache.budget import KVBudget, default_budget_bytes
from gmlx.cache.prompt_cache import PromptCache
from gmlx.cache.ragged import concat_layer_caches
from gmlx.config import EngineConfig
from gmlx.drafters import make_drafter
from gmlx.models.loader import LoadedModel, load_model
from gmlx.models.packed import Segment
from gmlx.platform.blas import ensure_fast_blas
from gmlx.platform.memory import move_to_huge_pages, tune_malloc, warm_heap
from gmlx.request import Request, RequestOutput, RequestStatus, SamplingParams
from gmlx.spec import admission
from gmlx.spec.batch import BatchMode, DecodeBatch, Loop
from gmlx.spec.calibration import CostTable, load_or_measure
from gmlx.spec.policy import SpeculationPolicy
from gmlx.spec.prefill_pacing import PrefillPacer, is_packing_chosen
from gmlx.spec.served_costs import ServedCosts
from gmlx.spec.speculative import capture_round, packed_plain_round, plain_round, speculative_round
from gmlx.spec.staged_join import JoinStager
from gmlx.spec.tally import Tally


class Engine:
    def __init__(self, target: LoadedModel, drafter, engine_config: EngineConfig, cost_table: CostTable | None = None):
        config.validate_settings()
        # Weights and KV are read every step: fewer TLB misses. A GPU's are not in these pages.
        is_huge = config.is_huge_pages_enabled() and mx.default_device() == mx.cpu
        if tune_malloc():  # joins and growing batches then reuse warm pages
            warm_heap(4 * target.kv_bytes_per_token * (engine_config.max_context_tokens or target.max_context_tokens),
                      is_huge)
        if is_huge:
            move_to_huge_pages([w for _, w in tree_flatten(target.model.parameters())])
        self.target = target
        self.drafter = drafter
        self.config = engine_config
        self.prompt_cache = PromptCache(engine_config.prompt_cache_bytes) if engine_config.prompt_cache_bytes else None
        self.max_context_tokens = engine_config.max_context_tokens or target.max_context_tokens
        # Rows join only while their KV fits this budget (the rest wait): no load runs the host out of memory.
        # The model is loaded by now: the default is a share of what it left free.
        budget_bytes = engine_config.kv_cache_bytes or default_budget_bytes(engine_config.num_memory_sharers)
        self.kv_budget = KVBudget(target.kv_bytes_per_token, budget_bytes,
                                  margin_tokens=drafter.num_draft_tokens + 1 if drafter is not None else 0,
                                  reserve_tokens=config.kv_reserve_tokens())
        # A row never outgrows what the budget holds for it alone: past that a request stops, as at
        # the context, rather than being refused (a chat request's default asks for the whole context).
        self.max_row_tokens = min(self.max_context_tokens, self.kv_budget.max_row_tokens())
        self.queue = admission.InjectionQueue(target, engine_config.prefill_chunk_tokens, self.prompt_cache,
                                              self.kv_budget.reserved_for)
        self.batch: DecodeBatch | None = None
        self.requests: dict[str, Request] = {}
        self.tally = Tally()  # the counters and transition events stats() reports
        # The measured round costs corrected by the rounds as served (spec/served_costs.py), or the
        # table alone: what depths and the width cap read.
        self.served_costs = (ServedCosts(cost_table) if cost_table is not None and engine_config.is_served_costs
                             else None)
        # Whether and how deep the batch speculates (the width cap, each row's depth, resume checks).
        self.policy = SpeculationPolicy(drafter, engine_config, self.served_costs or cost_table)
        self._outputs: list[RequestOutput] = []
        # Prompts whose prefill finished beside running rows: first token out, they join next
        # step, so a step never pays a prefill chunk and a cache merge on top of its round.
        self._ready: list[admission.Prefilled] = []
        # Last prompt chunks dispatched inside the batch's forward: their first tokens are read next step.
        self._landing: list[admission.PackedChunk] = []
        self._num_packed = 0  # prompt tokens in the forward this step's round dispatched
        self._is_joined_this_step = False
        self._is_landed_this_step = False
        self.stager = JoinStager()  # a long row's KV copied into the batch's buffers over a few steps
        configured = engine_config.is_prefill_packed
        is_packed = is_packing_chosen(target.is_packable, target.num_weight_bytes, target.is_layer_fused,
                                      config.prefill_packing() if configured is None else configured)
        self.pacer = PrefillPacer(is_packed, engine_config.prefill_budget_s)

    @classmethod
    def load(cls, engine_config: EngineConfig) -> Engine:
        ensure_fast_blas()  # a no-op after an entry point's call; else it warns that mlx came first
        config.validate_settings()  # before seconds of loading
        target = load_model(engine_config.model_path)
        drafter = make_drafter(engine_config.drafter, target, engine_config.num_draft_tokens)
        return cls(target, drafter, engine_config, load_or_measure(target, drafter, engine_config.max_num_rows))

    @property
    def is_prefill_packed(self) -> bool:
        """Whether prompt chunks ride the decode rows' forward (the pacer holds the choice)."""
        return self.pacer.is_packed

    @property
    def counters(self) -> dict:
        return self.tally.counters

    @property
    def events(self):
        return self.tally.events

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def model_path(self) -> str:
        return self.target.path

    # --- the public API ---------------------------------------------------------------

    def add_request(self, token_ids, params: SamplingParams, request_id: str | None = None,
                    num_generated: int = 0) -> str:
        """Queue a request; ValueError naming the bad field. num_generated: the last that many of
        token_ids are its own tokens, generated elsewhere before (a carried-over request): they
        are prefilled, and counted as generated wherever its sampling counts them."""
        params.validate()
        token_ids = list(token_ids) if token_ids is not None else []
        if not token_ids:
            raise ValueError("token_ids: the prompt is empty")
        if not 0 <= num_generated < min(len(token_ids), params.max_tokens):
            raise ValueError(f"num_generated: {num_generated} leaves no prompt or no token to generate "
                             f"({len(token_ids)} tokens, max_tokens {params.max_tokens})")
        if not all(isinstance(t, int) and 0 <= t < self.target.vocab_size for t in token_ids):
            raise ValueError(f"token_ids: every id must be an integer in [0, {self.target.vocab_size})")
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias or ()]),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in ids if t >= self.target.vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name}: {bad} is not a token id in [0, {self.target.vocab_size})")
        if len(token_ids) >= self.max_context_tokens:
            raise ValueError(
                f"token_ids: prompt of {len(token_ids)} tokens does not fit the context "
                f"of {self.max_context_tokens} tokens"
            )
        if len(token_ids) >= self.max_row_tokens:
            raise ValueError(
                f"token_ids: a prompt of {len(token_ids)} tokens does not fit this server's KV cache budget of "
                f"{self.kv_budget.budget_bytes / 2**20:.0f} MiB, which holds {max(0, self.max_row_tokens)} tokens "
                f"a request (GMLX_KV_CACHE_MB)")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        num_prompt = len(token_ids) - num_generated
        request = Request(request_id, token_ids[:num_prompt], params, seed, arrival_seq=self.counters["num_requests"],
                          output_token_ids=token_ids[num_prompt:],
                          max_new_tokens=min(params.max_tokens, self.max_row_tokens - num_prompt),
                          end_token_ids=frozenset(params.stop_token_ids).union(
                              () if params.ignore_eos else self.target.eos_token_ids))
        self.requests[request_id] = request
        self.queue.push(request)
        self.counters["num_requests"] += 1
        return request_id

    def abort_request(self, request_id: str, status=RequestStatus.FINISHED_CANCELLED,
                      is_queued: bool = True) -> RequestOutput | None:
        """Finish a request now. Its final output goes into the next step's outputs, or,
        with is_queued=False, only to the caller (who ended it, e.g. on a stop string)."""
        request = self.requests.get(request_id)
        if request is None or request.status.is_finished:
            return None
        ready = [p for p in self._ready if p.request.request_id == request_id]
        if ready:
            self._ready.remove(ready[0])
            self.stager.drop()
        elif self.queue.remove(request_id) is None and self.batch is not None:
            rows = [i for i, r in enumerate(self.batch.requests) if r.request_id != request_id]
            self._keep_rows(rows)
        output = self._finish(request, status)
        if not is_queued:
            self._outputs.remove(output)
        return output

    def has_unfinished(self) -> bool:
        return (bool(self.queue) or bool(self._ready) or bool(self._landing) or self.batch is not None
                or bool(self._outputs))

    def step(self) -> list[RequestOutput]:
        """Run one round; returns each request's new tokens (and final outputs)."""
        if self.served_costs is not None:
            self.served_costs.step_started(time.perf_counter())
        self._is_joined_this_step = False
        self._is_landed_this_step = self._land()
        self._evict_to_fit()
        if self.batch is not None and not self.batch.has_boundary:
            if self._ready and not self._is_landed_this_step:
                self._preempt()  # prefilled beside the lone stream last step: it joins now
            elif (self.queue and config.is_preempt_enabled() and not self._can_pack_prefill()
                  and not self._is_packing_paused() and self._num_free_rows() > 0):
                budget_s = self._prefill_budget_s()
                # Preempting for a waiter that cannot join yet would drop speculation for nothing.
                if self.queue.can_join_next_drain(budget_s):
                    self._ready = self._drain()
                else:
                    self.queue.prefill_ahead(budget_s)
        if self.batch is None or self.batch.has_boundary:
            self._admit()
        if self.batch is not None:
            self._run_round()
        outputs, self._outputs = self._outputs, []
        return outputs

    def stats(self) -> dict:
        stats = self.tally.snapshot()
        stats["num_active"] = (0 if self.batch is None else self.batch.num_rows) + len(self._ready)
        stats["num_queued"] = len(self.queue)
        stats["kv_budget_bytes"] = self.kv_budget.budget_bytes
        stats["max_row_tokens"] = self.max_row_tokens
        stats["kv_reserve_tokens"] = self.kv_budget.reserve_tokens
        stats["width_cap"] = self.policy.width_cap()
        stats["is_prefill_packed"] = self.is_prefill_packed
        stats["drafter"] = self.drafter.kind if self.drafter is not None else "none"
        stats.update(self.policy.describe())
        if self.prompt_cache is not None:
            stats.update(self.prompt_cache.stats())
        return stats

    # --- admission and transitions ------------------------------------------------------

    def _admit(self) -> None:
        staged = None
        if self._ready and not self._is_landed_this_step:  # prefilled: this step joins them, prefills nothing
            self._is_joined_this_step = True
            if self.stager.advance(self._ready, self.batch):
                return  # a long row's KV is copied into the joined buffers a few layers a step
            staged = None if self.batch is None else self.stager.take(self.batch)
            joining, self._ready = self._ready, []
        elif self._can_pack_prefill() or self._is_packing_paused() or self._is_landed_this_step:
            return  # this step's forward carries the next prompt chunk (or, paused, none)
        else:
            joining = self._drain()
            if joining and self.batch is not None:
                self._ready = joining
                return
        if not joining:
            return
        merged = staged or concat_layer_caches([p.caches for p in joining])
        pending = mx.array([p.first_token for p in joining], dtype=mx.int32)
        requests = [p.request for p in joining]
        if self.batch is None:
            if self.drafter is None:
                mode = BatchMode.PLAIN
            elif len(requests) == 1 and not self.queue and requests[0].params.speculate:
                mode = BatchMode.SCALAR  # a lone request with nobody waiting speculates alone
            else:
                mode = BatchMode.ARMED
            self.batch = DecodeBatch(requests, merged, pending, mode, self.config.is_batch_draft_coupled)
            first = 0
            if mode.is_armed:
                self.drafter.reset()
                self.tally.mark_armed()
        else:
            first = self.batch.num_rows
            self.batch.append_rows(requests, merged, pending, is_staged=staged is not None)
        self._event("admit", num_new=len(requests))
        if self.drafter is not None and not admission.is_within_cap(self.policy.width_cap(), self.batch.num_draft_rows):
            self._gate()
        elif self.batch.mode.is_armed:
            # The drafter holds the speculating rows only; the joining ones come last there too.
            draft_rows = self.batch.draft_rows
            new_rows = [j for j, i in enumerate(draft_rows) if i >= first]
            if new_rows:
                hidden = mx.stack([joining[draft_rows[j] - first].hidden for j in new_rows])
                self.drafter.add_rows(self.batch.draft_view, new_rows, hidden if self.drafter.needs_hidden else None)

    def _drain(self) -> list[admission.Prefilled]:
        """One drain of the injection queue; the prompts it completed, first token delivered."""
        num_rows = 0 if self.batch is None else self.batch.num_rows
        max_new_rows = self._num_admissible(self.config.max_num_rows - num_rows)
        prefilled = self.queue.drain(max_new_rows, self._prefill_budget_s())
        return [item for item in prefilled if self._start_decoding(item)]

    def _start_decoding(self, item: admission.Prefilled) -> bool:
        """Deliver a prefilled prompt's first token; False when that already finished it."""
        request = item.request
        request.status = RequestStatus.DECODING
        if request.first_token_time_s is None:  # an evicted row's next token is not its first
            request.first_token_time_s = time.perf_counter()
        if self._deliver(request, [item.first_token]):
            return True
        self._retire(request, item.caches, 0)
        return False

    def _can_pack_prefill(self) -> bool:
        """Whether this step's round may carry a prompt chunk in its forward: a plain, gated or
        speculative round (a lone stream only when waiters may preempt it), while no finished
        prompt's forward is still unread, nothing joins this step, and a row is free."""
        batch = self.batch
        if batch is None or not (self.is_prefill_packed and self.queue):
            return False
        is_packing_mode = (batch.mode in (BatchMode.PLAIN, BatchMode.GATED, BatchMode.ARMED)
                           or batch.mode is BatchMode.SCALAR and config.is_preempt_enabled())
        return (is_packing_mode and not self._landing and not self._is_joined_this_step
                and not self._is_packing_paused() and self._num_free_rows() > 0)

    def _is_packing_paused(self) -> bool:
        return self.pacer.is_paused(self.batch is not None)

    def _num_free_rows(self) -> int:
        """How many waiters may take rows now: within max_num_rows and the KV budget."""
        return self._num_admissible(
            self.config.max_num_rows - (0 if self.batch is None else self.batch.num_rows) - len(self._ready))

    def _num_admissible(self, max_new_rows: int) -> int:
        """How many of the first max_new_rows waiters fit the KV budget beside the rows in flight."""
        return self.kv_budget.num_admissible_requests(self._rows_in_flight(), self._buffer_tokens(),
                                                      self.queue.waiting, max_new_rows)

    def _rows_in_flight(self) -> list[Request]:
        """Requests holding decode rows: the batch's, then those prefilled to join it."""
        return ([] if self.batch is None else self.batch.requests) + [p.request for p in self._ready]

    def _buffer_tokens(self) -> int:
        """The batch buffers' width: every row of the batch is this wide, whatever it holds."""
        return 0 if self.batch is None else self.batch.caches[0].buffer_tokens

    # --- eviction -------------------------------------------------------------------

    def _evict_to_fit(self) -> None:
        """Rows that grew past the KV budget (their reservations, before this step's round
        writes): the latest arrivals give their KV up and wait at the queue's head, to be
        prefilled again (prompt and tokens so far) once they fit; their KV is offered to the
        prompt cache, so that prefill may be a copy. The earliest arrival always keeps its row."""
        holders = self._rows_in_flight() + self.queue.prefilling
        evicted = []
        while (victim := self.kv_budget.next_victim(holders, self._buffer_tokens())) is not None:
            holders = [r for r in holders if r is not victim]
            if self._evict(victim):
                evicted.append(victim)
        if not evicted:
            return
        # Admission counts waiters in order, so only the queue's head may hold a partial prefill.
        for request in self.queue.prefilling:
            self._offer(request, self.queue.drop_prefill(request), 0)
        self.queue.push_front(evicted)

    def _evict(self, request: Request) -> bool:
        """Take the request's KV back; True where it held a row (it must wait again), False for
        a waiter's partial prefill (dropped; it keeps its place)."""
        ready = next((p for p in self._ready if p.request is request), None)
        rows = [] if self.batch is None else self.batch.requests
        row = next((i for i, r in enumerate(rows) if r is request), None)
        if ready is not None:
            self._offer(request, ready.caches, 0)
            self._ready = [p for p in self._ready if p is not ready]
            self.stager.drop()
        elif row is not None:
            self._offer(request, self.batch.caches, row)
            self._keep_rows([i for i in range(len(rows)) if i != row])
        else:
            self._offer(request, self.queue.drop_prefill(request), 0)
            return False
        self.counters["num_kv_evictions"] += 1
        request.num_kv_evictions += 1
        self._event("evict", request_id=request.request_id, num_tokens=request.num_prefill_tokens)
        return True

    def _offer(self, request: Request, caches, row: int) -> None:
        """An evicted row's KV (or a dropped partial prefill) to the prompt cache: its own prefill
        or a later prompt sharing its prefix may fetch it."""
        if self.prompt_cache is not None and caches[0].keys is not None:
            self.prompt_cache.offer(request.all_token_ids, caches, row)

    def _land(self) -> bool:
        """Prompts finished inside last step's forward: first tokens out; they join next step
        (reading the forward and merging a long row's KV would each take about a round)."""
        landing, self._landing = self._landing, []
        for chunk in landing:
            if chunk.request.status.is_finished:  # aborted meanwhile
                continue
            item = self.queue.land(chunk)
            if self._start_decoding(item):
                self._ready.append(item)
        return bool(landing)

    def _plain_round(self, dispatch_next: bool) -> list[list[int]]:
        """A plain round; when allowed, its dispatched forward also runs the first waiter's next chunk."""
        if not (dispatch_next and self._can_pack_prefill()):
            return plain_round(self.target, self.batch, dispatch_next)
        chunks = self.queue.plan_packed_chunks(self._num_free_rows(), self._prefill_budget_s())
        tokens, chunk_hidden = packed_plain_round(self.target, self.batch, _segments(chunks))
        self._ran_packed(chunks, chunk_hidden)
        return tokens

    def _speculative_round(self, depths: list[int]):
        is_stochastic = self.config.is_stochastic_acceptance and self.drafter.has_distribution
        chunks = (self.queue.plan_packed_chunks(self._num_free_rows(), self._prefill_budget_s())
                  if self._can_pack_prefill() else [])
        result = speculative_round(self.target, self.batch, self.drafter, depths, is_stochastic, _segments(chunks))
        self._ran_packed(chunks, result.chunk_hidden)
        return result

    def _ran_packed(self, chunks: list[admission.PackedChunk], chunk_hidden) -> None:
        for chunk, hidden in zip(chunks, chunk_hidden, strict=True):
            self.queue.run_packed_chunk(chunk, hidden)
            if chunk.is_last:
                mx.async_eval(chunk.first_token)
                self._landing.append(chunk)
            self._num_packed += chunk.num_tokens
            self.counters["num_packed_chunks"] += 1

    def _prefill_budget_s(self) -> float | None:
        return self.pacer.budget_s(self.batch is not None)

    def _preempt(self) -> None:
        # The scalar round's verified tokens went out at the end of that round; what is left
        # is its bonus, pending and delivered, with every other token in the KV.
        batch = self.batch
        batch.preempt()
        self.drafter.reset()
        for request in batch.requests:
            request.is_preempted = True
        self.counters["num_preempts"] += 1
        self._event("preempt", num_waiting=len(self.queue))

    def _gate(self, is_depth: bool = False) -> None:
        """Over the cap (or, is_depth, no row's drafts pay): plain decoding from here; with
        resume off the gate latches."""
        # A batch just preempted is disarmed but not yet gated: its gate counts too, so
        # every later resume has a gate to match.
        is_new_gate = self.batch.mode not in (BatchMode.GATED, BatchMode.RESUMING)
        if self.batch.gate():
            self.drafter.reset()
        if is_new_gate:
            self.counters["num_gates"] += 1
            self.counters["num_depth_gates"] += is_depth
            self._event("gate", reason="depth" if is_depth else "cap", **self.tally.take_armed_stretch())

    def _arm(self) -> list[list[int]]:
        """A preempted batch's first round after the drain: capture, then speculate."""
        tokens = self._capture()
        self.batch.arm()
        return tokens

    def _resume(self) -> list[list[int]]:
        """A gated batch back within the cap (and settled): capture, then speculate again."""
        tokens = self._capture()
        self.batch.resume()
        self.counters["num_resumes"] += 1
        gain = self.policy.expected_gain(self.batch)
        self._event("resume", **({} if gain is None else {"expected_gain": round(gain, 3)}))
        return tokens

    def _capture(self) -> list[list[int]]:
        # The drafter's cold start needs fresh hidden state for every surviving row.
        tokens, hidden = capture_round(self.target, self.batch)
        self.drafter.reset()
        view = self.batch.draft_view
        if view.num_rows:
            hidden = hidden if view is self.batch else hidden[view.index]
            self.drafter.add_rows(view, list(range(view.num_rows)), hidden if self.drafter.needs_hidden else None)
        self.tally.mark_armed()
        self._event("capture")
        return tokens

    # --- rounds ------------------------------------------------------------------------

    def _run_round(self) -> None:
        start_s = time.perf_counter()
        self._num_packed = 0
        steady_depth = self._run_round_inner()
        elapsed_s = time.perf_counter() - start_s
        if self.served_costs is not None:
            if self.batch is None:
                self.served_costs.interrupted()  # the worker may idle before the next step
            else:
                is_steady = not (self._num_packed or self._is_joined_this_step or self._is_landed_this_step)
                self.served_costs.ran(start_s, self.batch.num_rows, steady_depth if is_steady else None)
        # On the CPU, dispatching a forward waits for most of it (mlx throttles what is in
        # flight), so a chunk's cost shows in the round that dispatched it.
        packed_s = self.pacer.ran(self._num_packed, elapsed_s)
        if packed_s is not None:
            self.queue.measured_packed(self._num_packed, packed_s)

    def _run_round_inner(self) -> int | None:
        """Runs the round; the depth it is costed at (0 plain, k speculative), or None for a
        round that is neither (settle, capture, a batch without a drafter)."""
        batch = self.batch
        held = self.policy.held_gate(batch)
        is_over_cap = held if held is not None else self.policy.is_over_cap(batch)
        depths = self.policy.draft_depths(batch) if batch.mode.is_armed and not is_over_cap else None
        if is_over_cap or (batch.mode.is_armed and depths is None):
            # No row's drafts pay: a speculative round would be a plain one without its pipelining.
            self._gate(is_depth=not is_over_cap)
        # A lookahead no row has budget for would be a whole wasted forward at every finish.
        is_worth_lookahead = any(r.max_new_tokens - r.num_generated > 1 for r in batch.requests)
        match batch.mode:
            case BatchMode.PLAIN:
                loop, tokens = Loop.PLAIN, self._plain_round(dispatch_next=is_worth_lookahead)
            case BatchMode.SCALAR | BatchMode.ARMED if not any(depths) and self.drafter.drafts_past_pending:
                loop, tokens = Loop.BARE, self._plain_round(dispatch_next=is_worth_lookahead)
            case BatchMode.SCALAR | BatchMode.ARMED:
                loop = Loop.SCALAR if batch.mode is BatchMode.SCALAR else Loop.BATCH
                result = self._speculative_round(depths)
                tokens = result.tokens_by_row
                self._count_verify(result)
            case BatchMode.GATED if (held is not None or is_over_cap or not admission.can_resume(batch.draft_requests)
                                     or self.policy.waiters_go_over_cap(batch, self._waiting_requests())
                                     or not self.policy.drafting_pays(batch)):
                if held is None:
                    self.policy.hold_gate(batch, is_over_cap)
                loop, tokens = Loop.GATED, self._plain_round(dispatch_next=is_worth_lookahead)
            case BatchMode.GATED | BatchMode.RESUMING | BatchMode.UNARMED if not batch.is_settled:
                # Decided once, here: the settle round is paid only for a capture that follows.
                if batch.mode is BatchMode.GATED:
                    batch.begin_resume()
                # The gated round's lookahead already sits in the KV: read it before capturing.
                loop, tokens = Loop.SETTLE, plain_round(self.target, batch, dispatch_next=False)
            case BatchMode.GATED | BatchMode.RESUMING:
                loop, tokens = Loop.CAPTURE, self._resume()
            case BatchMode.UNARMED:
                loop, tokens = Loop.CAPTURE, self._arm()
        self.tally.count_round(loop)
        keep = []
        scored = self.policy.scored_row(batch, self.counters["num_rounds"], is_over_cap) if loop is Loop.GATED else None
        scored_request = None
        for i, (request, row_tokens) in enumerate(zip(batch.requests, tokens)):
            request.num_rounds += 1
            request.num_rounds_by_loop[loop.value] = request.num_rounds_by_loop.get(loop.value, 0) + 1
            if self._deliver(request, row_tokens):
                keep.append(i)
                if i == scored and row_tokens:
                    scored_request = request
            else:
                self._retire(request, batch.caches, i)
        if loop is Loop.GATED:
            self.policy.observe_gated(scored_request)
        self._keep_rows(keep)
        if loop in (Loop.GATED, Loop.BARE):
            return 0
        return (max(depths) or None) if loop.is_speculative else None

    def _waiting_requests(self) -> list[Request]:
        """Requests waiting to take rows: those prefilled to join, then the queue's."""
        return [p.request for p in self._ready] + list(self.queue.waiting)

    def _count_verify(self, result) -> None:
        self.tally.count_verify(sum(result.num_drafted), sum(result.num_accepted))
        for request, accepted, drafted in zip(self.batch.requests, result.num_accepted, result.num_drafted):
            self.policy.observe_verify(request, drafted, accepted)
            request.count_verify(drafted, accepted)

    def _keep_rows(self, rows: list[int]) -> None:
        if not rows:
            self.batch = None
            return
        # The drafter's row j is the batch's draft_rows[j]: map the kept rows into its numbering.
        draft_index = {i: j for j, i in enumerate(self.batch.draft_rows)}
        self.batch.keep_rows(rows)
        if self.batch.mode.is_armed:
            draft_rows = [draft_index[i] for i in rows if i in draft_index]
            if draft_rows:
                self.drafter.keep_rows(draft_rows)
            else:
                self.drafter.reset()

    # --- delivery ----------------------------------------------------------------------

    def _deliver(self, request: Request, tokens: list[int]) -> bool:
        """Append tokens in order, stopping at an end token (EOS, stop_token_ids) or the budget;
        False once it finished."""
        budget = request.max_new_tokens
        new, status = [], None
        for token in tokens:
            if token in request.end_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                break
            new.append(token)
            if request.num_generated + len(new) >= budget:
                status = RequestStatus.FINISHED_LENGTH
                break
        # The prompt's logprobs ride the first output (a first token is always delivered alone).
        prompt_entries = None
        if request.is_scoring_prompt:
            prompt_entries = logprobs.take_prompt(request)
        entries = None if request.params.logprobs is None else logprobs.take_delivered(request, new)
        request.output_token_ids.extend(new)
        if status is None:
            if new:
                self._outputs.append(RequestOutput(request.request_id, tuple(new), logprobs=entries,
                                                   prompt_logprobs=prompt_entries))
            return True
        self._finish(request, status, new, entries, prompt_entries)
        return False

    def _finish(self, request: Request, status: RequestStatus, new: list[int] = (),
                entries: tuple | None = None, prompt_entries: tuple | None = None) -> RequestOutput:
        request.status = status
        request.finish_time_s = time.perf_counter()
        request.logprobs_by_position.clear()
        self.counters["num_finished"] += 1
        del self.requests[request.request_id]
        self.policy.forget(request.request_id)
        if entries is None and request.params.logprobs is not None:
            entries = ()
        output = RequestOutput(request.request_id, tuple(new), status.finish_reason, request.make_stats(), entries,
                               prompt_entries)
        self._outputs.append(output)
        return output

    def _retire(self, request: Request, caches, row: int) -> None:
        # A preempted request dropped its retirement context: its prefix is not offered back.
        if not request.is_preempted:
            self._offer(request, caches, row)

    def _event(self, kind: str, **fields) -> None:
        self.tally.event(kind, 0 if self.batch is None else self.batch.num_rows, **fields)


def _segments(chunks: list[admission.PackedChunk]) -> tuple[Segment, ...]:
    return tuple(Segment(c.tokens, c.caches) for c in chunks)
