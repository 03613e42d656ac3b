"""The token ids a draft model proposes from.

A small draft's output projection is a large share of what it reads a token (a Qwen2.5 0.5B's 151,936 rows
are about a third). Pruned, the draft computes logits for a set of ids kept at start-up, its output
projection's rows copied out once, and for each running request's own prompt ids outside that set (the names
and words a reply quotes back), their rows dequantised when the request is first drafted for. A target token
the draft cannot propose is a rejected draft, never a wrong token: verification decides.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.quantized import QuantizedWeight, Weight

GROUP = 16  # the quantised kernels hold rows sixteen at a time: a kept set is filled up to whole groups


def kept_ids(vocab_size: int, size: int | None, ranked: Sequence[int] | None, always: Sequence[int] = ()
             ) -> list[int] | None:
    """The ids a pruned draft keeps, ascending (None: the whole vocabulary). With a ``ranked`` token map, its
    first ``size`` ids (all of them if None) and ``always`` (the special tokens a reply ends with), filled up
    with the next ranked ids to whole groups; without one, the ids below ``size``."""
    if ranked is None:
        return None if size is None or size >= vocab_size else list(range(size))
    ranked = [i for i in ranked if i < vocab_size]
    leading = ranked[:size] if size is not None else ranked
    kept = set(leading) | {i for i in always if i < vocab_size}
    fill = (i for i in itertools.chain(ranked[len(leading):], range(vocab_size)) if i not in kept)
    while (len(kept) % GROUP or not kept) and len(kept) < vocab_size:
        kept.add(next(fill))
    return None if len(kept) >= vocab_size else sorted(kept)


class DraftVocabulary:
    """Logits over the ids a draft proposes from: ``kept`` (ascending; None: the whole vocabulary of
    ``vocab_size``) and, once pruned, the prompt ids outside it of the requests drafted for in a forward."""

    def __init__(self, model: LlamaForCausalLM, vocab_size: int, kept: Sequence[int] | None) -> None:
        assert kept is None or len(kept) > 0
        self.model = model
        self.vocab_size = vocab_size
        device = model.device
        self.kept = None if kept is None else torch.tensor(kept, dtype=torch.long, device=device)
        self._kept_set = frozenset(kept or ())
        self._num_leading = len(kept) if kept is not None and kept[-1] == len(kept) - 1 else 0
        self.head = None if kept is None else _head_rows(model, kept, self._num_leading)
        self._extras: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # request -> (ids, their output rows)
        # The last forward's requests and their extra ids and rows, united once: a step's draft forwards
        # mostly draft for the same requests.
        self._batch: tuple[tuple[str, ...], torch.Tensor, torch.Tensor] | None = None

    @property
    def pruned(self) -> bool:
        return self.kept is not None

    def admit(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Makes the request's prompt ids proposable for it (once; nothing when not pruned)."""
        if self.kept is None or request_id in self._extras:
            return
        extra = sorted({i for i in prompt_token_ids if i < self.vocab_size} - self._kept_set)
        if extra:
            ids = torch.tensor(extra, dtype=torch.long, device=self.model.device)
            self._extras[request_id] = (ids, _output_rows(self.model, ids))
        else:
            self._extras[request_id] = (torch.empty(0, dtype=torch.long), torch.empty(0))

    def forget(self, request_id: str) -> None:
        if self._extras.pop(request_id, None) is not None:
            self._batch = None

    @property
    def num_admitted(self) -> int:
        return len(self._extras)

    def logits(self, hidden: torch.Tensor, request_ids: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows' logits over the proposable ids, and those ids (None: every id below ``vocab_size``, in
        order). ``request_ids``: the rows' requests, whose prompt ids are added (to every row: a draft token
        from another request's prompt is verified like any other)."""
        if self.kept is None:
            return self.model.compute_logits(hidden)[:, : self.vocab_size], None
        logits = self.model.compute_logits(hidden, self.head)
        if self._num_leading:
            logits = logits[:, : self._num_leading]  # the leading rows may run on to a whole group
        extra_ids, extra_rows = self._batch_extras(tuple(dict.fromkeys(request_ids)))
        if not len(extra_ids):
            return logits, self.kept
        logits = torch.cat([logits, self.model.compute_logits(hidden, extra_rows)], dim=1)
        return logits, torch.cat([self.kept, extra_ids])

    def _batch_extras(self, request_ids: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The requests' extra ids (each once) and their output rows."""
        if self._batch is None or self._batch[0] != request_ids:
            extras = [self._extras[r] for r in request_ids if r in self._extras and len(self._extras[r][0])]
            if not extras:
                ids, rows = torch.empty(0, dtype=torch.long), torch.empty(0)
            elif len(extras) == 1:
                ids, rows = extras[0]
            else:  # one column per id
                ids, first = _unique_first(torch.cat([i for i, _ in extras]))
                rows = torch.cat([r for _, r in extras])[first.to(extras[0][1].device)]
            self._batch = (request_ids, ids, rows)
        return self._batch[1], self._batch[2]

    def full(self, logits: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        """[rows, vocab_size] logits, -inf at the ids the draft cannot propose (a probability of 0)."""
        if ids is None:
            return logits
        out = torch.full((logits.shape[0], self.vocab_size), float("-inf"), dtype=logits.dtype, device=logits.device)
        out[:, ids] = logits
        return out


def _head_rows(model: LlamaForCausalLM, kept: Sequence[int], num_leading: int) -> Weight:
    """The output projection's rows ``kept``: of a quantised weight, a view of the leading ones (it may keep
    up to fifteen more) or a copy of any others; of a dense one, a copy."""
    weight = model.lm_head
    if isinstance(weight, QuantizedWeight):
        return weight.leading_rows(num_leading) if num_leading else weight.gather_rows(kept)
    # A copy: the kernels find a dense weight's packed copy by its storage address, which a view would share.
    head = (weight[:num_leading] if num_leading else weight[torch.tensor(kept)]).clone()
    model.ops.prepare_weight(head)
    return head


def _output_rows(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The output projection's rows ``ids``, dense: looked up as embedding rows are (the kernels take a
    quantised table in one segment)."""
    weight = model.lm_head
    if isinstance(weight, QuantizedWeight) and len(weight.segments) > 1:
        return weight.gather_rows(ids.tolist()).dequantize(model.dtype)
    return model.ops.embedding(ids, weight)


def _unique_first(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct ids in their first order, and where each first occurs."""
    seen: dict[int, int] = {}
    for position, token_id in enumerate(ids.tolist()):
        seen.setdefault(token_id, position)
    return (torch.tensor(list(seen), dtype=torch.long, device=ids.device),
            torch.tensor(list(seen.values()), dtype=torch.long))
