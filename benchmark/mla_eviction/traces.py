"""Request traces for the prefix-cache replay benchmark.

A trace is a list of requests; each request names its prompt's blocks by id,
``block_size`` tokens per block, the last one partial. Equal ids mean equal prompt
content up to and including that block, so every id has exactly one predecessor and the
ids form a tree (the Mooncake format):

    request A: [0, 1, 2]          0 ── 1 ── 2
    request B: [0, 1, 3, 4]              └── 3 ── 4

Two sources:

- ``load_mooncake_trace``: a JSON-lines file in the Mooncake format, checked line by
  line.
- ``generate_workload``: synthetic workloads (``WORKLOADS``), deterministic from a seed.
  Prompts are built from content segments; a block's id is a function of its parent's id
  and the segments it covers, so shared content gets shared ids and a partial last block
  gets a new id once the prompt grows past it, exactly as in Mooncake.

Block ids in a ``Trace`` are dense: small integers ``0, 1, 2, ...`` (below ``ID_LIMIT``
= 2**40), so they fit any int64 array. The loader maps a file's ids, which may be any
JSON integer, to dense ids in order of first appearance; equal ids stay equal, distinct
ids distinct.

``scale_trace`` tiles a trace to make a larger one with the same shape;
``jitter_arrivals`` moves each arrival by a seeded random offset, to measure run-to-run
spread.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np

__all__ = [
    "ID_LIMIT",
    "MAX_LENGTH_TOKENS",
    "MAX_TIMESTAMP_MS",
    "Request",
    "Trace",
    "TraceError",
    "WORKLOADS",
    "Workload",
    "generate_workload",
    "jitter_arrivals",
    "load_mooncake_trace",
    "scale_trace",
]


# Every block id in a Trace is in [0, ID_LIMIT).
ID_LIMIT = 2**40
# The largest input_length / output_length (tokens) a trace file may give.
MAX_LENGTH_TOKENS = 10_000_000
# The largest timestamp (ms) a trace file may give: about 31 years.
MAX_TIMESTAMP_MS = 1e12


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace.

    ``hash_ids`` and ``sequence_hash_ids`` are dense block ids: integers in
    ``[0, ID_LIMIT)``, ID_LIMIT = 2**40, numbered from 0 in order of first appearance
    for loaded and generated traces, so they fit an int64 array without aliasing.
    Equal ids mean equal content up to and including that block.
    """

    timestamp_s: float  # arrival, seconds from trace start
    input_length: int  # prompt tokens
    output_length: int  # output tokens
    # prefix block ids, block_size tokens each, last one partial
    hash_ids: tuple[int, ...]
    session_id: Optional[str] = None  # conversation id when the trace has one
    # Block ids of prompt + output, where the output's content is known because a later
    # prompt includes it (generated multi-turn workloads); empty when it is unknown.
    sequence_hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Trace:
    """A named, arrival-ordered tuple of requests with ``block_size`` tokens per block.

    Every block id (``Request.hash_ids``, ``Request.sequence_hash_ids``) is a dense id
    in ``[0, ID_LIMIT)``: 0, 1, 2, ... in order of first appearance for loaded and
    generated traces, ``k * D + id`` in copy k of ``scale_trace`` (D distinct ids per
    copy).
    """

    name: str
    block_size: int
    requests: tuple[Request, ...]

    def num_blocks(self) -> int:
        """Prompt blocks over all requests, counting repeats."""
        return sum(len(r.hash_ids) for r in self.requests)

    def num_unique_blocks(self) -> int:
        """Distinct block ids in the trace."""
        return len({h for r in self.requests for h in r.hash_ids})


class TraceError(ValueError):
    """A trace file that cannot be read. The message is
    ``FILE:LINE: field 'X': what is wrong``; ``FILE:LINE: what is wrong`` for a line
    that is not a JSON object; ``FILE: what is wrong`` for a missing or empty file."""


# --------------------------------------------------------------------------------------
# Loader
# --------------------------------------------------------------------------------------

_JSON_TYPE = {
    bool: "a boolean",
    int: "an integer",
    float: "a float",
    str: "a string",
    list: "a list",
    dict: "an object",
    type(None): "null",
}


def _json_type(value: Any) -> str:
    """'a boolean (true)': the JSON type and text of a parsed value."""
    text = json.dumps(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{_JSON_TYPE.get(type(value), type(value).__name__)} ({text})"


def load_mooncake_trace(
    path: Union[str, Path], block_size: int = 512, limit: Optional[int] = None
) -> Trace:
    """Read a Mooncake JSON-lines trace, one request per non-blank line.

    Each line is an object with ``timestamp`` (ms, int or float), ``input_length``,
    ``output_length`` and ``hash_ids`` (ints); other fields are ignored, except that a
    ``session_id`` / ``chat_id`` / ``conversation_id`` becomes ``Request.session_id``.
    Reads at most ``limit`` requests (all when None); lines after the limit are not
    read.

    The file's ids may be any JSON integers (any size); each distinct one becomes a
    dense id 0, 1, 2, ... in order of first appearance, so ``Request.hash_ids`` are <
    2**40. Error messages name the file's own ids.

    Raises TraceError ("FILE:LINE: field 'X': ...") for a missing file, malformed JSON,
    a missing field, a wrong type (a boolean is not an integer), a negative length or
    timestamp, a length above ``MAX_LENGTH_TOKENS`` (10,000,000), a timestamp that is
    not finite or above ``MAX_TIMESTAMP_MS`` (1e12), a timestamp earlier than the
    previous one, more than ``ceil(MAX_LENGTH_TOKENS / block_size)`` ids,
    ``len(hash_ids) != ceil(input_length / block_size)``, an id whose predecessor
    differs from an earlier line's, or a file with no requests. Raises ValueError for
    ``block_size < 1`` or ``limit < 1``.
    """
    if type(block_size) is not int or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if limit is not None and (type(limit) is not int or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    path = Path(path)
    try:
        file = open(path, "rb")
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror}") from None

    parser = _LineParser(str(path), block_size)
    requests: list[Request] = []
    with file:
        for lineno, line in enumerate(file, 1):
            line = line.strip()
            if line:
                requests.append(parser.request(line, lineno))
                if len(requests) == limit:
                    break
    if not requests:
        raise TraceError(f"{path}: empty trace (no requests)")
    return Trace(name=path.stem, block_size=block_size, requests=tuple(requests))


class _LineParser:
    """Checks one line at a time; remembers what the checks across lines need."""

    _SESSION_FIELDS = ("session_id", "chat_id", "conversation_id")

    def __init__(self, path: str, block_size: int):
        self.path = path
        self.block_size = block_size
        self.max_ids = -(-MAX_LENGTH_TOKENS // block_size)
        self.prev_ms: Optional[float] = None
        self.prev_line = 0
        # file id -> (its predecessor's file id, first line, dense id)
        self.blocks: dict[int, tuple[Optional[int], int, int]] = {}

    def fail(self, lineno: int, field: Optional[str], what: str) -> TraceError:
        where = f"{self.path}:{lineno}: "
        return TraceError(where + (f"field {field!r}: {what}" if field else what))

    def request(self, line: bytes, lineno: int) -> Request:
        """The request on ``line`` (stripped, not blank), or TraceError."""
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise self.fail(lineno, None, f"not UTF-8: byte {e.start + 1}") from None
        except json.JSONDecodeError as e:
            raise self.fail(
                lineno, None, f"malformed JSON: {e.msg} at column {e.pos + 1}"
            ) from None
        except ValueError as e:  # e.g. an integer of more than 4300 digits
            raise self.fail(lineno, None, f"cannot parse: {e}") from None
        if type(obj) is not dict:
            raise self.fail(
                lineno, None, f"expected a JSON object, got {_json_type(obj)}"
            )

        ms = self.field(obj, "timestamp", lineno, (int, float), "a number")
        if type(ms) is float and not math.isfinite(ms):  # 1e400, Infinity, NaN
            raise self.fail(lineno, "timestamp", f"must be finite, got {ms}")
        if ms < 0:
            raise self.fail(lineno, "timestamp", f"must be >= 0, got {_show(ms)}")
        if ms > MAX_TIMESTAMP_MS:  # exact for ints of any size
            raise self.fail(
                lineno,
                "timestamp",
                f"must be <= {int(MAX_TIMESTAMP_MS)} ms, got {_show(ms)}",
            )
        if self.prev_ms is not None and ms < self.prev_ms:
            raise self.fail(
                lineno,
                "timestamp",
                f"{ms} is earlier than {self.prev_ms} "
                f"on line {self.prev_line}; timestamps must not decrease",
            )
        self.prev_ms, self.prev_line = ms, lineno
        input_length = self.length(obj, "input_length", lineno)
        output_length = self.length(obj, "output_length", lineno)
        hash_ids = self.field(obj, "hash_ids", lineno, (list,), "a list of integers")
        if len(hash_ids) > self.max_ids:
            raise self.fail(
                lineno,
                "hash_ids",
                f"has {len(hash_ids)} ids, more than "
                f"ceil({MAX_LENGTH_TOKENS} / {self.block_size}) = {self.max_ids}",
            )
        need = -(-input_length // self.block_size)
        if len(hash_ids) != need:
            raise self.fail(
                lineno,
                "hash_ids",
                f"has {len(hash_ids)} ids, but input_length "
                f"{input_length} needs ceil({input_length} / {self.block_size})"
                f" = {need}",
            )
        dense = self.dense_ids(hash_ids, lineno)
        session = next(
            (obj[k] for k in self._SESSION_FIELDS if obj.get(k) is not None), None
        )
        return Request(
            ms / 1000.0,
            input_length,
            output_length,
            dense,
            None if session is None else str(session),
        )

    def field(
        self, obj: dict, name: str, lineno: int, types: tuple[type, ...], expected: str
    ) -> Any:
        if name not in obj:
            raise self.fail(lineno, name, "missing")
        value = obj[name]
        if type(value) not in types:
            raise self.fail(
                lineno, name, f"expected {expected}, got {_json_type(value)}"
            )
        return value

    def length(self, obj: dict, name: str, lineno: int) -> int:
        value = self.field(obj, name, lineno, (int,), "an integer")
        if value < 0:
            raise self.fail(lineno, name, f"must be >= 0, got {_show(value)}")
        if value > MAX_LENGTH_TOKENS:
            raise self.fail(
                lineno,
                name,
                f"must be <= {MAX_LENGTH_TOKENS} tokens, got {_show(value)}",
            )
        return value

    def dense_ids(self, hash_ids: list, lineno: int) -> tuple[int, ...]:
        """The dense ids of a line's file ids; checks that each file id keeps its
        predecessor (the tree check, on file ids, which is the same as on dense ids)."""
        blocks = self.blocks
        dense: list[int] = []
        pred = None
        for pos, h in enumerate(hash_ids):
            if type(h) is not int:
                raise self.fail(
                    lineno,
                    "hash_ids",
                    f"element {pos} is {_json_type(h)}, expected an integer",
                )
            seen = blocks.get(h)
            if seen is None:
                seen = blocks[h] = (pred, lineno, len(blocks))
            elif seen[0] != pred:
                raise self.fail(
                    lineno,
                    "hash_ids",
                    f"id {h} at position {pos} follows "
                    f"{_after(pred)}, but on line {seen[1]} it follows "
                    f"{_after(seen[0])}; ids must form a tree",
                )
            dense.append(seen[2])
            pred = h
        return tuple(dense)


def _after(pred: Optional[int]) -> str:
    return "nothing (it is a first block)" if pred is None else f"id {pred}"


def _show(number: Union[int, float]) -> str:
    """A number's text, cut to 40 characters."""
    text = str(number)
    return text if len(text) <= 40 else text[:37] + "..."


# --------------------------------------------------------------------------------------
# Synthetic workloads
# --------------------------------------------------------------------------------------

_Segment = tuple[int, int]  # (content id, tokens); equal content ids mean equal tokens


class _Draft(NamedTuple):
    arrival_s: float
    segments: tuple[_Segment, ...]  # the prompt, in order
    output_length: int
    session_id: Optional[str]
    output_id: Optional[int] = (
        None  # content id of the output when a later prompt holds it
    )


class _BlockIds:
    """Content-addressed block ids, numbered in order of first use.

    A block's key is (parent id, the (content, start, end) pieces it covers), so two
    prompts get the same id for a block exactly when their content up to the end of that
    block is equal."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.ids: dict[tuple, int] = {}

    def of(self, segments: Sequence[_Segment]) -> tuple[int, ...]:
        ids = self.ids
        out: list[int] = []
        parent: Optional[int] = None
        pieces: list[tuple[int, int, int]] = []
        room = self.block_size
        for content, length in segments:
            start = 0
            while start < length:
                take = min(room, length - start)
                pieces.append((content, start, start + take))
                start += take
                room -= take
                if room == 0:
                    parent = ids.setdefault((parent, tuple(pieces)), len(ids))
                    out.append(parent)
                    pieces.clear()
                    room = self.block_size
        if pieces:
            out.append(ids.setdefault((parent, tuple(pieces)), len(ids)))
        return tuple(out)


def _arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """Poisson arrival times in seconds, the first at 0."""
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def _zipf(k: int, alpha: float) -> np.ndarray:
    """p(rank) proportional to 1 / rank**alpha, rank 1..k; alpha 0 is uniform."""
    weights = 1.0 / np.arange(1, k + 1, dtype=np.float64) ** alpha
    return weights / weights.sum()


def _draw(rng: np.random.Generator, span: tuple[int, int], size: Optional[int] = None):
    return rng.integers(span[0], span[1] + 1, size=size)


def _shared_prefix(
    rng, n, fresh, *, rate, num_prefixes, prefix_len, suffix_len, output_len, zipf_alpha
) -> list[_Draft]:
    """Each request: one of a few shared prefixes (zipf popularity) + unique suffix."""
    prefix_ids = [next(fresh) for _ in range(num_prefixes)]
    prefix_lens = _draw(rng, prefix_len, num_prefixes)
    choice = rng.choice(num_prefixes, size=n, p=_zipf(num_prefixes, zipf_alpha))
    suffix_lens = _draw(rng, suffix_len, n)
    output_lens = _draw(rng, output_len, n)
    drafts = []
    for t, c, s, o in zip(_arrivals(rng, n, rate), choice, suffix_lens, output_lens):
        segments = ((prefix_ids[c], int(prefix_lens[c])), (next(fresh), int(s)))
        drafts.append(_Draft(float(t), segments, int(o), None))
    return drafts


def _chat(
    rng,
    n,
    fresh,
    *,
    rate,
    num_system_prompts,
    system_prompt_len,
    user_len,
    output_len,
    zipf_alpha,
) -> list[_Draft]:
    return _shared_prefix(
        rng,
        n,
        fresh,
        rate=rate,
        num_prefixes=num_system_prompts,
        prefix_len=system_prompt_len,
        suffix_len=user_len,
        output_len=output_len,
        zipf_alpha=zipf_alpha,
    )


def _few_shot(
    rng,
    n,
    fresh,
    *,
    rate,
    num_example_sets,
    examples_len,
    question_len,
    output_len,
    zipf_alpha,
) -> list[_Draft]:
    return _shared_prefix(
        rng,
        n,
        fresh,
        rate=rate,
        num_prefixes=num_example_sets,
        prefix_len=examples_len,
        suffix_len=question_len,
        output_len=output_len,
        zipf_alpha=zipf_alpha,
    )


def _random(rng, n, fresh, *, rate, input_len, output_len) -> list[_Draft]:
    input_lens = _draw(rng, input_len, n)
    output_lens = _draw(rng, output_len, n)
    return [
        _Draft(float(t), ((next(fresh), int(i)),), int(o), None)
        for t, i, o in zip(_arrivals(rng, n, rate), input_lens, output_lens)
    ]


def _multi_turn(
    rng,
    n,
    fresh,
    *,
    rate,
    num_system_prompts,
    system_prompt_len,
    user_len,
    output_len,
    turns,
    think_time_s,
    zipf_alpha,
) -> list[_Draft]:
    """Conversations start as a Poisson process at ``rate / mean turns``; turn k+1's
    prompt is turn k's prompt + turn k's output + a new user message, sent a think time
    later.

    Stops once n turns precede the next conversation's start, so the n earliest requests
    are a steady-state window (later turns of the last conversations fall outside
    it)."""
    system_ids = [next(fresh) for _ in range(num_system_prompts)]
    system_lens = _draw(rng, system_prompt_len, num_system_prompts)
    probs = _zipf(num_system_prompts, zipf_alpha)
    conversation_gap = (turns[0] + turns[1]) / 2.0 / rate
    log_think = np.log(think_time_s)
    drafts: list[_Draft] = []
    pending: list[
        float
    ] = []  # heap of arrivals not yet known to be among the n earliest
    settled = 0
    start = 0.0
    for conversation in itertools.count():
        s = int(rng.choice(num_system_prompts, p=probs))
        segments: list[_Segment] = [(system_ids[s], int(system_lens[s]))]
        t = start
        for _ in range(int(_draw(rng, turns))):
            segments.append((next(fresh), int(_draw(rng, user_len))))
            out = int(_draw(rng, output_len))
            output_id = next(fresh)
            drafts.append(
                _Draft(t, tuple(segments), out, f"conv-{conversation}", output_id)
            )
            heapq.heappush(pending, t)
            segments.append((output_id, out))
            t += float(np.exp(rng.uniform(*log_think)))
        start += float(rng.exponential(conversation_gap))
        while pending and pending[0] <= start:
            heapq.heappop(pending)
            settled += 1
        if settled >= n:
            return drafts
    raise AssertionError("unreachable")


def _gsp(
    rng,
    n,
    fresh,
    *,
    rate,
    num_groups,
    prompts_per_group,
    system_prompt_len,
    question_len,
    output_len,
    range_ratio,
    num_turns,
    group_distribution,
    zipf_alpha,
    ordered,
    turn_interval_s,
) -> list[_Draft]:
    """SGLang's generated-shared-prefix dataset (sglang.benchmark.datasets.
    generated_shared_prefix): num_groups system prompts; num_groups * prompts_per_group
    conversation slots, slot (g, p) in group g ("uniform") or in a group drawn by zipf
    rank ("zipf", group 0 hottest); each conversation sends num_turns questions, turn
    k's prompt being system prompt + earlier questions and outputs + question k; lengths
    drawn as SGLang's compute_random_lens; slots shuffled unless ``ordered``.
    Conversations start at ``rate / num_turns`` per second (so ``rate`` is in
    requests/s, unlike SGLang's --request-rate, which counts conversations); turns are
    ``turn_interval_s`` apart. ``prompts_per_group`` None means just enough slots for
    ``num_requests``."""
    if group_distribution == "zipf" and zipf_alpha is None:
        raise ValueError(
            "workload 'gsp': group_distribution='zipf' requires zipf_alpha (> 0)"
        )
    if group_distribution == "uniform" and zipf_alpha is not None:
        raise ValueError(
            "workload 'gsp': zipf_alpha is only meaningful with "
            "group_distribution='zipf'"
        )
    if system_prompt_len + question_len == 0:
        raise ValueError("workload 'gsp': system_prompt_len + question_len must be > 0")
    groups, turns = num_groups, num_turns
    per_group = prompts_per_group or -(-n // (groups * turns))
    if groups * per_group * turns < n:
        raise ValueError(
            f"workload 'gsp': num_groups * prompts_per_group * num_turns = "
            f"{groups * per_group * turns} requests, fewer than num_requests = {n}"
        )

    def lens(full: int, size: int) -> np.ndarray:  # sglang's compute_random_lens
        if full <= 0:
            return np.zeros(size, dtype=np.int64)
        return rng.integers(max(int(full * range_ratio), 1), full + 1, size=size)

    system_ids = [next(fresh) for _ in range(groups)]
    system_lens = lens(system_prompt_len, groups)
    question_lens = lens(question_len, groups * per_group * turns).reshape(
        groups, per_group, turns
    )
    output_lens = lens(output_len, groups * per_group).reshape(groups, per_group)
    slots = groups * per_group
    if group_distribution == "uniform":
        assignment = np.repeat(np.arange(groups), per_group)
    else:
        assignment = rng.choice(groups, size=slots, p=_zipf(groups, zipf_alpha))
    order = np.arange(slots) if ordered else rng.permutation(slots)
    starts = _arrivals(rng, slots, rate / turns)

    drafts: list[_Draft] = []
    for start, slot in zip(starts, order):
        g = int(assignment[slot])
        sg, sp = divmod(int(slot), per_group)
        out = int(output_lens[sg, sp])
        session = f"gsp-{g}-{slot}" if turns > 1 else None
        segments: list[_Segment] = [(system_ids[g], int(system_lens[g]))]
        for k in range(turns):
            segments.append((next(fresh), int(question_lens[sg, sp, k])))
            output_id = next(fresh)
            read_later = k + 1 < turns  # only a later turn's prompt holds this output
            drafts.append(
                _Draft(
                    float(start) + k * turn_interval_s,
                    tuple(segments),
                    out,
                    session,
                    output_id if read_later else None,
                )
            )
            segments.append((output_id, out))
    return drafts


# Parameter checks: return the value or raise ValueError saying what is wrong with it.


def _positive(v: Any) -> float:
    if type(v) not in (int, float) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"must be a finite number > 0, got {v!r}")
    return float(v)


def _non_negative(v: Any) -> float:
    if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
        raise ValueError(f"must be a finite number >= 0, got {v!r}")
    return float(v)


def _count(v: Any) -> int:
    if type(v) is not int or v < 1:
        raise ValueError(f"must be an integer >= 1, got {v!r}")
    return v


def _tokens(v: Any) -> int:
    if type(v) is not int or v < 0:
        raise ValueError(f"must be an integer >= 0, got {v!r}")
    return v


def _span(v: Any) -> tuple[int, int]:
    if (
        not isinstance(v, (tuple, list))
        or len(v) != 2
        or any(type(x) is not int for x in v)
        or not 1 <= v[0] <= v[1]
    ):
        raise ValueError(
            f"must be a pair of integers (lo, hi) with 1 <= lo <= hi, got {v!r}"
        )
    return (v[0], v[1])


def _seconds_span(v: Any) -> tuple[float, float]:
    if (
        not isinstance(v, (tuple, list))
        or len(v) != 2
        or any(type(x) not in (int, float) or not math.isfinite(x) for x in v)
        or not 0 < v[0] <= v[1]
    ):
        raise ValueError(
            f"must be a pair of numbers (lo, hi) with 0 < lo <= hi, got {v!r}"
        )
    return (float(v[0]), float(v[1]))


def _ratio(v: Any) -> float:
    if type(v) not in (int, float) or not 0 <= v <= 1:
        raise ValueError(f"must be a number in [0, 1], got {v!r}")
    return float(v)


def _flag(v: Any) -> bool:
    if type(v) is not bool:
        raise ValueError(f"must be True or False, got {v!r}")
    return v


def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else check(v)


def _one_of(*choices: str) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if v not in choices:
            raise ValueError(f"must be one of {list(choices)}, got {v!r}")
        return v

    return check


@dataclass(frozen=True)
class Workload:
    description: str
    params: Mapping[str, tuple[Any, Callable[[Any], Any]]]  # name -> (default, check)
    build: Callable[..., list[_Draft]]


def _workload(
    description: str, build: Callable[..., list[_Draft]], **params
) -> Workload:
    return Workload(description, MappingProxyType(params), build)


WORKLOADS: Mapping[str, Workload] = MappingProxyType(
    {
        "chat": _workload(
            "Many users sharing a few long system prompts (zipf popularity); each "
            "request is a system prompt + a unique user message.",
            _chat,
            rate=(4.0, _positive),
            num_system_prompts=(8, _count),
            system_prompt_len=((2000, 6000), _span),
            user_len=((20, 600), _span),
            output_len=((50, 800), _span),
            zipf_alpha=(1.0, _non_negative),
        ),
        "few-shot": _workload(
            "A handful of long, shared few-shot example sets + a unique question.",
            _few_shot,
            rate=(2.0, _positive),
            num_example_sets=(4, _count),
            examples_len=((3000, 8000), _span),
            question_len=((30, 300), _span),
            output_len=((10, 200), _span),
            zipf_alpha=(0.5, _non_negative),
        ),
        "multi-turn": _workload(
            "Interleaved conversations: each turn's prompt is the previous prompt + "
            "its output + a new user message, a log-uniform think time later; "
            "session_id set.",
            _multi_turn,
            rate=(2.0, _positive),
            num_system_prompts=(4, _count),
            system_prompt_len=((300, 1500), _span),
            user_len=((20, 800), _span),
            output_len=((50, 800), _span),
            turns=((2, 10), _span),
            think_time_s=((5.0, 300.0), _seconds_span),
            zipf_alpha=(1.0, _non_negative),
        ),
        "random": _workload(
            "Unique prompts, no sharing at all.",
            _random,
            rate=(4.0, _positive),
            input_len=((100, 4000), _span),
            output_len=((50, 800), _span),
        ),
        "gsp": _workload(
            "SGLang's generated-shared-prefix dataset (bench_serving --dataset-name "
            "generated-shared-prefix --gsp-*), with Poisson arrivals.",
            _gsp,
            rate=(8.0, _positive),
            num_groups=(64, _count),
            prompts_per_group=(None, _optional(_count)),
            system_prompt_len=(2048, _tokens),
            question_len=(128, _tokens),
            output_len=(256, _tokens),
            range_ratio=(1.0, _ratio),
            num_turns=(1, _count),
            group_distribution=("uniform", _one_of("uniform", "zipf")),
            zipf_alpha=(None, _optional(_positive)),
            ordered=(False, _flag),
            turn_interval_s=(10.0, _non_negative),
        ),
    }
)


def generate_workload(
    name: str, *, num_requests: int, seed: int, block_size: int = 512, **params: Any
) -> Trace:
    """A synthetic trace of exactly ``num_requests`` requests, sorted by arrival.

    The same (name, num_requests, seed, block_size, params) always gives the same trace.
    ``params`` override the defaults in ``WORKLOADS[name].params``; token spans are (lo,
    hi) inclusive. Block ids are dense, numbered from 0 in order of first appearance
    (each prompt, then its prompt + output where a later prompt holds the output), so
    they stay below ``ID_LIMIT``. Raises ValueError naming the workload or parameter for
    an unknown name, unknown parameter or bad value.
    """
    workload = WORKLOADS.get(name)
    if workload is None:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    for key, value, check in (
        ("num_requests", num_requests, _count),
        ("block_size", block_size, _count),
        ("seed", seed, _tokens),
    ):
        try:
            check(value)
        except ValueError as e:
            raise ValueError(f"workload {name!r}: {key} {e}") from None
    unknown = sorted(set(params) - set(workload.params))
    if unknown:
        raise ValueError(
            f"workload {name!r}: unknown parameter(s) {unknown}; "
            f"known: {sorted(workload.params)}"
        )
    values = {}
    for key, (default, check) in workload.params.items():
        try:
            values[key] = check(params.get(key, default))
        except ValueError as e:
            raise ValueError(f"workload {name!r}: parameter {key!r} {e}") from None

    rng = np.random.default_rng(seed)
    drafts = workload.build(rng, num_requests, itertools.count(), **values)
    drafts.sort(key=lambda d: d.arrival_s)  # stable: ties keep generation order
    block_ids = _BlockIds(block_size)
    requests = tuple(
        Request(
            d.arrival_s,
            sum(length for _, length in d.segments),
            d.output_length,
            block_ids.of(d.segments),
            d.session_id,
            ()
            if d.output_id is None
            else block_ids.of((*d.segments, (d.output_id, d.output_length))),
        )
        for d in drafts[:num_requests]
    )
    if len(block_ids.ids) > ID_LIMIT:  # ids are 0 .. len - 1
        raise ValueError(
            f"workload {name!r}: {len(block_ids.ids)} distinct blocks, more "
            f"than ID_LIMIT = 2**40"
        )
    return Trace(name=name, block_size=block_size, requests=requests)


def _dense(trace: Trace) -> tuple[int, tuple[Request, ...]]:
    """(D, requests): the number D of distinct block ids in ``trace`` and its requests
    with ids in ``[0, D)``. The requests are ``trace.requests`` when their ids already
    are (loaded and generated traces); otherwise each id is renumbered in order of first
    appearance (each prompt, then its prompt + output)."""
    requests = trace.requests
    ids = {h for r in requests for h in (*r.hash_ids, *r.sequence_hash_ids)}
    if not ids or (min(ids) == 0 and max(ids) == len(ids) - 1):
        return len(ids), requests
    number: dict[int, int] = {}
    for r in requests:
        for h in (*r.hash_ids, *r.sequence_hash_ids):
            number.setdefault(h, len(number))
    return len(number), tuple(
        dataclasses.replace(
            r,
            hash_ids=tuple(number[h] for h in r.hash_ids),
            sequence_hash_ids=tuple(number[h] for h in r.sequence_hash_ids),
        )
        for r in requests
    )


def scale_trace(trace: Trace, copies: int) -> Trace:
    """``copies`` back-to-back copies of ``trace``, named "NAMExCOPIES".

    Ids stay dense: with D distinct ids in ``trace`` (prompt and sequence ids together),
    copy k's ids are copy 0's + k * D, so copies share no block and the ids of the
    result are exactly ``0 .. copies * D - 1``. Copy 0 is ``trace``'s requests when
    their ids are already ``0 .. D - 1`` (loaded and generated traces), else the
    requests with ids renumbered in order of first appearance. Copy k also has its
    session ids, for k > 0, prefixed with "k:", and its timestamps shifted by k * (span
    + mean gap), so it starts one mean inter-arrival gap (1 s for a one-instant trace)
    after copy k-1 ends. ``copies == 1`` keeps the requests. Raises ValueError for
    ``copies < 1`` or for ``copies * D > ID_LIMIT``.
    """
    if type(copies) is not int or copies < 1:
        raise ValueError(f"copies must be an integer >= 1, got {copies!r}")
    requests = trace.requests
    if copies == 1 or not requests:
        return Trace(f"{trace.name}x{copies}", trace.block_size, requests)
    id_stride, requests = _dense(trace)
    if copies * id_stride > ID_LIMIT:
        raise ValueError(
            f"{copies} copies of {id_stride} distinct ids is more than "
            f"ID_LIMIT = 2**40 ids"
        )
    first, last = requests[0].timestamp_s, requests[-1].timestamp_s
    span = last - first
    gap = span / (len(requests) - 1) if len(requests) > 1 and span > 0 else 1.0
    out: list[Request] = []
    for k in range(copies):
        dt, dh = k * (span + gap), k * id_stride
        out.extend(
            Request(
                r.timestamp_s + dt,
                r.input_length,
                r.output_length,
                tuple(h + dh for h in r.hash_ids),
                f"{k}:{r.session_id}"
                if k and r.session_id is not None
                else r.session_id,
                tuple(h + dh for h in r.sequence_hash_ids),
            )
            for r in requests
        )
    return Trace(
        name=f"{trace.name}x{copies}", block_size=trace.block_size, requests=tuple(out)
    )


def jitter_arrivals(trace: Trace, seed: int, scale: float = 1.0) -> Trace:
    """``trace`` with each arrival moved by a random offset, named "NAME~jitterSEED".

    With g the mean inter-arrival gap, (last - first timestamp) / (n - 1) (0 when there
    are fewer than 2 requests), each request's offset is drawn uniformly from
    ``[-g * scale, +g * scale]`` (numpy's default generator seeded with ``seed``, one
    draw per request in trace order); a new time below 0 becomes 0, and the requests are
    sorted (stably) by their new times, so turns of one session closer than
    2 * g * scale may swap. Everything else about each request is kept. ``seed == 0``
    returns ``trace`` itself, unchanged: seed 0 is the unjittered run. Deterministic in
    (trace, seed, scale). Raises ValueError for a negative or non-integer seed or a
    scale that is not a finite number >= 0.
    """
    if type(seed) is not int or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    if type(scale) not in (int, float) or not math.isfinite(scale) or scale < 0:
        raise ValueError(f"scale must be a finite number >= 0, got {scale!r}")
    if seed == 0:
        return trace
    requests = trace.requests
    n = len(requests)
    gap = (
        (requests[-1].timestamp_s - requests[0].timestamp_s) / (n - 1)
        if n >= 2
        else 0.0
    )
    width = gap * scale
    offsets = np.random.default_rng(seed).uniform(-width, width, size=n)
    times = [max(0.0, r.timestamp_s + float(d)) for r, d in zip(requests, offsets)]
    order = sorted(range(n), key=times.__getitem__)  # stable: ties keep trace order
    return Trace(
        name=f"{trace.name}~jitter{seed}",
        block_size=trace.block_size,
        requests=tuple(
            dataclasses.replace(requests[i], timestamp_s=times[i]) for i in order
        ),
    )
