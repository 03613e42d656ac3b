"""Token masks of a step's constrained rows, applied to their logits before anything is sampled.

llguidance writes one bit per token for every constrained row at once (on its own threads, without the
GIL); xgrammar's rows are filled one by one from its precomputed sets. The runner asks for a step's
masks before its forward (``prefetch``), so that they are computed while the model runs, and sampling only
waits for what is left. The backend's kernel, where it has one, sets the logits of clear bits to -inf a
word at a time; otherwise the bits are expanded to a boolean mask with torch ops. Penalties, logprobs,
top-k/p and the greedy argmax all see the masked logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from kvserve.structured.grammar import GrammarMatcher, LLGuidanceMatcher
from kvserve.structured.xgrammar_engine import XGrammarMatcher, fill_bitmasks

MaskLogits = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # as the model backends define it


class GrammarMasker:
    """Masks logits [B, V] in place for the rows that follow a grammar; counts the time it takes."""

    def __init__(self, vocab_size: int, mask_logits: MaskLogits | None = None, num_threads: int | None = None) -> None:
        """``vocab_size``: the grammar's vocabulary (GrammarCompiler.mask_vocab_size); ``mask_logits``: the
        backend's kernel (None: torch ops)."""
        self.num_words = (vocab_size + 31) // 32
        self._mask_logits = mask_logits
        self._executor = llguidance.LLExecutor(num_threads)
        self._bitmask = torch.zeros(1, self.num_words, dtype=torch.int32)
        # Byte value -> its 8 bits, lowest first: bit i of a little-endian word is token 32 * word + i.
        self._bits_of_byte = (torch.arange(256).unsqueeze(1) >> torch.arange(8)).bitwise_and(1).bool()  # [256, 8]
        # Masks started before the forward: the matchers and their versions then, and the bitmask to come.
        self._prefetch_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-mask")
        self._prefetched: tuple[list[tuple[GrammarMatcher, int]], Future[torch.Tensor]] | None = None
        self.mask_time_s = 0.0  # time sampling spent on masks (waiting for a prefetch, or computing them)
        self.num_masked_rows = 0

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[GrammarMatcher]) -> None:
        """Set to -inf, in ``logits`` [B, V], every token the matcher of ``rows[j]`` does not allow now."""
        t0 = time.perf_counter()
        kernel = self._mask_logits
        if kernel is not None and logits.device.type == "cpu" and logits.stride(1) == 1 and logits.dtype in (
                torch.bfloat16, torch.float32):
            kernel(logits, torch.tensor(rows, dtype=torch.long), self.bitmask(matchers))
        else:
            columns = logits.shape[1]
            allowed = self.allowed(matchers)  # [R, 32 * words]
            if allowed.shape[1] < columns:  # logit columns past the grammar's vocabulary are never allowed
                allowed = torch.nn.functional.pad(allowed, (0, columns - allowed.shape[1]), value=False)
            index = torch.tensor(rows, dtype=torch.long, device=logits.device)
            logits[index] = logits[index].masked_fill(~allowed[:, :columns].to(logits.device), float("-inf"))
        self.mask_time_s += time.perf_counter() - t0
        self.num_masked_rows += len(rows)

    def prefetch(self, matchers: list[GrammarMatcher]) -> None:
        """Start computing the masks of ``matchers`` as they are now, on another thread. The next ``bitmask``
        call waits for it (so no matcher changes while it runs) and uses it if it asks for the same
        matchers, unchanged."""
        self.wait_for_prefetch()
        buffer = torch.empty(len(matchers), self.num_words, dtype=torch.int32)
        future = self._prefetch_thread.submit(self._fill, matchers, buffer)
        self._prefetched = ([(m, m.version) for m in matchers], future)

    def wait_for_prefetch(self) -> tuple[list[tuple[GrammarMatcher, int]], torch.Tensor] | None:
        if self._prefetched is None:
            return None
        key, future = self._prefetched
        self._prefetched = None
        return key, future.result()

    def bitmask(self, matchers: list[GrammarMatcher]) -> torch.Tensor:
        """int32 [R, words]: bit i of word w set when matcher R allows token 32 w + i next."""
        prefetched = self.wait_for_prefetch()
        if prefetched is not None:
            key, bitmask = prefetched
            if len(key) == len(matchers) and all(m is k and m.version == v for (k, v), m in zip(key, matchers,
                                                                                                 strict=True)):
                return bitmask
        num_rows = len(matchers)
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = torch.zeros(num_rows, self.num_words, dtype=torch.int32)
        return self._fill(matchers, self._bitmask[:num_rows])

    def _fill(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> torch.Tensor:
        on_llguidance = [(m.llg_matcher, j) for j, m in enumerate(matchers) if isinstance(m, LLGuidanceMatcher)]
        if on_llguidance:
            self._executor.unsafe_compute_mask_ptr(on_llguidance, bitmask.data_ptr(), self.num_words * 4,
                                                   len(matchers))
        if len(on_llguidance) < len(matchers):
            fill_bitmasks([(m, j) for j, m in enumerate(matchers) if isinstance(m, XGrammarMatcher)], bitmask)
        return bitmask

    def allowed(self, matchers: list[GrammarMatcher]) -> torch.Tensor:
        """[R, 32 * words] bool: the tokens each matcher allows next."""
        num_rows = len(matchers)
        as_bytes = self.bitmask(matchers).view(torch.uint8).long()  # [R, 4W]
        return self._bits_of_byte[as_bytes].view(num_rows, -1)
