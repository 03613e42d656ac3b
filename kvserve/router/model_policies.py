"""Routing by difficulty: which of two models answers a request for the auto model.

Each policy trades quality for the share of requests the large model answers through one threshold:

- ``random``: a share ``threshold`` of requests to the large model, at random (the baseline to beat).
- ``length``: prompts longer than ``threshold`` tokens to the large model.
- ``cascade``: the small model answers first; when its answer's confidence (``CascadeSignal``: mean or minimum
  token logprob, or minus the mean entropy of its top logprobs) is below ``threshold``, the large model
  answers instead, and the small model's tokens are part of the cost.
- ``probe``: a logistic classifier on the small model's hidden state at the prompt's last token gives the
  probability that the small model fails; at ``threshold`` or above the large model answers.
- ``gain``: two such classifiers, of the small model's failure and of the large model's, give the expected gain
  of the large model's answer, P(small fails) - P(large fails); at ``threshold`` or above the large model
  answers. Unlike ``probe`` it leaves to the small model the prompts too hard for both.
- ``oracle``, for evaluation only: the large model exactly when the small one fails and the large one does not.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

import numpy as np

from kvserve.errors import ConfigError
from kvserve.serving_config import CascadeSignal, ModelPolicyName, RouterConfig

Size = Literal["small", "large"]

DEFAULT_THRESHOLDS: dict[ModelPolicyName, float] = {"random": 0.5, "length": 256, "cascade": -0.14, "probe": 0.5,
                                                     "gain": 0.15}


@dataclass(frozen=True, slots=True)
class Difficulty:
    """What a policy may know of a request before any model answers it."""

    prompt_tokens: int
    hidden_state: tuple[float, ...] | None = None  # the small model's, at the prompt's last token (probe only)


@dataclass(frozen=True, slots=True)
class ModelChoice:
    size: Size
    reason: str  # a label of the gateway's model-routing metric
    score: float | None = None  # what the threshold was compared with


class ModelPolicy(Protocol):
    name: ModelPolicyName
    threshold: float
    cascades: bool  # the small model answers first and ``accepts`` decides whether its answer stands
    needs_hidden_state: bool

    def choose(self, difficulty: Difficulty) -> ModelChoice: ...

    def accepts(self, confidence: float | None) -> bool: ...


class _Upfront:
    """A policy that decides before any model answers."""

    cascades = False
    needs_hidden_state = False

    def accepts(self, confidence: float | None) -> bool:
        return True


class RandomRoute(_Upfront):
    name: ModelPolicyName = "random"

    def __init__(self, threshold: float, seed: int = 0) -> None:
        self.threshold = threshold
        self._rng = random.Random(seed)

    def choose(self, difficulty: Difficulty) -> ModelChoice:
        draw = self._rng.random()
        return ModelChoice("large" if draw < self.threshold else "small", "random", draw)


class LengthRoute(_Upfront):
    name: ModelPolicyName = "length"

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def choose(self, difficulty: Difficulty) -> ModelChoice:
        long = difficulty.prompt_tokens > self.threshold
        return ModelChoice("large" if long else "small", "long_prompt" if long else "short_prompt",
                           float(difficulty.prompt_tokens))


class CascadeRoute:
    name: ModelPolicyName = "cascade"
    cascades = True
    needs_hidden_state = False

    def __init__(self, threshold: float, signal: CascadeSignal = "mean_logprob") -> None:
        self.threshold = threshold
        self.signal = signal

    def choose(self, difficulty: Difficulty) -> ModelChoice:
        return ModelChoice("small", "cascade_first")

    def accepts(self, confidence: float | None) -> bool:
        """Whether the small model's answer stands; one without logprobs (an error, no tokens) escalates."""
        return confidence is not None and confidence >= self.threshold


class ProbeRoute(_Upfront):
    """``probe`` (a LogisticProbe's P(small fails)) or ``gain`` (a GainProbe's expected gain): the large model
    at ``threshold`` or above."""

    needs_hidden_state = True

    def __init__(self, probe: LogisticProbe | GainProbe, threshold: float) -> None:
        self.name: ModelPolicyName = "gain" if isinstance(probe, GainProbe) else "probe"
        self.probe = probe
        self.threshold = threshold

    def choose(self, difficulty: Difficulty) -> ModelChoice:
        if difficulty.hidden_state is None or len(difficulty.hidden_state) != self.probe.width:
            return ModelChoice("large", "probe_unavailable")  # the small model could not say: the safe side
        score = self.probe.predict(np.asarray(difficulty.hidden_state, dtype=np.float64))
        return ModelChoice("large" if score >= self.threshold else "small", self.name, score)


def oracle_size(small_passed: bool, large_passed: bool) -> Size:
    """The best possible router's choice, given both models' results (evaluation only)."""
    return "large" if large_passed and not small_passed else "small"


def make_model_policy(config: RouterConfig) -> ModelPolicy | None:
    if config.model_policy is None:
        return None
    threshold = config.route_threshold if config.route_threshold is not None \
        else DEFAULT_THRESHOLDS[config.model_policy]
    if config.model_policy == "random":
        return RandomRoute(threshold, config.route_seed)
    if config.model_policy == "length":
        return LengthRoute(threshold)
    if config.model_policy == "cascade":
        return CascadeRoute(threshold, config.cascade_signal)
    assert config.probe_path is not None
    probe = load_probe(config.probe_path)
    if (config.model_policy == "gain") != isinstance(probe, GainProbe):
        wanted = "a gain probe (eval train-probe with the large model's runs)" if config.model_policy == "gain" \
            else "a probe of the small model's failure (eval train-probe without the large model's runs)"
        raise ConfigError(f"--model-policy {config.model_policy} needs {wanted}; {config.probe_path} is not one",
                          "probe_path")
    return ProbeRoute(probe, threshold)


# --- confidence of an answer ---------------------------------------------------------------------------------
def token_logprobs(choice: dict[str, Any]) -> list[tuple[float, list[float]]]:
    """Each generated token's logprob and its top logprobs, from a chat or a completions choice."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return []
    if isinstance(logprobs.get("content"), list):  # chat
        return [(float(t["logprob"]), [float(top["logprob"]) for top in t.get("top_logprobs") or []])
                for t in logprobs["content"] if isinstance(t, dict) and t.get("logprob") is not None]
    tokens = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    return [(float(lp), [float(v) for v in (top or {}).values()])
            for lp, top in zip(tokens, tops, strict=False) if lp is not None]


def confidence(choices: list[dict[str, Any]], signal: CascadeSignal) -> float | None:
    """The answer's confidence by ``signal`` (higher: more confident), over all its choices' tokens; None
    when it has no logprobs."""
    tokens = [t for choice in choices for t in token_logprobs(choice)]
    if not tokens:
        return None
    if signal == "mean_logprob":
        return sum(lp for lp, _ in tokens) / len(tokens)
    if signal == "min_logprob":
        return min(lp for lp, _ in tokens)
    entropies = [top_entropy(top) for _, top in tokens if top]
    return -sum(entropies) / len(entropies) if entropies else None


def top_entropy(top_logprobs: list[float]) -> float:
    """Entropy of the distribution over the top tokens, renormalised."""
    probs = [math.exp(v) for v in top_logprobs]
    total = sum(probs)
    return -sum(p / total * math.log(p / total) for p in probs if p > 0)


# --- the probe -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LogisticProbe:
    """P(the small model fails) = sigmoid(weights . (x - mean) / scale + bias), x a hidden state of ``model``."""

    model: str
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    weights: tuple[float, ...]
    bias: float
    l2: float

    @property
    def width(self) -> int:
        return len(self.weights)

    def predict(self, x: np.ndarray) -> float:
        if x.shape != (len(self.weights),):
            raise ValueError(f"the probe takes {len(self.weights)} features, got {x.shape}")
        z = (x - np.asarray(self.mean)) / np.asarray(self.scale)
        return float(1.0 / (1.0 + math.exp(-(float(z @ np.asarray(self.weights)) + self.bias))))

    @classmethod
    def fit(cls, model: str, features: np.ndarray, labels: np.ndarray, l2: float = 1.0,
            iterations: int = 50) -> LogisticProbe:
        """L2-regularised logistic regression by Newton's method on standardised features."""
        mean = features.mean(axis=0)
        scale = features.std(axis=0) + 1e-6
        z = (features - mean) / scale
        x = np.hstack([z, np.ones((len(z), 1))])
        w = np.zeros(x.shape[1])
        penalty = np.full(x.shape[1], l2)
        penalty[-1] = 0.0  # the bias is not shrunk
        for _ in range(iterations):
            p = 1.0 / (1.0 + np.exp(-(x @ w)))
            gradient = x.T @ (p - labels) + penalty * w
            hessian = (x * (p * (1 - p))[:, None]).T @ x + np.diag(penalty + 1e-9)
            step = np.linalg.solve(hessian, gradient)
            w -= step
            if np.abs(step).max() < 1e-8:
                break
        return cls(model, tuple(mean.tolist()), tuple(scale.tolist()), tuple(w[:-1].tolist()), float(w[-1]), l2)

    def save(self, path: str) -> None:
        _write(path, self.as_json())

    def as_json(self) -> dict[str, Any]:
        return {"kind": "logistic_probe", "feature": "last_token_hidden_state", **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LogisticProbe:
        probe = cls(data["model"], tuple(data["mean"]), tuple(data["scale"]), tuple(data["weights"]),
                    float(data["bias"]), float(data["l2"]))
        if not len(probe.mean) == len(probe.scale) == len(probe.weights):
            raise ValueError("its features have different lengths")
        return probe

    @classmethod
    def load(cls, path: str) -> LogisticProbe:
        probe = load_probe(path)
        if not isinstance(probe, LogisticProbe):
            raise ConfigError(f"{path} is a gain probe, not a probe of one model's failure", "probe_path")
        return probe


@dataclass(frozen=True)
class GainProbe:
    """The expected gain of the large model's answer over the small one's: P(small fails) - P(large fails), two
    logistic probes on the same hidden state of the small model ``small_fails.model``."""

    small_fails: LogisticProbe
    large_fails: LogisticProbe

    def __post_init__(self) -> None:
        if (self.small_fails.model, self.small_fails.width) != (self.large_fails.model, self.large_fails.width):
            raise ValueError("its two probes read different hidden states")

    @property
    def model(self) -> str:
        return self.small_fails.model

    @property
    def width(self) -> int:
        return self.small_fails.width

    def predict(self, x: np.ndarray) -> float:
        return self.small_fails.predict(x) - self.large_fails.predict(x)

    def save(self, path: str) -> None:
        _write(path, {"kind": "gain_probe", "small_fails": self.small_fails.as_json(),
                      "large_fails": self.large_fails.as_json()})


def load_probe(path: str) -> LogisticProbe | GainProbe:
    """A probe file of ``kvserve eval train-probe``: a LogisticProbe or a GainProbe, by its kind."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("kind") not in ("logistic_probe", "gain_probe"):
            raise ValueError("not a kvserve probe file")
        if data["kind"] == "logistic_probe":
            return LogisticProbe.from_json(data)
        return GainProbe(LogisticProbe.from_json(data["small_fails"]), LogisticProbe.from_json(data["large_fails"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read the probe {path}: {exc}", "probe_path") from None


def _write(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
