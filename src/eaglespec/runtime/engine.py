"""The engine: owns the models, admits requests into rows, steps them together, retires them.

Requests that share a speculation setting (method and tree) run in one `Lane`: a batch of up to
`max_batch` rows with its own target and draft KV caches, advanced together by one `SpecStep`.
Each request keeps its own sampling parameters, seed, stop rules and statistics, and its output
does not depend on which other requests share its lane (random numbers are drawn per request).

A finished request leaves its tokens' KV in its row. A new request whose prompt starts with them
(the next turn of a chat: the history, then the new message) is admitted into that row and
prefills only the rest (`Lane.admit`, `GenerationStats.cached_tokens`). A free row stepped as
padding, while rows above it run, loses what it kept. Off by default in the bf16 exact mode
(see `Engine.__init__`).

There is no background thread: whoever waits for output drives the engine (`Engine.step` under
one lock), so several streams in one thread, or in several threads, interleave safely and every
step advances all of them. A server can drive it from a loop of its own.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..config import SamplingConfig, TreeConfig, default_tree
from ..draft import Head
from ..kv_cache import RowKVCache
from ..model import Transformer
from ..quant import greedy_exact
from ..spec.propose import Proposer
from ..spec.sampling import RowSampling
from ..spec.draft_quant import int8_supported
from ..spec.graphs import GraphedSteps
from ..spec.step import RowState, SpecStep, StepTimes, prefill_row
from . import tree_tuning
from .request import GenerationError, GenerationStats, StopChecker, check_request

log = logging.getLogger(__name__)

CAPACITY_QUANTUM = 256  # KV caches grow in steps of this many slots


@dataclass
class Request:
    """One generation request and everything the host tracks for it."""

    prompt_ids: list[int]
    method: str = "vanilla"  # vanilla | eagle | eagle2
    tree: TreeConfig | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_new_tokens: int | None = 256
    stop_strings: list[str] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    id: int = 0
    # Filled in by the engine.
    pending: deque = field(default_factory=deque)  # lists of new token ids, not yet taken
    # Parallel to `pending`: how many leading tokens of each chunk were accepted drafts (the rest
    # came from the target: the prefill's token or a step's bonus token). Servers show it.
    pending_drafted: deque = field(default_factory=deque)
    done: bool = False
    cancelled: bool = False
    error: BaseException | None = None
    t_submit: float = 0.0

    @property
    def pending_tokens(self) -> list[int]:
        """The new tokens not yet taken by `Engine.chunks`, flat (all of them after `Engine.run`)."""
        return [t for chunk in self.pending for t in chunk]

    @property
    def lane_key(self) -> tuple:
        t = self.tree
        if self.method == "vanilla" or t is None:
            return ("vanilla",)
        if self.method == "eagle":
            return ("eagle", tuple(map(tuple, t.choices)))
        return ("eagle2", t.total_tokens, t.depth, t.top_k)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Lane:
    """Up to `max_batch` rows with one speculation setting, stepped together."""

    def __init__(self, engine: "Engine", proposer: Proposer | None, max_batch: int) -> None:
        self.engine, self.proposer = engine, proposer
        self.step_fn = SpecStep(engine.target, proposer)
        self.max_batch = max_batch
        self.requests: list[Request | None] = [None] * max_batch
        self.stops: list[StopChecker | None] = [None] * max_batch
        self.lengths: list[int] = [0] * max_batch  # host mirror of committed target lengths
        # Per running row: its tokens, committed ones then the root (prompt + every token a step
        # kept, including those a stop rule cut from the output). Per free row: what its caches
        # still hold (target slots 0..len-2, draft pairs 0..len-2), or None.
        self.tokens: list[list[int] | None] = [None] * max_batch
        self.kept: list[list[int] | None] = [None] * max_batch
        self.state: RowState | None = None
        self._sampling: tuple[tuple, RowSampling] | None = None  # cached per set of rows
        self.graphs = GraphedSteps(self.step_fn) if engine.cuda_graphs else None

    @property
    def active(self) -> list[int]:
        return [r for r, q in enumerate(self.requests) if q is not None]

    def has_room(self) -> bool:
        return any(q is None for q in self.requests)

    def _need(self, req: Request) -> int:
        window = self.engine.window
        n = len(req.prompt_ids)
        end = window if req.max_new_tokens is None else min(window, n + req.max_new_tokens)
        return end + self.step_fn.budget

    def _ensure(self, capacity: int) -> None:
        """Allocate, or grow, the row state to hold `capacity` target slots per row."""
        cap = -(-capacity // CAPACITY_QUANTUM) * CAPACITY_QUANTUM
        t, dev, b = self.engine.target, self.engine.device, self.max_batch
        draft_extra = 0 if self.proposer is None else self.proposer.scratch + self.step_fn.path_width
        if self.state is None:
            c = t.config
            tc = RowKVCache(c.num_layers, c.num_kv_heads, c.head_dim, cap, b, t.dtype, dev)
            dc = rh = None
            if self.proposer is not None:
                hc, w = self.proposer.head.config, self.proposer.head.fc.weight
                dc = RowKVCache(self.proposer.head.cache_layers, hc.num_kv_heads, hc.head_dim, cap + draft_extra, b, w.dtype, dev)
                rh = torch.zeros(b, hc.hidden_size, dtype=w.dtype, device=dev)
            zeros = torch.zeros(b, dtype=torch.long, device=dev)
            self._idle = torch.ones(b, dtype=torch.bool, device=dev)  # [B] rows with no request
            self.state = RowState(zeros.clone(), torch.full_like(zeros, self.engine.window), zeros.clone(), tc, dc, rh)
        elif cap > self.state.target_cache.capacity:
            self.state.target_cache.grow(cap)
            if self.state.draft_cache is not None:
                self.state.draft_cache.grow(cap + draft_extra)
            if self.graphs is not None:
                self.graphs.reset()  # captured against the old buffers

    def _pick_row(self, prompt: list[int]) -> tuple[int, int]:
        """A free row for `prompt` and how many of its positions that row's caches already hold.

        The row that kept the longest common prefix wins; among equals, the one that kept least
        (so a new chat, which shares only the system prompt with every row, does not take the row
        a longer conversation is about to come back to)."""
        best, best_key, best_reuse = -1, None, 0
        for row, req in enumerate(self.requests):
            if req is not None:
                continue
            kept = (self.kept[row] if self.engine.reuse_prefix else None) or []
            common = _common_prefix(kept, prompt)
            # Target slots hold kept[:-1] (the root was not run); draft pair t needs prompt[t + 1]
            # to match too, so a speculative row reuses one position less. One prompt token is
            # always run, for the first token's logits.
            reuse = min(common if self.proposer is None else common - 1, len(kept) - 1, len(prompt) - 1)
            reuse = max(0, reuse)
            key = (reuse, -len(kept))
            if best_key is None or key > best_key:
                best, best_key, best_reuse = row, key, reuse
        return best, best_reuse

    def admit(self, req: Request) -> None:
        """Prefill `req` into a free row; its first token is pending when this returns."""
        row, reuse = self._pick_row(req.prompt_ids)
        self.kept[row] = None
        self._ensure(self._need(req))
        e = self.engine
        t0 = time.perf_counter()
        first = prefill_row(e.target, self.proposer, self.state, row, req.prompt_ids,
                            RowSampling.from_configs([req.sampling], e.device), e.prefill_chunk, reuse)
        e.sync()
        st = req.stats
        st.prefill_s = time.perf_counter() - t0
        st.cached_tokens = reuse
        window, n = e.window, len(req.prompt_ids)
        stop = StopChecker(e.eos_ids, req.stop_strings,
                           req.max_new_tokens if req.max_new_tokens is not None else window - n, e.decode)
        self.requests[row], self.stops[row], self.lengths[row] = req, stop, n
        self.tokens[row] = list(req.prompt_ids) + [first]
        self._idle[row] = False
        self._sampling = None
        self._emit(row, [first], 0)

    def _emit(self, row: int, tokens: list[int], drafted: int) -> int:
        """Push a row's new tokens through its stop rules; retire it when one fires. Returns how
        many were emitted (tokens past a stop are dropped). The first `drafted` tokens were accepted
        drafts."""
        req, stop = self.requests[row], self.stops[row]
        out, reason = [], ""
        for tok in tokens:
            out.append(tok)
            reason = stop.push(tok)
            if reason:
                break
        st = req.stats
        st.new_tokens += len(out)
        st.wall_s = time.perf_counter() - req.t_submit
        req.pending.append(out)
        req.pending_drafted.append(min(drafted, len(out)))
        if reason:
            if reason == "max_new_tokens" and req.max_new_tokens is None:
                reason = "context_full"
            st.stop_reason = reason
            self.retire(row)
        return len(out)

    def retire(self, row: int) -> None:
        """Free a row (finished or cancelled); its request sees done. Its caches stay for a later
        prompt that starts with its tokens."""
        req = self.requests[row]
        req.done = True
        self.kept[row] = self.tokens[row][: self.lengths[row] + 1]
        self.tokens[row] = None
        self.requests[row] = self.stops[row] = None
        self.lengths[row] = 0
        self._sampling = None
        s = self.state
        # An idle row keeps stepping harmlessly at the start of its own cache until reused.
        self._idle[row] = True
        s.target_cache.lengths[row] = 0
        if s.draft_cache is not None:
            s.draft_cache.lengths[row] = 0

    def _row_sampling(self, span: int) -> RowSampling:
        """Sampling parameters of rows 0..span-1 (idle rows greedy), rebuilt when the rows change.

        With CUDA graphs the tensors must stay the same objects: they are updated in place."""
        key = (span, tuple(id(q) for q in self.requests[:span]))
        if self._sampling is None or self._sampling[0] != key:
            greedy = SamplingConfig()
            cfgs = [q.sampling if q is not None else greedy for q in self.requests[:span]]
            fresh = RowSampling.from_configs(cfgs, self.engine.device)
            if self.graphs is not None:
                fresh = self.graphs.sampling(fresh)
            self._sampling = (key, fresh)
        return self._sampling[1]

    def _span(self, active: list[int]) -> int:
        """Rows stepped: up to the last active one, or a bucket of them (fixed shapes)."""
        span = active[-1] + 1
        if self.engine.fixed_shapes:
            span = min(self.max_batch, 1 << (span - 1).bit_length())
        return span

    def step(self) -> None:
        active = self.active
        if not active:
            return
        e = self.engine
        span = self._span(active)
        for r in range(span):  # free rows in the span are stepped as padding: their caches change
            if self.requests[r] is None:
                self.kept[r] = None
        times = StepTimes()
        sampling = self._row_sampling(span)
        if self.graphs is not None:
            acc = self.graphs.step(self.state, span, sampling, times)
        elif e.fixed_shapes:  # capacity-wide views: the same shapes every step
            longest = self.state.target_cache.capacity - self.step_fn.budget
            acc = self.step_fn(self.state.rows(span), sampling, longest, times, exact=False)
        else:
            acc = self.step_fn(self.state.rows(span), sampling, max(self.lengths[:span]), times,
                               e.sync if e.device.type == "cuda" else None)
        # Idle rows inside the span were stepped too (harmlessly): pin them back at length 0 so
        # they never outgrow the cache while a higher row keeps running.
        for cache in (self.state.target_cache, self.state.draft_cache):
            if cache is not None:
                cache.lengths.masked_fill_(self._idle, 0)
        # The one device-to-host copy of the step: emitted tokens and their counts.
        host = torch.cat((acc.emitted, acc.count[:, None]), dim=1).tolist()
        for r in active:
            req = self.requests[r]
            count = host[r][-1]  # nodes kept = accepted drafts + the bonus token
            self.lengths[r] += count
            self.tokens[r].extend(host[r][:count])
            emitted = self._emit(r, host[r][:count], count - 1)
            req.stats.record_step(emitted, count - 1, self.step_fn.budget, times.draft_s, times.verify_s)


class Engine:
    """Runs requests through the batched speculative step. Thread-safe."""

    def __init__(self, target: Transformer, head: Head | None = None, *, eos_ids: list[int] = (),
                 decode=None, max_batch: int = 8, prefill_chunk: int = 512, fixed_shapes: bool = False,
                 cuda_graphs: bool = False, draft_int8: bool | None = None, reuse_prefix: bool | None = None) -> None:
        """fixed_shapes: step every lane with capacity-wide attention views and a power-of-two
        number of rows, so the step's shapes repeat (what CUDA graphs need; on a CPU it only costs).
        cuda_graphs: capture each lane's step per row bucket and replay it (CUDA only).
        draft_int8: draft with weight-only int8 products (None: on a CPU with a bf16 head); the
        output is the same either way, only drafting speed and which tokens are proposed change.
        reuse_prefix: admit a prompt into the free row that still holds its longest prefix and
        prefill only the rest (False: every prompt is run whole). None: on, except for a bf16
        target whose greedy speculative output is bit-exact (`quant.greedy_exact`: the CPU's
        int4/int8 mode). There a prompt's prefill must not depend on what ran before it: the
        flash kernel a prefill takes rounds differently when the prompt is split at another
        point, which could tip a near-tie between a vanilla and a speculative run."""
        if cuda_graphs and target.device.type != "cuda":
            raise ValueError("cuda_graphs needs the model on a CUDA device")
        self.fixed_shapes = fixed_shapes or cuda_graphs
        self.draft_int8 = draft_int8  # None: decided per head (int8_supported)
        if reuse_prefix is None:
            reuse_prefix = target.dtype == torch.float32 or not greedy_exact(target)
        self.reuse_prefix = reuse_prefix
        self.cuda_graphs = cuda_graphs
        self.target, self.head = target, head
        self.eos_ids, self.decode = list(eos_ids), decode
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.window = target.config.max_position_embeddings
        self.device = target.device
        self.lock = threading.RLock()
        self.lanes: dict[tuple, Lane] = {}
        self.waiting: deque[Request] = deque()
        self._ids = itertools.count(1)
        self.tuned: dict[str, tree_tuning.TreeChoice] = {}  # "greedy" / "sampled" -> this machine's tree
        if head is not None:
            self.tune_trees()

    def set_head(self, head: Head | None) -> None:
        with self.lock:
            if any(lane.active for key, lane in self.lanes.items() if key[0] != "vanilla"):
                raise RuntimeError("cannot change the draft head while speculative requests are running")
            self.head = head
            self.lanes = {k: v for k, v in self.lanes.items() if k[0] == "vanilla"}
            self.tuned = {}
            self.tune_trees()

    def tune_trees(self) -> None:
        """Pick eagle2's default trees for this machine where the head ships a tau table
        (runtime/tree_tuning.py; cached per machine, so timed once). Before any request runs."""
        taus = getattr(self.head, "tree_tau", None)
        if not taus or not tree_tuning.enabled():
            return
        with self.lock:
            if self.waiting or any(lane.active for lane in self.lanes.values()):
                # Timing steps would drive (and be slowed by) the requests in flight.
                log.warning("eaglespec: requests in flight; the static tree defaults stay (config.default_tree)")
                return
            for kind, table in taus.items():
                self.tuned[kind] = tree_tuning.tune(self, kind, table)

    def default_tree(self, method: str, temperature: float = 0.0) -> TreeConfig:
        """The tree a `method` request gets when it names none: eagle2's tuned for this machine
        where `tune_trees` chose one, else config.default_tree's."""
        choice = self.tuned.get("sampled" if temperature > 0 else "greedy") if method == "eagle2" else None
        if choice is not None:
            return choice.tree
        return default_tree(method, getattr(self.target, "quant", "none"), temperature)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def submit(self, req: Request) -> Request:
        """Queue a request (checked now, so a bad one fails in the caller's thread)."""
        if req.id:
            raise ValueError(f"request {req.id} was already submitted; make a new Request")
        check_request(self.window, len(req.prompt_ids), req.max_new_tokens)
        if req.method != "vanilla" and self.head is None:
            raise GenerationError(f"method {req.method} needs a draft head")
        if req.method != "vanilla" and req.tree is None:
            req.tree = self.default_tree(req.method, req.sampling.temperature)
        if req.sampling.seed is None and not req.sampling.greedy:
            # Fixed now, so that the request's random numbers do not depend on when it runs.
            req.sampling = SamplingConfig(req.sampling.temperature, req.sampling.top_k, req.sampling.top_p,
                                          random.getrandbits(62))
        with self.lock:
            req.id = next(self._ids)
            req.t_submit = time.perf_counter()
            self.waiting.append(req)
        return req

    @torch.inference_mode()  # the row state is made of inference tensors
    def cancel(self, req: Request) -> None:
        """Stop a request now and free its row (a client that went away)."""
        with self.lock:
            req.cancelled = True
            if req in self.waiting:
                self.waiting.remove(req)
                req.done = True
                return
            for lane in self.lanes.values():
                if req in lane.requests:
                    req.stats.stop_reason = req.stats.stop_reason or "cancelled"
                    lane.retire(lane.requests.index(req))

    def prune_lanes(self, keep: int) -> None:
        """Drop idle lanes (and their caches) while more than `keep` exist: a server that takes a
        tree setting per request would otherwise keep one lane per setting ever seen."""
        with self.lock:
            needed = {r.lane_key for r in self.waiting}
            for key in [k for k, lane in self.lanes.items() if not lane.active and k not in needed]:
                if len(self.lanes) <= keep:
                    break
                del self.lanes[key]

    def _lane(self, req: Request) -> Lane:
        key = req.lane_key
        if key not in self.lanes:
            proposer = None
            if key[0] != "vanilla":
                int8 = self.draft_int8
                if int8 is None:
                    int8 = int8_supported(self.device, self.head.fc.weight.dtype)
                proposer = Proposer(self.head, self.target, req.tree, int8)
            self.lanes[key] = Lane(self, proposer, self.max_batch)
        return self.lanes[key]

    @torch.inference_mode()
    def step(self) -> bool:
        """Admit what fits, then advance every lane by one step. False when there is nothing to do."""
        with self.lock:
            still: deque[Request] = deque()
            try:
                while self.waiting:
                    req = self.waiting.popleft()
                    lane = self._lane(req)
                    if not lane.has_room():
                        still.append(req)
                        continue
                    try:
                        lane.admit(req)
                    except BaseException as err:  # a failed prefill fails its request, not the engine
                        req.error, req.done = err, True
                        raise
            finally:  # requests passed over before a failed prefill keep their place in the queue
                still.extend(self.waiting)
                self.waiting = still
            busy = [lane for lane in self.lanes.values() if lane.active]
            for lane in busy:
                try:
                    lane.step()
                except BaseException as err:
                    for r in lane.active:
                        lane.requests[r].error = err
                        lane.retire(r)
                    lane.kept = [None] * lane.max_batch  # the failed step may have written anywhere
                    raise
            return bool(busy or self.waiting)

    def chunks(self, req: Request) -> Iterator[list[int]]:
        """Yield the request's new tokens as they come, driving the engine while none are pending.

        Closing the iterator early (a consumer that stops reading) cancels the request."""
        try:
            while True:
                with self.lock:
                    while not req.pending and not req.done:
                        self.step()
                    items = list(req.pending)
                    req.pending.clear()
                    req.pending_drafted.clear()
                    done = req.done
                if req.error is not None:
                    raise req.error
                yield from items
                if done and not req.pending:
                    return
        finally:
            if not req.done:
                self.cancel(req)

    def run(self, reqs: list[Request]) -> list[Request]:
        """Submit all and drive until every one is done (throughput runs, tests)."""
        for r in reqs:
            self.submit(r)
        while not all(r.done for r in reqs):
            with self.lock:
                self.step()
        for r in reqs:
            if r.error is not None:
                raise r.error
        return reqs
