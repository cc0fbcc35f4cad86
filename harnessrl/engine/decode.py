"""Engine stage: prompts + sampling params → token events, with continuous batching.

Sequences (one per choice) share a fixed set of KV-cache slots. Prompts are prefilled in chunks
whose lengths come from a small bucket set; one decode step advances every active slot at once.
A free slot keeps what its last sequence left in the cache: a prompt that starts with it prefills
only the rest, within the packed prefill up to `prefix_window` tokens, whole from a largest chunk
on (prefix caching; forgotten when the weights change).
Every device program has a static shape, so after `warm_up()` nothing compiles again
(`compile_count` counts traces). The loop runs on its own thread; params swap between steps.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harnessrl.engine.sampler import SamplingParams
from harnessrl.engine.steps import DeviceSteps, EngineConfig, Logits
from harnessrl.engine.swap import ParamSwap
from harnessrl.model.registry import AnyDecoder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token of one choice, as the engine reports it."""

    choice: int
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (id, logprob), best first; empty unless asked for
    finish_reason: str | None  # "stop" | "length" | "abort" (engine stopped/lost) | "error" | None
    stop_reason: int | None  # the stop token id that ended it, if not EOS
    version: int
    error: str | None = None  # why the engine ended it without a token


Sink = Callable[[list[TokenEvent]], object]
Cancel = Callable[..., None]


class EngineBusy(Exception):
    """The waiting queue is full; the edge answers 503."""


@dataclass
class _Request:
    prompt: np.ndarray  # int32 [prompt_len]
    params: SamplingParams
    max_tokens: int
    eos: frozenset[int]
    sink: Sink
    seqs: list[_Seq] = field(default_factory=list)
    prompt_logits: Logits | None = None  # after the prompt: siblings start from it
    source_slot: int = -1  # a live slot whose cache holds the prompt
    solo: bool = False  # was in a packed prefill that failed: prefills alone


@dataclass
class _Seq:
    request: _Request
    choice: int
    key: np.ndarray  # uint32 [2], raw threefry key
    slot: int = -1
    prefilled: int = 0
    sampled: list[int] = field(default_factory=list)  # tokens so far (a held prefix, later)
    done: bool = False

    @property
    def generated(self) -> int:
        return len(self.sampled)

    @property
    def last_token(self) -> int:
        return self.sampled[-1]


_NOTHING = np.zeros(0, np.int32)


def _raw_key(seed: int) -> np.ndarray:
    """The uint32 pair `jax.random.PRNGKey(seed)` holds, built on the host (no device op)."""
    seed &= (1 << 64) - 1
    return np.array([seed >> 32, seed & 0xFFFFFFFF], dtype=np.uint32)


def _deliver(sink: Sink, events: list[TokenEvent]) -> None:
    # A sink whose event loop has closed must not take the engine thread down with it.
    try:
        sink(events)
    except Exception:
        log.exception("dropping %d token events: their receiver is gone", len(events))


class Engine:
    """Continuous-batching decoder over `num_slots` KV-cache rows, run on a background thread."""

    def __init__(self, model: AnyDecoder, eos_token_ids: Any, config: EngineConfig) -> None:
        self.config = config
        self.model_config = model.cfg
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.steps = DeviceSteps(model, config)
        self._swap = ParamSwap(self.steps, config.policy_version)
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._slots: list[_Seq | None] = [None] * config.num_slots
        # What each free slot's cache still holds at positions 0..: the tokens of the sequence
        # that finished there (prefix caching; empty once the slot or the weights change).
        self._held: list[np.ndarray] = [_NOTHING] * config.num_slots
        self._cancelled: list[_Seq] = []
        self._seeds = itertools.count(config.seed << 20)
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- public API -------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._swap.version

    @property
    def compile_count(self) -> int:
        return self.steps.compile_count

    def warm_up(self) -> None:
        """Compile every program once (all prefill buckets, decode, first-token, row copy)."""
        self.steps.warm_up()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="harnessrl-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None

    def swap_params(self, params: Any, version: int, *, wait: bool = True) -> None:
        """Install new weights between two decode steps; `params` is an `nnx.State` or a Decoder.

        Leaves are checked against the serving tree (names, shapes) and placed like the current
        ones, so a swap never recompiles. With `wait`, returns once the engine uses them.
        """
        applied = self._swap.stage(params, version)
        with self._cond:
            if self._thread is None:  # not serving yet: nothing runs that a swap could race
                self._apply_swap()
            self._cond.notify_all()
        if wait:
            applied.wait()

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, max_tokens: int, sink: Sink
    ) -> Cancel:
        """Queue one request (`params.n` sequences); `sink` gets event lists from the engine thread.

        Raises ValueError for a request that cannot run (checked here, so a bad request never
        reaches a step it shares with others) and EngineBusy when the queue is full. Returns
        `cancel(choice=None)` (safe from any thread): ends that choice, or all of them.
        """
        if not prompt_ids:  # a slot that never prefills would hold its place forever
            raise ValueError("the prompt must hold at least one token")
        if max_tokens < 1 or len(prompt_ids) + max_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens={max_tokens} does not fit "
                f"max_model_len={self.config.max_model_len}"
            )
        self.steps.check_sampling(params)
        self._check_room(params.n)  # before building anything per choice
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        request = _Request(np.asarray(prompt_ids, np.int32), params, max_tokens, eos, sink)
        base = params.seed if params.seed is not None else next(self._seeds)
        request.seqs = [_Seq(request, i, _raw_key(base)) for i in range(params.n)]
        with self._cond:
            self._check_room(params.n)
            self._waiting.extend(request.seqs)
            self._cond.notify_all()

        def cancel(choice: int | None = None) -> None:
            with self._cond:
                self._cancelled.extend(s for s in request.seqs if choice in (None, s.choice))
                self._cond.notify_all()

        return cancel

    def _check_room(self, n: int) -> None:
        capacity = self.config.max_waiting + self.config.num_slots
        if n > capacity:
            raise ValueError(f"n={n} exceeds the {capacity} sequences this engine can hold")
        if len(self._waiting) + n > capacity:
            raise EngineBusy(f"{len(self._waiting)} sequences are waiting; retry later")

    def submit_async(
        self, prompt_ids: list[int], params: SamplingParams, max_tokens: int
    ) -> tuple[asyncio.Queue[list[TokenEvent]], Cancel]:
        """`submit` bridged to the running asyncio loop: events arrive on the returned queue."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[TokenEvent]] = asyncio.Queue()
        cancel = self.submit(
            prompt_ids,
            params,
            max_tokens,
            lambda evs: loop.call_soon_threadsafe(queue.put_nowait, evs),
        )
        return queue, cancel

    # ---- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._stopping
                    or self._waiting
                    or self._busy()
                    or self._swap.pending
                    or self._cancelled
                ):
                    self._cond.wait()
                if self._stopping:
                    break
                self._apply_swap()
                cancelled, self._cancelled = self._cancelled, []
                for seq in cancelled:
                    self._finish(seq)
                self._admit()
            try:
                self._prefill_one()
                self._decode_step()
            except Exception as err:  # a host-side bug: fail what runs, keep the queue
                log.exception("engine step failed")
                self._abort(self._seqs_of(self._running()), "abort", str(err))
        with self._cond:
            seqs = [s for s in self._slots if s is not None] + list(self._waiting)
            self._waiting.clear()
        self._abort(seqs, "abort", "the engine stopped")

    def _apply_swap(self) -> None:
        if self._swap.apply_if_pending():  # held prefixes are keys and values of the old weights
            self._forget_held()

    def _forget_held(self) -> None:
        self._held = [_NOTHING] * len(self._slots)

    def _busy(self) -> bool:
        return any(seq is not None for seq in self._slots)

    def _admit(self) -> None:
        while self._waiting:
            if self._waiting[0].done:
                self._waiting.popleft()
                continue
            free = [i for i, seq in enumerate(self._slots) if seq is None]
            if not free:
                return
            seq = self._waiting.popleft()
            self._place(seq, free)

    def _place(self, seq: _Seq, free: list[int]) -> None:
        """Into the free slot whose held prefix saves the most of its prompt's prefill, or, with
        none, into the one holding least (so held prefixes last)."""
        prompt = seq.request.prompt
        largest, window = self.steps.config.prefill_buckets[-1], self.steps.prefix_window

        def resumable(slot: int) -> int:
            held = self._held[slot]
            n = min(len(held), len(prompt) - 1)  # the last prompt token runs: its logits sample
            differ = np.flatnonzero(held[:n] != prompt[:n])
            prefix = int(differ[0]) if differ.size else n
            # A prefix of a whole largest chunk or more resumes whole, the rest prefilling alone;
            # a shorter one as far as a packed prefill reaches, so prompts that arrive together
            # still prefill in one call (resuming a 24-token system prompt alone, outside the
            # pack, cost a benchmark a sixth of its rate).
            return prefix if prefix >= largest else min(prefix, window)

        reuse = {slot: resumable(slot) for slot in free} if self.steps.resumes_prefixes else {}
        best = max(free, key=lambda slot: (reuse.get(slot, 0), -len(self._held[slot])))
        seq.prefilled = reuse.get(best, 0)
        seq.slot = best
        self._slots[best] = seq
        self._held[best] = _NOTHING

    def _abort(self, seqs: list[_Seq], reason: str, message: str) -> None:
        """End `seqs` without a token; each request hears once, with all its choices at once."""
        by_request: dict[int, tuple[Sink, list[TokenEvent]]] = {}
        for seq in seqs:
            if seq.done:
                continue
            self._finish(seq)
            event = TokenEvent(seq.choice, -1, 0.0, (), reason, None, self.version, message)
            by_request.setdefault(id(seq.request), (seq.request.sink, []))[1].append(event)
        for sink, events in by_request.values():
            _deliver(sink, events)

    def _step_failed(self, err: Exception, requests: list[_Request]) -> None:
        """A device step raised: fail the requests it ran, or every slot if it ate the cache.

        A step donates the cache; if the failure consumed it, every prefilled row is gone, so
        the sequences in slots fail (503, retry) and the cache is rebuilt. Queued requests keep
        their place either way.
        """
        log.error("engine step failed for %d request(s): %r", len(requests), err)
        if self.steps.cache_lost():
            self.steps.reset_cache()
            self._forget_held()
            lost = self._seqs_of(self._running())
            return self._abort(lost, "abort", f"the engine lost its cache: {err}")
        reason = "error" if len(requests) == 1 else "abort"
        self._abort(self._seqs_of(requests), reason, f"the engine failed on this request: {err}")

    def _running(self) -> list[_Request]:
        return list({id(s.request): s.request for s in self._slots if s is not None}.values())

    @staticmethod
    def _seqs_of(requests: list[_Request]) -> list[_Seq]:
        return [seq for request in requests for seq in request.seqs]

    def _finish(self, seq: _Seq, held: bool = False) -> None:
        """Release a sequence's slot; with `held` (it ended normally), remember what its cache
        holds: the prompt and every sampled token but the last, which no step has fed."""
        if seq.done:
            return
        seq.done = True
        if seq.slot >= 0 and self._slots[seq.slot] is seq:
            self._slots[seq.slot] = None
            if seq.request.source_slot == seq.slot:
                seq.request.source_slot = -1
            if held and self.steps.resumes_prefixes:
                tokens = np.asarray(seq.sampled[:-1], np.int32)
                self._held[seq.slot] = np.concatenate([seq.request.prompt, tokens])

    def _prefill_one(self) -> None:
        """One prefill step: a copy from a sibling, whole prompts packed into one chunk, or the
        next chunk of the oldest sequence still prefilling."""
        pending = [s for s in self._slots if s is not None and s.prefilled < len(s.request.prompt)]
        if not pending:
            return
        seq = min(pending, key=lambda s: (s.request.prompt_logits is None, s.slot))
        pack = self._pack(pending) if seq.request.prompt_logits is None else []
        if len(pack) > 1:
            return self._prefill_pack(pack)
        try:
            sampled = self._prefill_seq(seq)
        except Exception as err:  # only this request ran in the step
            return self._step_failed(err, [seq.request])
        if sampled is not None:
            self._emit([(seq, *sampled)])

    def _pack(self, pending: list[_Seq]) -> list[_Seq]:
        """Unstarted whole prompts (or resumed within the prefix window), one choice per request
        (its siblings copy it), in slot order, while their new tokens fit one chunk together."""
        pack: list[_Seq] = []
        total, requests = 0, set()
        for seq in sorted(pending, key=lambda s: s.slot):
            request = seq.request
            if (
                seq.prefilled > self.steps.prefix_window
                or request.solo
                or id(request) in requests
                or request.source_slot >= 0
            ):
                continue
            new = len(request.prompt) - seq.prefilled
            if self.steps.pack_size(total + new) is None:
                continue  # a long prompt is chunked on its own; a shorter one may still fit
            pack.append(seq)
            total += new
            requests.add(id(request))
        return pack

    def _prefill_pack(self, pack: list[_Seq]) -> None:
        try:
            logits = self.steps.prefill_packed(
                [(s.slot, s.request.prompt, s.prefilled) for s in pack]
            )
            sampled = [
                self.steps.sample_first(prompt_logits, s.request.params, s.key, s.choice)
                for s, prompt_logits in zip(pack, logits, strict=True)
            ]
        except Exception as err:
            if self.steps.cache_lost():
                return self._step_failed(err, [s.request for s in pack])
            # Which prompt failed is unknown: each prefills alone from now on, so a failure
            # fails only its own request, as an unpacked prefill's does.
            log.warning(
                "packed prefill of %d prompts failed (%r); prefilling each alone", len(pack), err
            )
            for seq in pack:
                seq.request.solo = True
            return
        for seq, prompt_logits in zip(pack, logits, strict=True):
            seq.prefilled, seq.request.prompt_logits = len(seq.request.prompt), prompt_logits
            seq.request.source_slot = seq.slot
        self._emit([(seq, *row) for seq, row in zip(pack, sampled, strict=True)])

    def _prefill_seq(self, seq: _Seq) -> Any:
        request = seq.request
        if (
            request.prompt_logits is not None
            and request.source_slot >= 0
            and self.steps.copies_prompts
        ):
            self.steps.copy_slot(request.source_slot, seq.slot)
            seq.prefilled = len(request.prompt)
        else:
            seq.prefilled, logits = self.steps.prefill_chunk(
                seq.slot, request.prompt, seq.prefilled
            )
            if seq.prefilled < len(request.prompt):
                return None
            request.prompt_logits = logits
        if request.source_slot < 0:
            request.source_slot = seq.slot
        return self.steps.sample_first(request.prompt_logits, request.params, seq.key, seq.choice)

    def _decode_step(self) -> None:
        active = [s for s in self._slots if s is not None and s.generated > 0 and not s.done]
        if not active:
            return
        try:
            out = self.steps.decode(active)
        except Exception as err:
            requests = list({id(s.request): s.request for s in active}.values())
            return self._step_failed(err, requests)
        self._emit([(seq, *row) for seq, row in zip(active, out, strict=True)])

    def _emit(self, rows: list[tuple[_Seq, int, float, Any, Any]]) -> None:
        by_request: dict[int, list[TokenEvent]] = {}
        sinks: dict[int, Sink] = {}
        for seq, token, logprob, top_ids, top_lps in rows:
            request, params = seq.request, seq.request.params
            seq.sampled.append(token)
            reason, stop = None, None
            if token in request.eos:
                reason = "stop"
            elif token in params.stop_token_ids:
                reason, stop = "stop", token
            elif seq.generated >= request.max_tokens:
                reason = "length"
            k = params.logprobs or 0
            top = tuple(zip(top_ids[:k].tolist(), top_lps[:k].tolist(), strict=True)) if k else ()
            event = TokenEvent(seq.choice, token, float(logprob), top, reason, stop, self.version)
            by_request.setdefault(id(request), []).append(event)
            sinks[id(request)] = request.sink
            if reason is not None:
                self._finish(seq, held=True)
        for key, events in by_request.items():
            _deliver(sinks[key], events)
