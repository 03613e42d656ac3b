"""A step's new tokens to what the caller sees: text deltas, stop strings, and the outputs themselves.

The scheduler's ``update`` says how each request would end by its tokens (EOS, stop tokens, length); this
processor detokenises the new tokens and may end a request earlier, at a stop string. It returns the outputs
and the final decisions, which the scheduler applies (``Scheduler.finish_requests``): a request's end is
decided here and carried out there, never patched afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvserve.detokenizer import IncrementalDetokenizer
from kvserve.request import CompletionOutput, Finish, FinishReason, Request, RequestOutput, StepUpdate
from kvserve.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class ProcessedStep:
    outputs: list[RequestOutput]
    # The step's updates with their final decisions, for ``Scheduler.finish_requests``.
    updates: list[StepUpdate]


class OutputProcessor:
    """Owns one incremental detokenizer per unfinished request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.num_generated_tokens = 0

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        self._detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )

    def process(self, updates: list[StepUpdate]) -> ProcessedStep:
        outputs: list[RequestOutput] = []
        final: list[StepUpdate] = []
        for update in updates:
            output, update = self._process_one(update)
            outputs.append(output)
            final.append(update)
        self.num_generated_tokens += sum(len(output.delta_token_ids) for output in outputs)
        return ProcessedStep(outputs, final)

    def _process_one(self, update: StepUpdate) -> tuple[RequestOutput, StepUpdate]:
        request, num_new = update.request, update.num_new_tokens
        detok = self._detokenizers[request.request_id]
        new_ids = request.all_token_ids[request.num_tokens - num_new :]
        # One token at a time (a step may bring accepted drafts), so a stop string ends the output where
        # plain decoding would. Stop strings count only once the output is past min_tokens, where a stop token
        # may also end it (as in vLLM).
        num_before = request.num_output_tokens - num_new
        min_tokens = request.sampling_params.min_tokens
        # The token that ends the output (EOS, a stop token id) stays in its token ids but not in its text,
        # unless asked for (as vLLM: a stop string is cut the same way).
        on_stop_token = (update.finish is not None and update.finish.reason is FinishReason.STOP
                         and not request.sampling_params.include_stop_str_in_output)
        delta = ""
        for i, token_id in enumerate(new_ids[:-1] if on_stop_token else new_ids):
            delta += detok.add_tokens([token_id], check_stop=num_before + i + 1 > min_tokens)
            if detok.stopped is not None:
                new_ids = new_ids[: i + 1]
                break
        finish = update.finish
        if detok.stopped is not None:
            ended_early = len(new_ids) < num_new
            # A stop string wins over the length limit reached on the same token (as in vLLM), and over
            # whatever a later token of the step did; a stop token on that same token keeps its own reason.
            if finish is None or ended_early or finish.reason is FinishReason.LENGTH:
                cut = request.num_tokens - (num_new - len(new_ids)) if ended_early else None
                finish = Finish(FinishReason.STOP, stop_reason=detok.stopped, num_tokens=cut)
        elif finish is not None:
            delta += detok.flush()
        num_tokens = finish.num_tokens if finish is not None and finish.num_tokens is not None else request.num_tokens
        output = self._make_output(request, new_ids, delta, finish, num_tokens)
        return output, update if finish is update.finish else replace(update, finish=finish)

    def abort(self, request: Request) -> RequestOutput:
        """The last output of an aborted request: the text held back for a possible stop string is final now,
        so the streamed deltas add up to the output's text, as for every other way a request ends."""
        delta = self._detokenizers[request.request_id].flush()
        return self._make_output(request, [], delta, Finish(FinishReason.ABORT), request.num_tokens)

    def _make_output(self, request: Request, new_ids: list[int], delta: str, finish: Finish | None,
                     num_tokens: int) -> RequestOutput:
        detok = self._detokenizers[request.request_id]
        if finish is not None:
            del self._detokenizers[request.request_id]
        completion = CompletionOutput(
            index=0,
            text=detok.text,
            token_ids=request.all_token_ids[request.num_prompt_tokens : num_tokens],
            finish_reason=finish.reason.value if finish is not None else None,
            stop_reason=finish.stop_reason if finish is not None else None,
            logprobs=request.output_logprobs,
            hidden_state=request.hidden_state,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finish is not None,
            num_cached_tokens=request.num_cached_tokens,
            metrics=request.metrics,
            delta_text=delta,
            delta_token_ids=new_ids,
            prompt_logprobs=request.prompt_logprobs,
            prompt_token_ranks=request.prompt_token_ranks,
        )
