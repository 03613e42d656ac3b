"""How many drafts each request gets next step: the lengths that give the most tokens per second of step time.

Speculation pays while the tokens a step's drafts add are worth the time their rows cost. Both sides are
measured as the engine runs, so the choice follows the load:

- **Acceptance.** Each request's chance that a draft is accepted, ``a``, from its own verifications (an
  exponentially weighted count, pulled towards the method's running average while it has few). With drafts
  accepted in a row until the first rejection, ``k`` drafts are worth ``a + a^2 + ... + a^k`` tokens
  beyond the one every step brings.
- **Cost.** What a target step of ``R`` rows takes, and a draft forward of ``R`` rows (none for n-gram
  lookup, nor for a draft model's requests whose drafts prompt lookup finds that step): the recent
  average at each row count seen, a linear fit over recent steps elsewhere, and past the widest step
  measured at least that step's cost per row. Small batches are bound by reading the
  weights, so extra rows are cheap there; large ones are bound by compute, where each row costs its full
  share and drafts stop paying. The draft's predicted cost is scaled by what its whole proposals took over
  what was predicted for them (catch-up rows, the work between forwards).
- **Onboarding** (a draft model). A request's first drafts cost the draft the prefill of what its KV lacks
  of the request (its prompt, less what the draft's prefix cache holds): paid once, then worth something
  every step the request drafts. It is charged spread over the steps the request is expected to draft in:
  its expected remaining output (as long as the outputs of the requests that recently left the batch, at
  most what it may still write) over the tokens a step of its drafts brings, and with prompt lookup first,
  over only the share of its steps lookup has left to the model. Before anything is measured the first
  step drafts nothing (a plain step's cost is what drafts are weighed against). The engine measures the
  draft's forwards at start-up, but acceptance only verification measures: until a draft is verified, one
  request alone drafts, the cheapest to onboard (a burst of new requests does not pay every prompt's
  prefill in the draft before it is known whether the draft's tokens are accepted), and only where its
  drafts would pay were they all accepted (a long prompt's prefill in the draft, or a batch whose extra
  rows cost compute, is not paid to learn an acceptance that could not repay it).

The lengths maximise (expected tokens) / (predicted seconds) over the whole batch (the goodput rule of
SmartSpec and TurboSpec). Drafts are added in order of their expected worth (``a_i^j`` for request ``i``'s
``j``-th draft; a request still to onboard ranks lower by its charge; free drafts before any the draft model
pays for) and the best prefix is kept: that order is also each request's own order.
Every ``probe_every`` steps a probe changes the lengths: where none were chosen, one draft each (for a
draft model, only to requests it has drafted for: a first draft costs the prompt's prefill in the draft),
so that acceptance, which only verification measures, is not left at a stale estimate; where the cost fit has seen
too narrow a range of row counts to tell the slope, half as many, so the fit keeps learning at the current
load.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

_MIN_ACCEPTANCE, _MAX_ACCEPTANCE = 0.01, 0.99
_PRIOR_WEIGHT = 2.0  # verifications' worth of the method's average in a request's own estimate
_REQUEST_DECAY = 0.8  # a request's acceptance follows its text: recent verifications count most
_METHOD_DECAY = 0.99
_COST_DECAY = 0.98
_PRIOR_ROW_SHARE = 0.25  # before the slope is known: a row costs this share of its proportional time
_ROW_MEAN_DECAY = 0.8  # a row count's recent mean: each observation moves it a fifth of the way
_MIN_ROW_OBSERVATIONS = 2
_DRAFT_SCALE_DECAY = 0.9
_MAX_DRAFT_SCALE_STEP = 2.0  # how far one slow proposal (a long prompt's prefill in the draft) moves the scale
_PREFILL_ROWS = 32  # a draft forward of more rows than this is mostly a catch-up (a prompt's prefill)
_PREFILL_RATE_DECAY = 0.8
_OUTPUT_LEN_DECAY = 0.9
_PRIOR_OUTPUT_TOKENS = 128  # a request's expected remaining output before any request has finished
_MIN_MODEL_SHARE = 0.02  # of a request's steps, at least this share is expected to need the draft model


class LinearCost:
    """Seconds of a forward as ``intercept + slope * rows``, fitted by exponentially weighted least squares."""

    def __init__(self, decay: float = _COST_DECAY) -> None:
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    @property
    def has_data(self) -> bool:
        return self._w > 0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + rows
        self._y = self._y * d + seconds
        self._xx = self._xx * d + rows * rows
        self._xy = self._xy * d + rows * seconds

    @property
    def narrow(self) -> bool:
        """True when the rows seen vary too little to tell the slope from noise."""
        if not self.has_data:
            return True
        mean = self._x / self._w
        variance = self._xx / self._w - mean * mean
        return variance < (0.1 * mean) ** 2

    def coefficients(self) -> tuple[float, float]:
        """(intercept, slope), both >= 0; (0, 0) with no data."""
        if not self.has_data:
            return 0.0, 0.0
        w = self._w
        mean_x, mean_y = self._x / w, self._y / w
        variance = self._xx / w - mean_x * mean_x
        if self.narrow or variance <= 0:
            slope = _PRIOR_ROW_SHARE * mean_y / max(mean_x, 1.0)
        else:
            slope = max(0.0, (self._xy / w - mean_x * mean_y) / variance)
        intercept = max(0.0, mean_y - slope * mean_x)
        return intercept, slope

    def predict(self, rows: int) -> float:
        intercept, slope = self.coefficients()
        return intercept + slope * rows


class StepCost:
    """Seconds of a forward by its number of rows: the recent average at each row count seen, and the linear
    fit elsewhere. Row counts matter one by one: a kernel that takes rows in tiles reads the weights once per
    tile, so one row past a tile can cost as much as the whole tile (on a 2-core AVX2 CPU, 5 rows took about
    twice 4). Past the widest row count measured, a row costs at least its share of that step: a fit over
    narrow steps, bound by reading the weights, would price wide ones, bound by compute, far too low."""

    def __init__(self) -> None:
        self.fit = LinearCost()
        self._by_rows: dict[int, tuple[float, int]] = {}  # rows -> (recent mean, observations)
        self._widest = 0  # the most rows measured often enough to have a mean

    @property
    def has_data(self) -> bool:
        return self.fit.has_data

    @property
    def narrow(self) -> bool:
        return self.fit.narrow

    def observe(self, rows: int, seconds: float) -> None:
        self.fit.observe(rows, seconds)
        mean, count = self._by_rows.get(rows, (seconds, 0))
        self._by_rows[rows] = (mean + (seconds - mean) * max(1 - _ROW_MEAN_DECAY, 1 / (count + 1)), count + 1)
        if count + 1 >= _MIN_ROW_OBSERVATIONS:
            self._widest = max(self._widest, rows)

    def predict(self, rows: int) -> float:
        mean, count = self._by_rows.get(rows, (0.0, 0))
        if count >= _MIN_ROW_OBSERVATIONS:
            return mean
        fitted = self.fit.predict(rows)
        if self._widest and rows > self._widest:
            fitted = max(fitted, self._by_rows[self._widest][0] * rows / self._widest)
        return fitted


@dataclass(slots=True)
class _Acceptance:
    accepted: float = 0.0
    trials: float = 0.0


class DraftLengthPolicy:
    """Chooses each request's number of drafts (0 = none) from measured acceptance and cost."""

    def __init__(self, max_tokens: int, *, adaptive: bool = True, uses_model: bool = False,
                 prior_acceptance: float = 0.6, probe_every: int = 16) -> None:
        self.max_tokens = max_tokens
        self.adaptive = adaptive
        self.uses_model = uses_model  # drafts cost a forward of a draft model, per draft position
        self.target_cost = StepCost()
        self.draft_cost = StepCost()
        self._method = _Acceptance(prior_acceptance * 4, 4.0)
        self._requests: dict[str, _Acceptance] = {}
        self.probe_every = probe_every
        self._num_calls = 0
        # What the draft's work took over what its forwards' costs predicted: the catch-up rows, a new
        # request's prefill in the draft and the glue between forwards are in the measurement, not the fit.
        self.draft_scale = 1.0
        self._predicted_draft_s = 0.0
        self._free: set[str] = set()  # the last choice's requests whose drafts cost the draft model nothing
        self._verified_any = False  # whether any draft was verified yet (acceptance is only the prior before)
        self.last_mean_length = 0.0  # the mean length chosen for the last batch (a gauge for /metrics)
        self._onboarded: set[str] = set()  # requests the draft model has drafted for
        self._onboarding: dict[str, int] = {}  # the last choice's new requests: the tokens their prefill computes
        self._prefill_s_per_token: float | None = None  # the draft's catch-up forwards, per row
        self._mean_output_tokens: float | None = None  # of recently finished requests
        # The share of a request's steps whose drafts were free (prompt lookup found them), and of all requests'
        # steps: only its other steps draw on the draft model, and repay its onboarding.
        self._free_share: dict[str, float] = {}
        self._method_free_share = 0.0

    # --- measurements -----------------------------------------------------------------------------------
    def observe_step(self, rows: int, seconds: float) -> None:
        """A target step of decodes (with their drafts) took ``seconds`` for ``rows`` rows."""
        self.target_cost.observe(rows, seconds)

    def observe_draft(self, timings: Sequence[tuple[int, float]]) -> None:
        for rows, seconds in timings:
            if rows <= _PREFILL_ROWS:
                self.draft_cost.observe(rows, seconds)
                continue
            rate, known = seconds / rows, self._prefill_s_per_token  # a catch-up, priced apart from draft rows
            self._prefill_s_per_token = rate if known is None else known + (rate - known) * (1 - _PREFILL_RATE_DECAY)

    def observe_propose(self, seconds: float, drafted: Collection[str] = ()) -> None:
        """The proposer's whole work for the lengths last chosen took ``seconds``; ``drafted``: the requests that
        got drafts (a draft model now holds those whose drafts were not free)."""
        if not self.uses_model:
            return
        drafted = [rid for rid in drafted if rid not in self._free]
        onboarded = [rid for rid in drafted if rid in self._onboarding and rid not in self._onboarded]
        predicted = self._predicted_draft_s + sum(self._prefill_seconds(self._onboarding[rid]) for rid in onboarded)
        self._onboarded.update(drafted)
        if predicted > 0:
            ratio = min(_MAX_DRAFT_SCALE_STEP, seconds / predicted)
            self.draft_scale += (ratio - self.draft_scale) * (1 - _DRAFT_SCALE_DECAY)

    def observe_verified(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """``num_drafts`` of the request's drafts were verified; the first ``num_accepted`` were accepted."""
        trials = num_accepted + (num_accepted < num_drafts)
        self._verified_any = True
        own = self._requests.setdefault(request_id, _Acceptance())
        own.accepted = own.accepted * _REQUEST_DECAY + num_accepted
        own.trials = own.trials * _REQUEST_DECAY + trials
        method = self._method
        method.accepted = method.accepted * _METHOD_DECAY + num_accepted
        method.trials = method.trials * _METHOD_DECAY + trials

    def forget(self, request_id: str, output_tokens: int | None = None) -> None:
        """The request left the batch (finished, aborted or preempted); ``output_tokens``: how many it wrote."""
        self._requests.pop(request_id, None)
        self._free_share.pop(request_id, None)
        self._onboarded.discard(request_id)
        if output_tokens is not None:
            mean = self._mean_output_tokens
            self._mean_output_tokens = (float(output_tokens) if mean is None
                                        else mean + (output_tokens - mean) * (1 - _OUTPUT_LEN_DECAY))

    def acceptance(self, request_id: str) -> float:
        """The request's estimated chance that a draft is accepted."""
        method = self._method
        prior = method.accepted / method.trials
        own = self._requests.get(request_id)
        if own is None:
            estimate = prior
        else:
            estimate = (own.accepted + _PRIOR_WEIGHT * prior) / (own.trials + _PRIOR_WEIGHT)
        return min(_MAX_ACCEPTANCE, max(_MIN_ACCEPTANCE, estimate))

    # --- the choice -------------------------------------------------------------------------------------
    def lengths(self, request_ids: Sequence[str], onboarding_tokens: Sequence[int] | None = None,
                remaining: Sequence[int | None] | None = None, free: Sequence[bool] | None = None) -> list[int]:
        """Drafts for each request's next step, for a batch of these requests. For a draft model,
        ``onboarding_tokens``: per request, what its first proposal computes before its first draft (0 once
        the draft holds it); ``remaining``: the tokens each may still write (None: no limit); ``free``: per
        request, whether its drafts cost the draft model nothing this step (prompt lookup found them)."""
        num = len(request_ids)
        if not self.adaptive:
            self.last_mean_length = float(self.max_tokens) if num else 0.0
            return [self.max_tokens] * num
        self._num_calls += 1
        no_cost = list(free) if self.uses_model and free is not None else [False] * num
        if free is not None and self.uses_model:
            for rid, f in zip(request_ids, no_cost, strict=True):
                share = self._free_share.get(rid, self._method_free_share)
                self._free_share[rid] = share + (f - share) * (1 - _REQUEST_DECAY)
                self._method_free_share += (f - self._method_free_share) * (1 - _METHOD_DECAY)
        onboarding = ([0 if f else tokens for tokens, f in zip(onboarding_tokens, no_cost, strict=True)]
                      if self.uses_model and onboarding_tokens is not None else [0] * num)
        left = list(remaining) if remaining is not None else [None] * num
        if not self.target_cost.has_data:
            lengths = [0] * num  # a plain step first: what drafts are weighed against
        elif self.uses_model and not (self.draft_cost.has_data and self._verified_any):
            # The draft's cost (unless measured at start-up) and its acceptance, which only verification
            # measures, are learnt on one request's drafts, the cheapest to onboard; free drafts cost it nothing.
            lengths = [self.max_tokens if f else 0 for f in no_cost]
            paid = [i for i in range(num) if not no_cost[i]]
            if paid:
                cheapest = min(paid, key=lambda i: onboarding[i])
                if not self.draft_cost.has_data or self._could_pay(cheapest, onboarding[cheapest], left[cheapest],
                                                                   no_cost):
                    lengths[cheapest] = self.max_tokens
        else:
            acceptance = [self.acceptance(rid) for rid in request_ids]
            model_shares = [1.0 - self._free_share.get(rid, self._method_free_share) for rid in request_ids]
            charges = [self._onboarding_charge(tokens, rest, a, share) if tokens else 0.0
                       for tokens, rest, a, share in zip(onboarding, left, acceptance, model_shares, strict=True)]
            lengths = self._best_lengths(acceptance, charges, no_cost)
            if self._num_calls % self.probe_every == 0 and (self.target_cost.narrow or not any(lengths)):
                # A probe: without drafts, one each (acceptance is only learnt by verifying); with drafts on a
                # fit that has seen one row count only, half as many (another row count for the fit). A draft
                # model's probes go only to requests it holds (a first draft costs the prompt's prefill).
                lengths = [k // 2 for k in lengths] if any(lengths) else [
                    1 if not self.uses_model or f or rid in self._onboarded else 0
                    for rid, f in zip(request_ids, no_cost, strict=True)]
        self.last_mean_length = sum(lengths) / num if num else 0.0
        paid_lengths = [0 if f else k for k, f in zip(lengths, no_cost, strict=True)]
        self._predicted_draft_s = self._draft_seconds(_rows_at_depth(paid_lengths, self.max_tokens), scaled=False)
        self._free = {rid for rid, f in zip(request_ids, no_cost, strict=True) if f}
        self._onboarding = {rid: tokens for rid, tokens, k in zip(request_ids, onboarding, lengths, strict=True)
                            if k and tokens}
        return lengths

    def _could_pay(self, i: int, onboarding_tokens: int, remaining: int | None, free: list[bool]) -> bool:
        """Whether request ``i``'s drafts would pay, onboarding and all, were every one of them accepted: where
        not even that repays them (a long prompt to prefill in the draft, a batch whose rows cost compute),
        acceptance is not worth learning at that price."""
        acceptance = [0.0] * len(free)
        acceptance[i] = _MAX_ACCEPTANCE
        charges = [0.0] * len(free)
        if onboarding_tokens:
            charges[i] = self._onboarding_charge(onboarding_tokens, remaining, _MAX_ACCEPTANCE, 1.0)
        return self._best_lengths(acceptance, charges, free)[i] > 0

    def _prefill_seconds(self, tokens: int) -> float:
        """What the draft's catch-up of ``tokens`` tokens takes."""
        rate = self._prefill_s_per_token
        return tokens * rate if rate is not None else self.draft_cost.predict(tokens)

    def _onboarding_charge(self, tokens: int, remaining: int | None, acceptance: float, model_share: float) -> float:
        """A new request's prefill in the draft, spread over the steps it is expected to draft in with the
        model (``model_share`` of its steps: the others' drafts prompt lookup finds)."""
        mean = self._mean_output_tokens
        expected = mean if mean is not None else _PRIOR_OUTPUT_TOKENS
        if remaining is not None:
            expected = min(expected, remaining)
        tokens_per_step = 1.0 + sum(acceptance ** j for j in range(1, self.max_tokens + 1))
        model_steps = expected / tokens_per_step * max(model_share, _MIN_MODEL_SHARE)
        return self._prefill_seconds(tokens) * self.draft_scale / max(1.0, model_steps)

    def _draft_seconds(self, rows_at_depth: list[int], scaled: bool = True) -> float:
        if not self.uses_model:
            return 0.0
        seconds = sum(self.draft_cost.predict(rows) for rows in rows_at_depth if rows)
        return seconds * self.draft_scale if scaled else seconds

    def _best_lengths(self, acceptance: list[float], onboarding_charges: list[float], free: list[bool]) -> list[int]:
        num = len(acceptance)
        target = self.target_cost
        tokens = float(num)
        best_rate = tokens / max(target.predict(num), 1e-9)
        # Every draft by its expected worth, best first; a request's j-th draft comes after its (j-1)-th. A new
        # request's first draft is worth less by its onboarding charge in tokens of a plain step (and each later
        # draft of it no more than that): drafts that cannot repay it are left out. Free drafts (prompt lookup's,
        # a row of the target's forward each) come before any that costs the draft model a forward.
        candidates = []
        for i, a in enumerate(acceptance):
            rank = a - onboarding_charges[i] * best_rate
            for j in range(1, self.max_tokens + 1):
                rank = min(rank, a ** j)
                if rank <= 0:
                    break
                candidates.append((rank, a ** j, j, i))
        candidates.sort(key=lambda c: (not free[c[3]], -c[0], c[2]))
        rows_at_depth = [0] * (self.max_tokens + 1)
        best_count = 0
        onboarding_s = 0.0
        for count, (_, worth, depth, i) in enumerate(candidates, 1):
            tokens += worth
            rows_at_depth[depth] += not free[i]  # a free draft is a row of the target's forward only
            if depth == 1:
                onboarding_s += onboarding_charges[i]
            seconds = target.predict(num + count) + self._draft_seconds(rows_at_depth) + onboarding_s
            if seconds > 0 and tokens / seconds > best_rate:
                best_rate, best_count = tokens / seconds, count
        lengths = [0] * num
        for _, _, _, i in candidates[:best_count]:
            lengths[i] += 1
        return lengths


def _rows_at_depth(lengths: list[int], max_tokens: int) -> list[int]:
    """Rows of the draft's j-th forward (j = 1..max_tokens) for these draft lengths."""
    return [0] + [sum(1 for k in lengths if k >= j) for j in range(1, max_tokens + 1)]
