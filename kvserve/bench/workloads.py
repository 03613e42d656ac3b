"""Workloads: deterministic streams of sessions, each a sequence of turns sent one after another.

A *session* is what one user or agent does: an optional system prompt and one or more turns. Each turn
resends the whole conversation so far (system, every earlier message and reply) plus one new message;
the load generator appends the server's actual reply before sending the next turn. Single-turn
sessions are plain independent requests.

- ``agentic``: every session shares one long system prompt (instructions plus ~1,500 tokens of JSON tool
  schemas); turns alternate between a task and tool results. The shared prefix grows turn by turn.
- ``chat``: single-turn sessions with distinct system and user text: no two share a prefix block.
- ``long-context``: a few long documents, many independent questions about each, interleaved.
- ``mixed``: sessions of the above drawn with given weights.
- ``replay``: a Mooncake-format JSONL trace (``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids`` of 512-token blocks); equal hash ids get equal synthesised text.

Session ``k`` depends only on (seed, k), so a run is reproducible and a stream can be cut anywhere.
Lengths are in tokens, approximated by words of a list that tokenises at about one token per word;
the report uses the server's own token counts.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.errors import InvalidRequest

WORKLOADS = ("agentic", "chat", "mixed", "long-context", "replay")
MOONCAKE_BLOCK_TOKENS = 512

# Common English words that BPE vocabularies (Llama 3, Qwen, SmolLM2, DeepSeek) hold as one token
# with a leading space, so n words ≈ n tokens.
_WORDS = tuple("""
the of and to in is was for on are with as at be by this had not but from or have an they which one you
were her all she there would their we him been has when who will more no if out so said what up its about
into than them can only other new some could time these two may then do first any my now such like our
over man me even most made after also did many before must through years where much your way well
down should because each just those people how too little state good very make world still own see men
work long get here between both life being under never day same another know while last might us great
old year off come since against go came right used take three small house part place case point number
group problem fact hand high system order water city room money story month lot study book eye job word
business issue side kind head service friend father power hour game line end member law car name
president team minute idea body information back parent face others level office door health person art
war history party result change morning reason research girl guy moment air teacher force education
""".split())
TOKENS_PER_WORD = 1.0

_TASKS = (
    "Find every place the payment service retries a failed charge and summarise the retry policy.",
    "The nightly export job failed. Look at the logs, find the cause and propose a fix.",
    "Add a unit test for the date parser that covers leap years and time zones.",
    "Check whether the staging database has the new index on orders.customer_id and report its size.",
    "Draft an email to the team summarising this week's incidents from the on-call channel.",
    "Rename the config option max_conn to max_connections everywhere and update the docs.",
    "Compare the latency of the search endpoint before and after yesterday's deploy.",
    "Find the three largest files in the repository and say which ones can be deleted.",
)
_QUESTIONS = (
    "Summarise the main argument of the document in three sentences.",
    "Which sections mention a number, and what does each number measure?",
    "List every person or organisation named in the document.",
    "What is the single most surprising claim in the document, and why?",
    "Write five quiz questions about the document with their answers.",
    "Which parts of the document contradict each other?",
)


def _tool(name: str, description: str, properties: dict[str, dict[str, object]], required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


def _s(description: str, **extra: object) -> dict[str, object]:
    return {"type": "string", "description": description, **extra}


def _i(description: str, **extra: object) -> dict[str, object]:
    return {"type": "integer", "description": description, **extra}


TOOLS: tuple[dict, ...] = (
    _tool("read_file", "Read a text file from the workspace. Returns the content with line numbers.",
          {"path": _s("Path relative to the workspace root."),
           "start_line": _i("First line to return, 1-based.", minimum=1),
           "end_line": _i("Last line to return, inclusive; omit for the end of the file.")}, ["path"]),
    _tool("write_file", "Create or overwrite a file in the workspace with the given content.",
          {"path": _s("Path relative to the workspace root."), "content": _s("The full new content."),
           "create_dirs": {"type": "boolean", "description": "Create missing parent directories.",
                           "default": True}}, ["path", "content"]),
    _tool("edit_file", "Replace one exact occurrence of a string in a file. Fails if it is absent or not unique.",
          {"path": _s("Path relative to the workspace root."), "old": _s("Exact text to replace."),
           "new": _s("Replacement text.")}, ["path", "old", "new"]),
    _tool("search_code", "Search the repository with a regular expression; returns matching lines with paths.",
          {"pattern": _s("A regular expression (RE2 syntax)."),
           "glob": _s("Only search files matching this glob, e.g. 'src/**/*.py'."),
           "max_results": _i("Stop after this many matches.", minimum=1, maximum=500, default=50),
           "case_sensitive": {"type": "boolean", "default": False}}, ["pattern"]),
    _tool("run_shell", "Run a shell command in the sandbox and return its exit code, stdout and stderr.",
          {"command": _s("The command line, run with bash -lc."),
           "timeout_s": _i("Kill the command after this many seconds.", minimum=1, maximum=600, default=60),
           "cwd": _s("Working directory relative to the workspace root.")}, ["command"]),
    _tool("http_request", "Send an HTTP request to an allow-listed internal service.",
          {"method": _s("HTTP method.", enum=["GET", "POST", "PUT", "PATCH", "DELETE"]),
           "url": _s("Absolute URL."), "headers": {"type": "object", "additionalProperties": {"type": "string"}},
           "body": _s("Request body; JSON is sent as application/json.")}, ["method", "url"]),
    _tool("query_database", "Run a read-only SQL query against the analytics replica.",
          {"sql": _s("A single SELECT statement."), "database": _s("Database name.", enum=["orders", "users",
                                                                                       "events", "billing"]),
           "limit": _i("Maximum rows returned.", minimum=1, maximum=10000, default=100)}, ["sql", "database"]),
    _tool("search_logs", "Search structured service logs in a time window.",
          {"service": _s("Service name, e.g. 'payments-api'."), "query": _s("Lucene query over log fields."),
           "start": _s("ISO 8601 start time.", format="date-time"),
           "end": _s("ISO 8601 end time.", format="date-time"),
           "level": _s("Minimum level.", enum=["debug", "info", "warning", "error"])},
          ["service", "query", "start"]),
    _tool("get_metrics", "Fetch a time series from the metrics store.",
          {"metric": _s("Metric name, e.g. 'http_request_duration_seconds'."),
           "labels": {"type": "object", "additionalProperties": {"type": "string"}},
           "aggregation": _s("Aggregation over the step.", enum=["avg", "p50", "p90", "p99", "max", "sum"]),
           "step_s": _i("Resolution in seconds.", minimum=10, default=60),
           "range": _s("Look-back window, e.g. '6h' or '2d'.")}, ["metric", "range"]),
)

AGENT_INSTRUCTIONS = (
    "You are an autonomous software engineering agent working in a company's monorepo and infrastructure. "
    "Use the tools below to gather facts before you answer; never guess file contents or metric values. "
    "To call a tool, reply with a JSON object {\"tool\": NAME, \"arguments\": {...}} and nothing else. "
    "After each tool result, decide whether you need another call or can give the final answer. "
    "Keep final answers short, cite file paths and line numbers, and say what you did not verify.\n\n"
    "Available tools (JSON schema, one per line):\n"
)


def agent_system_prompt() -> str:
    """The shared agentic system prompt: instructions plus the tool schemas (~1,500 tokens on Llama/SmolLM2)."""
    return AGENT_INSTRUCTIONS + "\n".join(json.dumps(tool) for tool in TOOLS)


# --------------------------------------------------------------------------------------------------
# Sessions
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Turn:
    message: str
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Session:
    """One user's or agent's sequence of turns. ``arrival_s``: when a trace says it starts (replay only)."""

    session_id: int
    kind: str
    system: str | None
    turns: tuple[Turn, ...]
    arrival_s: float | None = None


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    name: str = "chat"
    seed: int = 0
    input_len: int = 128  # chat prompt; agentic new message per turn
    output_len: int = 64  # max_tokens of every turn (replay: the trace's own output_length)
    turns: int = 4  # agentic turns per session
    num_docs: int = 2  # long-context documents per group
    doc_len: int = 2000  # long-context document length
    questions_per_doc: int = 8
    mix: tuple[tuple[str, float], ...] = (("agentic", 0.5), ("chat", 0.5))
    trace: str | None = None
    time_scale: float = 1.0  # replay: multiply trace timestamps by this
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise InvalidRequest(f"unknown workload {self.name!r}; expected one of {', '.join(WORKLOADS)}", "workload")
        if self.name == "replay" and not self.trace:
            raise InvalidRequest("the replay workload needs a trace file", "workload")
        for label, value in (("input_len", self.input_len), ("output_len", self.output_len), ("turns", self.turns),
                             ("num_docs", self.num_docs), ("doc_len", self.doc_len),
                             ("questions_per_doc", self.questions_per_doc)):
            if value < 1:
                raise InvalidRequest(f"{label} must be >= 1, got {value}", label)
        for kind, weight in self.mix:
            if kind not in ("agentic", "chat", "long-context") or weight < 0:
                raise InvalidRequest(f"bad mix entry {kind}={weight}", "mix")
        if self.name == "mixed" and sum(w for _, w in self.mix) <= 0:
            raise InvalidRequest("the mix weights sum to zero", "mix")


def parse_mix(text: str) -> tuple[tuple[str, float], ...]:
    """``"agentic=0.7,chat=0.3"`` → ``(("agentic", 0.7), ("chat", 0.3))``."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, _, weight = part.partition("=")
        try:
            out.append((kind.strip(), float(weight)))
        except ValueError:
            raise InvalidRequest(f"bad mix entry {part!r}; expected KIND=WEIGHT", "mix") from None
    return tuple(out)


def words(rng: random.Random, num_tokens: int) -> str:
    n = max(1, round(num_tokens / TOKENS_PER_WORD))
    return " ".join(rng.choices(_WORDS, k=n))


def _rng(seed: int, *key: object) -> random.Random:
    # str seeds go through SHA-512 in random.seed: stable across runs and Python versions.
    return random.Random(":".join(str(k) for k in (seed, *key)))


class Workload:
    """A deterministic stream of sessions for one ``WorkloadConfig``."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self._agent_system = agent_system_prompt()
        self._trace: list[dict] | None = load_trace(Path(config.trace)) if config.name == "replay" else None

    @property
    def finite_size(self) -> int | None:
        """Number of requests when the stream is finite (a trace), else None."""
        return len(self._trace) if self._trace is not None else None

    def mean_turns(self) -> float:
        c = self.config
        if c.name == "agentic":
            return float(c.turns)
        if c.name == "mixed":
            total = sum(w for _, w in c.mix)
            return sum(w * (c.turns if k == "agentic" else 1) for k, w in c.mix) / total
        return 1.0

    def sessions(self) -> Iterator[Session]:
        if self._trace is not None:
            yield from (self._replay_session(k, rec) for k, rec in enumerate(self._trace))
            return
        for k in itertools.count():
            yield self.session(k)

    def session(self, k: int) -> Session:
        c = self.config
        kind = c.name
        if kind == "mixed":
            kinds, weights = zip(*c.mix, strict=True)
            kind = _rng(c.seed, "mix", k).choices(kinds, weights=weights)[0]
        if kind == "agentic":
            return self._agentic(k)
        if kind == "long-context":
            return self._long_context(k)
        if kind == "replay":
            assert self._trace is not None
            return self._replay_session(k, self._trace[k])
        return self._chat(k)

    def _agentic(self, k: int) -> Session:
        c = self.config
        rng = _rng(c.seed, "agentic", k)
        turns = [Turn(f"Task {k}: {rng.choice(_TASKS)} Context: {words(rng, c.input_len)}", c.output_len)]
        for t in range(1, c.turns):
            tool = rng.choice(TOOLS)["function"]["name"]
            result = json.dumps({"tool": tool, "call_id": f"call_{k}_{t}", "ok": True,
                                 "output": words(rng, c.input_len)})
            turns.append(Turn(f"Tool result: {result}", c.output_len))
        return Session(k, "agentic", self._agent_system, tuple(turns))

    def _chat(self, k: int) -> Session:
        c = self.config
        rng = _rng(c.seed, "chat", k)
        # A distinct system line per request: templates insert a default system prompt otherwise, which
        # every request would share.
        system = f"{words(rng, 3).capitalize()} assistant {k}."
        return Session(k, "chat", system, (Turn(words(rng, c.input_len), c.output_len),))

    def _long_context(self, k: int) -> Session:
        c = self.config
        group_size = c.num_docs * c.questions_per_doc
        group, index = divmod(k, group_size)
        order = list(range(group_size))
        _rng(c.seed, "long-order", group).shuffle(order)  # interleave questions across the group's documents
        doc_id = group * c.num_docs + order[index] // c.questions_per_doc
        document = words(_rng(c.seed, "doc", doc_id), c.doc_len)
        rng = _rng(c.seed, "question", k)
        question = f"{rng.choice(_QUESTIONS)} (question {k})"
        return Session(k, "long-context", "Answer questions about the document.",
                       (Turn(f"Document {doc_id}:\n{document}\n\nQuestion: {question}", c.output_len),))

    def _replay_session(self, k: int, record: dict) -> Session:
        c = self.config
        text = replay_prompt(record["hash_ids"], record["input_length"], c.seed, c.block_tokens)
        arrival = record["timestamp"] / 1000.0 * c.time_scale
        return Session(k, "replay", None, (Turn(text, max(1, record["output_length"])),), arrival_s=arrival)


def replay_prompt(hash_ids: list[int], input_length: int, seed: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> str:
    """Text whose i-th block of ``block_tokens`` words depends only on ``hash_ids[i]``.

    Equal hash-id prefixes give equal text prefixes and so (at word boundaries) equal token prefixes. The
    last block is cut to make ``input_length`` tokens in all.
    """
    if not hash_ids:
        return words(_rng(seed, "replay-tail", input_length), input_length)
    parts = []
    remaining = input_length
    for h in hash_ids:
        n = min(block_tokens, remaining)
        if n <= 0:
            break
        block = _rng(seed, "block", h).choices(_WORDS, k=block_tokens)
        parts.append(" ".join(block[:n]))
        remaining -= n
    return " ".join(parts)


def load_trace(path: Path) -> list[dict]:
    """Read a Mooncake-format JSONL trace; check each record's fields."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidRequest(f"cannot read trace {path}: {exc}", "trace") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            records.append({"timestamp": float(rec["timestamp"]), "input_length": int(rec["input_length"]),
                            "output_length": int(rec["output_length"]),
                            "hash_ids": [int(h) for h in rec.get("hash_ids", [])]})
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidRequest(f"{path}:{number}: bad trace record ({exc})", "trace") from None
    records.sort(key=lambda r: r["timestamp"])
    return records


# --------------------------------------------------------------------------------------------------
# Arrivals
# --------------------------------------------------------------------------------------------------


def poisson_arrivals(rate: float, seed: int) -> Iterator[float]:
    """Arrival times (seconds from 0) of a Poisson process: exponential gaps of mean 1/rate."""
    if rate <= 0 or math.isinf(rate):
        while True:
            yield 0.0
    rng = _rng(seed, "arrivals")
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        yield t


@dataclass(slots=True)
class Conversation:
    """The messages of one session so far; the runner appends replies."""

    system: str | None
    messages: list[dict[str, str]] = field(default_factory=list)

    def with_turn(self, message: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages + [{"role": "user", "content": message}]

    def append(self, message: str, reply: str) -> None:
        self.messages.append({"role": "user", "content": message})
        self.messages.append({"role": "assistant", "content": reply})


def render_plain(messages: list[dict[str, str]]) -> str:
    """A conversation as one prompt for the completions endpoint (no chat template)."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(lines) + "\n\nAssistant:"
