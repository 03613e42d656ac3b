"""Continuous batching: which requests run this step and how many tokens each computes. No torch.

The rule (vLLM v1's): a request has ``num_computed_tokens`` and a target ``num_tokens`` (prompt plus
what it generated). Each step hands out tokens under one budget, ``max_num_batched_tokens``: running
requests first, oldest first (under the priority policy, most urgent first), then waiting ones. A prefill,
a chunk of a long prompt, a prefix-cache hit (computed tokens start at the cached length) and a decode step
are all the same rule. A decode may carry speculative drafts: they get what the budget and the free blocks
have left once every running and admitted request has its tokens, and only the accepted ones count as
computed.

When blocks run out, the newest running request (under the priority policy, the least urgent) is preempted:
its blocks are freed and it goes back to the front of the waiting queue (to its place by urgency) to be
recomputed, so the oldest (most urgent) request always makes progress.

A step is ``schedule()`` -> the runner -> ``update(out, result)``, which appends the sampled tokens and says
how each request would end (EOS, stop tokens, length); the output processor may replace that with a stop
string's decision, and ``finish_requests`` applies the final ones: every request ends here, in one place.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable

from kvserve.batch import NewRequestData, RunnerOutput, ScheduledRequest, SchedulerOutput
from kvserve.cache.kv_manager import EMPTY_HIT, KVCacheManager, PrefixHit
from kvserve.config import SchedulerConfig
from kvserve.kv_layout import NULL_PAGE
from kvserve.request import Finish, FinishReason, Request, RequestStatus, StepUpdate

logger = logging.getLogger(__name__)


def _urgency(request: Request) -> tuple[int, int]:
    """The priority policy's order: the lowest priority value first, then the earliest arrival (vLLM's)."""
    return request.sampling_params.priority, request.arrival_order


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv_manager: KVCacheManager, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.kv = kv_manager
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._known_to_runner: set[str] = set()
        self._forget: list[str] = []  # request ids the runner must drop at the next step
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # prompt tokens whose KV was computed (recomputations included)
        self.num_draft_steps = 0  # decodes that verified drafts; the drafts they verified, and of those accepted
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0

    # --- queue management -----------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._enqueue(request, at_front=False)

    def _enqueue(self, request: Request, at_front: bool) -> None:
        """Into the waiting queue: under the priority policy at its place by urgency (the queue is kept in that
        order, so choosing the next one reads only its head), else at the back, or at the front (preempted)."""
        if self.config.policy == "priority":
            bisect.insort(self.waiting, request, key=_urgency)
        elif at_front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_prefilling(self) -> int:
        """Running requests with prompt tokens still to compute."""
        return sum(r.num_computed_tokens < r.num_prompt_tokens for r in self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.requests)

    def abort_request(self, request_id: str) -> Request | None:
        """Stop a request wherever it is; its blocks are freed at once."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, FinishReason.ABORT)
        return request

    def finish_requests(self, updates: list[StepUpdate]) -> None:
        """Apply a step's final decisions: every update that carries a ``Finish`` ends its request."""
        for update in updates:
            finish = update.finish
            request = update.request
            if finish is None or request.is_finished:
                continue
            if finish.num_tokens is not None and finish.num_tokens < request.num_tokens:
                request.truncate(finish.num_tokens)
            request.stop_reason = finish.stop_reason
            self._finish(request, finish.reason)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.metrics.finished_time = self.clock()
        del self.requests[request.request_id]
        self._drop_from_runner(request.request_id)

    def _drop_from_runner(self, request_id: str) -> None:
        if request_id in self._known_to_runner:
            self._known_to_runner.discard(request_id)
            self._forget.append(request_id)

    # --- one step -------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput()
        now = self.clock()
        preempted = False

        # 1. Running requests, oldest first (priority: most urgent first). Preempt from the other end when blocks
        #    run out: the newest, or the least urgent.
        if self.config.policy == "priority":
            self.running.sort(key=_urgency)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens_to_compute, budget)
            while not self.kv.allocate(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                self._emit(out, request, num_new, now)
                budget -= num_new
                i += 1

        # 2. Waiting requests, while budget, sequence slots and blocks last. None after a preemption:
        #    memory is short, and admitting more would only preempt again.
        if not preempted:
            fetching: set[str] = set()  # requests whose cached prefix is still being read from a lower tier
            while budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self._next_waiting(fetching)
                if request is None:
                    break
                first_admission = request.status is RequestStatus.WAITING
                hit = self.kv.lookup(request)
                if hit.pending:
                    fetching.add(request.request_id)
                    continue
                num_new = min(request.num_tokens - hit.num_tokens, budget)
                if not self.kv.allocate(request, num_new, hit):
                    self.kv.release_hit(hit)
                    break
                self.waiting.remove(request)
                if first_admission:
                    request.num_cached_tokens = hit.num_tokens
                    request.metrics.num_cached_tokens = hit.num_tokens
                    request.metrics.first_scheduled_time = now
                    self.kv.record_admission(request, hit)
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                self._emit(out, request, num_new, now)
                budget -= num_new

        # 3. Speculative drafts ride on the decodes, from what the budget and the free blocks have left.
        if not preempted and budget > 0:
            self._add_drafts(out, budget)

        out.finished_request_ids, self._forget = self._forget, []
        if self.kv.has_pending_transfers:
            out.kv_loads, out.kv_offloads = self.kv.take_transfers()
        return out

    def _next_waiting(self, skip: set[str]) -> Request | None:
        """FCFS: the head of the queue. LPM: the longest cached prefix, unless a request has waited too long.
        Priority: the head too (the queue is kept by urgency). Requests in ``skip`` (their prefix is still being
        fetched) wait; the ones behind them go ahead."""
        candidates = list(itertools.islice((r for r in self.waiting if r.request_id not in skip),
                                           self.config.lpm_window))
        if not candidates:
            return None
        if self.config.policy != "lpm" or len(candidates) == 1:
            return candidates[0]
        for request in candidates:
            if request.lpm_skips >= self.config.lpm_max_skips or request.status is RequestStatus.PREEMPTED:
                chosen = request
                break
        else:
            chosen = max(candidates, key=lambda r: (self.kv.cached_prefix_length(r), -r.arrival_order))
        for request in candidates:
            if request is chosen:
                break
            request.lpm_skips += 1  # passed over by a later arrival
        return chosen

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Give scheduled decodes their drafts, in the running order, within the leftover budget,
        max_total_tokens and the free blocks: drafts never take a block or a token another request needs, nor
        evict cached KV."""
        for scheduled in out.scheduled:
            request = self.requests[scheduled.request_id]
            if not request.draft_token_ids or request.num_tokens_to_compute != 1:
                continue  # no drafts, or a prefill chunk
            # Within the request's own blocks and the free ones, so the allocation below evicts nothing.
            room = self.kv.num_tokens_without_eviction(request) - 1  # after its own token
            drafts = request.draft_token_ids[: min(budget, request.max_draft_tokens(), room)]
            if drafts and self.kv.allocate(request, 1 + len(drafts)):
                scheduled.draft_token_ids = drafts
                scheduled.block_ids = list(request.block_ids)  # with the blocks the drafts' KV goes into
                scheduled.group_block_ids = [list(table) for table in request.group_block_ids]
                budget -= len(drafts)
                if budget == 0:
                    return

    def _emit(self, out: SchedulerOutput, request: Request, num_new: int, now: float) -> None:
        start = request.num_computed_tokens
        if request.request_id not in self._known_to_runner:
            self._known_to_runner.add(request.request_id)
            out.new_requests.append(
                NewRequestData(
                    request.request_id,
                    request.sampling_params,
                    request.prompt_token_ids,
                    request.output_token_ids,
                    request.eos_token_ids,
                    request.grammar,
                    request.lora,
                )
            )
        out.scheduled.append(
            ScheduledRequest(
                request.request_id,
                request.all_token_ids[start : start + num_new],
                start,
                list(request.block_ids),  # a copy: the runner sees this step's table, whatever changes after
                start + num_new == request.num_tokens,
                group_block_ids=[list(table) for table in request.group_block_ids],
            )
        )
        # Cached as soon as scheduled, so requests admitted after it (this step too) share these blocks.
        self.kv.cache_blocks(request, start + num_new)

    def _preempt(self, request: Request) -> None:
        logger.debug("preempting %s", request.request_id)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.metrics.num_preemptions += 1
        request.metrics.preemption_times.append(self.clock())
        self.num_preemptions += 1
        request.draft_token_ids = []
        self._enqueue(request, at_front=True)
        self._drop_from_runner(request.request_id)

    # --- results --------------------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[StepUpdate]:
        """Apply a step's results: computed tokens, sampled and accepted tokens, the KV the runner copied out
        for the tiers. Returns the requests that got new tokens, each with how many (more than one when
        drafts were accepted) and how it ends, if it does; ``finish_requests`` applies the endings."""
        now = self.clock()
        self.kv.step_done(result.offloaded)
        if out.is_empty:
            # Nothing ran: only prefixes being read from disk or Redis are left. Wait for one, don't spin.
            self.kv.wait_for_fetches(timeout_s=0.01)
        updates: list[StepUpdate] = []
        for rid, (first, entries, ranks) in result.prompt_logprobs.items():
            request = self.requests.get(rid)
            if request is not None and request.prompt_logprobs is not None:
                request.prompt_logprobs[first:first + len(entries)] = entries
                request.prompt_token_ranks[first:first + len(ranks)] = ranks
        for scheduled in out.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            num_new = len(scheduled.token_ids)
            metrics = request.metrics
            prompt_left = request.num_prompt_tokens - request.num_computed_tokens
            if prompt_left > 0:
                metrics.num_prefill_chunks += 1
                metrics.prefill_chunk_ends.append((now, num_new))
                metrics.num_prefill_tokens_computed += num_new
                self.num_prompt_tokens_computed += min(num_new, prompt_left)
            request.num_computed_tokens += num_new
            if not scheduled.sample:
                continue
            rid = request.request_id
            num_accepted = result.num_accepted_drafts.get(rid, 0)
            # The accepted drafts' KV was written this step; the sampled token's is computed next step.
            request.num_computed_tokens += num_accepted
            new_token_ids = [*scheduled.draft_token_ids[:num_accepted], result.sampled_token_ids[rid]]
            request.draft_token_ids = result.draft_token_ids.get(rid, [])
            if scheduled.draft_token_ids:
                metrics.num_draft_steps += 1
                metrics.num_draft_tokens += len(scheduled.draft_token_ids)
                metrics.num_accepted_draft_tokens += num_accepted
                self.num_draft_steps += 1
                self.num_draft_tokens += len(scheduled.draft_token_ids)
                self.num_accepted_draft_tokens += num_accepted
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            else:
                metrics.num_decode_steps += 1
            metrics.last_token_time = now
            metrics.token_times.append(now)
            if request.hidden_state is None and rid in result.hidden_states:
                request.hidden_state = result.hidden_states[rid]
            updates.append(self._append_tokens(request, new_token_ids, result.logprobs.get(rid, {})))
        return updates

    def _append_tokens(self, request: Request, token_ids: list[int], logprobs: dict[int, float]) -> StepUpdate:
        """Append a step's new tokens up to the first one that ends the request."""
        for count, token_id in enumerate(token_ids, 1):
            request.append_token(token_id)
            if request.output_logprobs is not None:
                request.output_logprobs.append(logprobs)  # logprob requests get one token a step
            finish = self._check_stop(request, token_id)
            if finish is not None:
                # Tokens after a stop are dropped; the KV of accepted drafts past it with them.
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
                return StepUpdate(request, count, finish)
        return StepUpdate(request, len(token_ids))

    @staticmethod
    def _check_stop(request: Request, token_id: int) -> Finish | None:
        params = request.sampling_params
        reached_min = request.num_output_tokens >= params.min_tokens
        # A request that follows a grammar ends where the grammar lets it end (EOS): min_tokens does not hold it
        # back (its sampler does not suppress EOS either; held, it would be forced to EOS step after step).
        if (reached_min or params.structured_outputs is not None) and not params.ignore_eos \
                and token_id in request.eos_token_ids:
            return Finish(FinishReason.STOP)
        if reached_min and token_id in params.stop_token_ids:
            return Finish(FinishReason.STOP, stop_reason=token_id)
        if request.num_tokens >= request.max_total_tokens:
            return Finish(FinishReason.LENGTH)
        return None

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        owners: dict[int, str] = {}
        for request in self.running:
            expected = request.num_blocks_needed(request.num_computed_tokens, self.kv.block_size)
            assert len(request.block_ids) >= expected, f"{request} holds too few blocks"
            pages = [page for table in request.group_block_ids for page in table if page != NULL_PAGE]
            for table in request.group_block_ids:
                assert len(table) == len(request.block_ids), f"{request}: a group table of {len(table)} blocks"
            for block_id in request.block_ids + pages:
                assert self.kv.pool.ref_counts[block_id] > 0, f"{request} holds unreferenced block {block_id}"
                if block_id in owners and not self.kv.pool.cached[block_id]:
                    raise AssertionError(f"private block {block_id} owned by {owners[block_id]} and {request}")
                owners[block_id] = request.request_id
        for request in self.waiting:
            assert not request.block_ids and not request.group_block_ids, f"waiting {request} holds blocks"


__all__ = ["Scheduler", "EMPTY_HIT", "PrefixHit"]
