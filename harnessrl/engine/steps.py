"""Engine stage, device programs: the jitted prefill-chunk, decode, first-token and slot-copy steps.

In: host-side slot assignments (token ids, positions, sampling settings). Out: sampled tokens and
their raw logprobs. Holds the params and the KV cache; every program has a fixed shape, and
`compile_count` counts compiled executables so tests can assert that serving never recompiles.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from harnessrl.engine import cpu_kernels
from harnessrl.engine.sampler import SamplingParams, sample_tokens
from harnessrl.model import bf16_bits, registry
from harnessrl.model.hooks import DecodeKernels
from harnessrl.model.registry import AnyDecoder

SampleOut = tuple[int, float, np.ndarray, np.ndarray]  # token, logprob, top ids, top logprobs
Logits = tuple[jax.Array, int]  # a prefill's `[num_slots, vocab]` logits block and the row to read
Cache = Any  # the model family's serving cache (`registry.Family.cache`)


class EngineConfig(Protocol):
    """What the engine reads of its config (the serving stage's `ServeConfig` provides it)."""

    @property
    def num_slots(self) -> int: ...  # KV-cache rows: sequences decoded at once
    @property
    def max_model_len(self) -> int: ...
    @property
    def prefill_buckets(self) -> tuple[int, ...]: ...
    @property
    def decode_lengths(self) -> tuple[int, ...]: ...
    @property
    def max_waiting(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def policy_version(self) -> int: ...
    @property
    def weight_dtype(self) -> str: ...  # float32 | bfloat16 (held as bits, see model.bf16_bits)
    @property
    def cpu_kernels(self) -> bool: ...  # decode steps through engine.cpu_kernels where they run
    @property
    def prefix_caching(self) -> bool: ...  # prompts start from what a free slot still holds
    @property
    def prefix_window(self) -> int: ...  # held tokens a packed prompt can resume after


class DeviceSteps:
    """The serving model's params + KV cache and the compiled programs that touch them."""

    def __init__(self, model: AnyDecoder, config: EngineConfig) -> None:
        family = registry.of(model)
        if config.weight_dtype == "bfloat16" and not family.serves_bf16_weights:
            served = " / ".join(f.label for f in registry.FAMILIES if f.serves_bf16_weights)
            raise ValueError(
                f"weight_dtype='bfloat16' serves the {served} decoder; serve the "
                f"{family.label} family with weight_dtype='float32'"
            )
        cfg = model.cfg
        self.config = config
        self.vocab_size = cfg.vocab_size
        # Params are swappable; the rest (RoPE tables) is fixed for the life of the engine.
        self.graphdef, state, *rest = nnx.split(model, nnx.Param, ...)
        self._rest = jax.tree.map(jnp.asarray, rest[0])
        if config.weight_dtype == "bfloat16":
            # Swaps cast to the serving dtype (`conform_params`), so they keep the bits too.
            state = jax.tree.map(bf16_bits.to_bits, state)
        # Commit every device input to an explicit placement: jit keys its executables on
        # committed-ness too, and jit outputs (the cache after a step, swapped params) are committed.
        self.state = jax.tree.map(lambda x: jax.device_put(x, x.sharding), state)
        device = jax.tree.leaves(self.state)[0].sharding
        self._device = jax.sharding.SingleDeviceSharding(next(iter(device.device_set)))
        self._model_config = cfg
        self._cache_type = family.cache
        # A recurrent state holds its slot's latest token, not the prompt's end: a sibling
        # choice copied from it later would start mid-answer, so each choice prefills instead.
        self.copies_prompts = not family.recurrent
        # For the same reason only a KV cache can be resumed after a held prefix.
        self.resumes_prefixes = self.copies_prompts and config.prefix_caching
        # First chunks of several prompts go through one packed call (`prefill_packed`); a
        # recurrent state cannot restart mid-row, so a recurrent family prefills one prompt at a
        # time, and so does a decoder subclass that overrides `decode`: it is served through its own.
        own_decode = type(model).decode is family.decoder.decode
        self.packs_prompts = not family.recurrent and own_decode
        # A packed chunk may resume after up to this many tokens its slot holds (0: packs hold
        # first chunks only); every packed call then reads that window of every slot.
        self.prefix_window = (
            min(config.prefix_window, config.prefill_buckets[-1])
            if self.resumes_prefixes and self.packs_prompts
            else 0
        )
        self.cache = self._new_cache()
        # Decode steps multiply a few rows by every weight and read each slot's cache once: the C++
        # kernels stream both faster than XLA:CPU's ops. Only a family's own `decode` that takes
        # them does, in float32; prefill stays on XLA.
        self._kernels: DecodeKernels | None = None
        if (
            config.cpu_kernels
            and family.decode_kernels
            and own_decode
            and config.num_slots <= cpu_kernels.MAX_SLOTS
            and cfg.compute_jnp_dtype == jnp.float32
            and cpu_kernels.load(getattr(next(iter(self._device.device_set)), "platform", None))
        ):
            self._kernels = cpu_kernels.KERNELS
        self.traces = 0
        self._decode = jax.jit(
            self._counted(self._decode_fn), static_argnums=(0,), donate_argnums=(2,)
        )
        self._prefill = jax.jit(
            self._counted(self._prefill_fn), static_argnums=(0,), donate_argnums=(2,)
        )
        self._packed = jax.jit(self._counted(self._packed_fn), donate_argnums=(1,))
        self._copy = jax.jit(self._counted(self._copy_fn), donate_argnums=(0,))
        self._first = jax.jit(self._counted(self._first_fn))

    def _new_cache(self) -> Cache:
        cache = self._cache_type.create(
            self._model_config,  # the family's cache takes its config
            slots=self.config.num_slots,
            max_len=self.config.max_model_len,
        )
        return jax.device_put(cache, self._device)

    def cache_lost(self) -> bool:
        """True if a failed step consumed the donated cache (its buffers are gone)."""
        return any(leaf.is_deleted() for leaf in jax.tree.leaves(self.cache))

    def reset_cache(self) -> None:
        """A fresh, empty cache placed like the first one (so nothing recompiles)."""
        self.cache = self._new_cache()

    def check_sampling(self, params: SamplingParams) -> None:
        """ValueError if `params` cannot be laid into the sampler's per-row arrays.

        Run when a request is submitted, so a setting that would fail a step shared with other
        requests (an int32 overflow, a NaN) is refused on its own.
        """
        try:
            with np.errstate(all="raise"):
                rows = self._sampling([(params, np.zeros(2, np.uint32), 0, 0)], 1)
        except (OverflowError, ValueError, TypeError, FloatingPointError) as err:
            raise ValueError(f"sampling settings cannot run: {err}") from err
        if not all(np.isfinite(x).all() for x in rows[:4]):
            raise ValueError(f"sampling settings must be finite numbers, got {params!r:.300}")
        if params.n < 1 or (params.logprobs is not None and params.logprobs < 0):
            raise ValueError(f"n must be >= 1 and logprobs >= 0, got {params!r:.300}")

    def _counted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def traced(*args: Any) -> Any:
            self.traces += 1  # runs only while jax traces
            return fn(*args)

        return traced

    @property
    def compile_count(self) -> int:
        """Executables compiled so far. A new input placement compiles without retracing, so
        this counts jit's executable caches (falling back to traces if jax lacks the hook)."""
        programs = (self._decode, self._prefill, self._packed, self._copy, self._first)
        if all(hasattr(p, "_cache_size") for p in programs):
            return sum(p._cache_size() for p in programs)  # type: ignore[attr-defined]
        return self.traces

    # ---- traced functions -------------------------------------------------------------------

    def _decode_fn(
        self,
        length: int,
        state: nnx.State,
        cache: Cache,
        tokens_s: jax.Array,
        positions_s: jax.Array,
        sampling: tuple[jax.Array, ...],
    ) -> tuple[Any, ...]:
        # Attends over the first `length` cache positions only: a step then costs what the
        # longest live sequence needs, not max_model_len.
        model = nnx.merge(self.graphdef, state, self._rest)
        kernel: dict[str, Any] = {} if self._kernels is None else {"kernels": self._kernels}
        logits_s1v, cache = model.decode(
            tokens_s[:, None], positions_s[:, None], cache, length=length, **kernel
        )
        return (cache, *sample_tokens(logits_s1v[:, 0], *sampling))

    def _prefill_fn(
        self,
        length: int,
        state: nnx.State,
        cache: Cache,
        slot: jax.Array,
        tokens_c: jax.Array,
        positions_c: jax.Array,
        last: jax.Array,
    ) -> tuple[Cache, jax.Array]:
        # One slot's row only, so a chunk costs its own tokens; logits only for the last one,
        # in row 0 of the `[num_slots, vocab]` block the first-token sampler reads.
        model = nnx.merge(self.graphdef, state, self._rest)
        logits_11v, cache = model.decode(
            tokens_c[None], positions_c[None], cache, slot=slot, length=length, last=last
        )
        return cache, self._rows(logits_11v[0])

    def _packed_fn(
        self,
        state: nnx.State,
        cache: Cache,
        tokens_c: jax.Array,
        positions_c: jax.Array,
        segments_c: jax.Array,
        slots_c: jax.Array,
        last_n: jax.Array,
        held_n: jax.Array,
    ) -> tuple[Cache, jax.Array]:
        model = nnx.merge(self.graphdef, state, self._rest)
        assert self.packs_prompts
        logits_1nv, cache = model.prefill_packed(
            tokens_c[None],
            positions_c[None],
            segments_c[None],
            slots_c[None],
            cache,
            last_n=last_n,
            held_n=held_n,
            window=self.prefix_window,
        )
        return cache, logits_1nv[0]

    def _rows(self, logits_1v: jax.Array) -> jax.Array:
        """`[1, vocab]` logits as row 0 of the `[num_slots, vocab]` block, so every prefill hands
        the first-token sampler one shape."""
        rows_nv = jnp.zeros((self.config.num_slots, logits_1v.shape[-1]), logits_1v.dtype)
        return rows_nv.at[0].set(logits_1v[0])

    def _copy_fn(self, cache: Cache, src: jax.Array, dst: jax.Array) -> Cache:
        def copy(x_lb: jax.Array) -> jax.Array:  # every cache array has its slots on axis 1
            row = jax.lax.dynamic_slice_in_dim(x_lb, src, 1, axis=1)
            return jax.lax.dynamic_update_slice_in_dim(x_lb, row, dst, axis=1)

        return jax.tree.map(copy, cache)

    def _first_fn(
        self, logits_nv: jax.Array, row: jax.Array, sampling: tuple[jax.Array, ...]
    ) -> tuple[jax.Array, ...]:
        return sample_tokens(jax.lax.dynamic_slice_in_dim(logits_nv, row, 1), *sampling)

    # ---- host-side calls --------------------------------------------------------------------

    @staticmethod
    def _sampling(
        rows: Sequence[tuple[SamplingParams, np.ndarray, int, int]], size: int
    ) -> tuple[np.ndarray, ...]:
        """Per-row sampler inputs; rows beyond `rows` are idle (greedy, ignored)."""
        temp, top_p = np.zeros(size, np.float32), np.ones(size, np.float32)
        top_k, min_p = np.zeros(size, np.int32), np.zeros(size, np.float32)
        keys, salts, steps = (
            np.zeros((size, 2), np.uint32),
            np.zeros(size, np.int32),
            np.zeros(size, np.int32),
        )
        for i, (params, key, salt, step) in enumerate(rows):
            temp[i], top_p[i], top_k[i], min_p[i] = (
                params.temperature,
                params.top_p,
                params.top_k,
                params.min_p,
            )
            keys[i], salts[i], steps[i] = key, salt, step
        return temp, top_p, top_k, min_p, keys, salts, steps

    def decode(self, seqs: Sequence[Any]) -> list[SampleOut]:
        """One token for each given sequence (objects with slot, last_token, request, generated...)."""
        n = self.config.num_slots
        tokens, positions = np.zeros(n, np.int32), np.full(n, -1, np.int32)
        rows: list[tuple[SamplingParams, np.ndarray, int, int]] = [
            (SamplingParams(temperature=0.0), np.zeros(2, np.uint32), 0, 0)
        ] * n
        for seq in seqs:
            tokens[seq.slot] = seq.last_token
            positions[seq.slot] = len(seq.request.prompt) + seq.generated - 1
            rows[seq.slot] = (seq.request.params, seq.key, seq.choice, seq.generated)
        needed = int(positions.max()) + 1
        length = next(b for b in self.config.decode_lengths if b >= needed)
        self.cache, token_s, lp_s, ids_sk, lps_sk = self._decode(
            length, self.state, self.cache, tokens, positions, self._sampling(rows, n)
        )
        token_s, lp_s, ids_sk, lps_sk = (np.asarray(x) for x in (token_s, lp_s, ids_sk, lps_sk))
        return [
            (int(token_s[s.slot]), float(lp_s[s.slot]), ids_sk[s.slot], lps_sk[s.slot])
            for s in seqs
        ]

    def bucket(self, remaining: int) -> int:
        buckets = self.config.prefill_buckets
        return next((b for b in buckets if b >= remaining), buckets[-1])

    def prefill_chunk(self, slot: int, prompt: np.ndarray, start: int) -> tuple[int, Logits]:
        """Write the next chunk of `prompt` (from `start`) into `slot`; → (new start, last logits).

        A first chunk, or one after a held prefix within `prefix_window`, is padded to a bucket and
        attends over itself (and that prefix); a continuation (prompts longer than the largest
        bucket, or the rest after a longer held prefix) attends over the whole row, in the largest
        bucket, or, where prefixes resume, the smallest that holds the rest.
        """
        if start <= self.prefix_window and self.packs_prompts:  # a pack of one: any pack's programs
            head = prompt[: start + self.config.prefill_buckets[-1]]
            (logits,) = self.prefill_packed([(slot, head, start)])
            return len(head), logits
        if start == 0:
            size = length = self.bucket(len(prompt))
        else:
            size, length = self._continuation(len(prompt) - start), self.config.max_model_len
        return self._chunk(slot, prompt, start, size, length)

    def _chunk(
        self, slot: int, prompt: np.ndarray, start: int, size: int, length: int
    ) -> tuple[int, Logits]:
        real = min(size, len(prompt) - start)
        tokens = np.zeros(size, np.int32)
        tokens[:real] = prompt[start : start + real]
        positions = np.full(size, -1, np.int32)
        positions[:real] = np.arange(start, start + real, dtype=np.int32)
        self.cache, logits_nv = self._prefill(
            length, self.state, self.cache, np.int32(slot), tokens, positions, np.int32(real - 1)
        )
        return start + real, (logits_nv, 0)

    def _continuation(self, remaining: int) -> int:
        if self.resumes_prefixes:
            return self.bucket(remaining)
        return self.config.prefill_buckets[-1]

    def pack_size(self, tokens: int) -> int | None:
        """The bucket a pack of this many new tokens needs, or None if they must be chunked."""
        largest = self.config.prefill_buckets[-1]
        if not self.packs_prompts or tokens > largest:
            return None
        return self.bucket(tokens)

    def prefill_packed(self, prompts: Sequence[tuple[int, np.ndarray, int]]) -> list[Logits]:
        """Whole prompts `(slot, ids, start)`, at most `num_slots`, each resuming after the first
        `start` (at most `prefix_window`) tokens its slot holds, with at most the largest bucket of
        new tokens in all, written into their slots in one call; → each one's last logits."""
        total = sum(len(ids) - start for _, ids, start in prompts)
        if not 0 < len(prompts) <= self.config.num_slots or self.pack_size(total) is None:
            raise ValueError(f"cannot pack {len(prompts)} prompts of {total} tokens in one chunk")
        if any(
            not 0 <= start < len(ids) or start > self.prefix_window for _, ids, start in prompts
        ):
            raise ValueError(
                f"a packed prompt resumes after 0..{self.prefix_window} held tokens and keeps one "
                f"to run, got starts {[start for *_, start in prompts]}"
            )
        size = self.bucket(total)
        tokens, positions = np.zeros(size, np.int32), np.zeros(size, np.int32)
        segments, slots = np.zeros(size, np.int32), np.zeros(size, np.int32)
        last_n, held_n = (np.zeros(self.config.num_slots, np.int32) for _ in range(2))
        at = 0
        for n, (slot, ids, start) in enumerate(prompts):
            end = at + len(ids) - start
            tokens[at:end], positions[at:end] = ids[start:], np.arange(start, len(ids))
            segments[at:end], slots[at:end], last_n[n] = n + 1, slot, end - 1
            held_n[n] = start
            at = end
        self.cache, logits_nv = self._packed(
            self.state, self.cache, tokens, positions, segments, slots, last_n, held_n
        )
        return [(logits_nv, n) for n in range(len(prompts))]

    def copy_slot(self, src: int, dst: int) -> None:
        self.cache = self._copy(self.cache, np.int32(src), np.int32(dst))

    def sample_first(
        self, logits: Logits, params: SamplingParams, key: np.ndarray, salt: int
    ) -> SampleOut:
        logits_nv, row = logits
        out = self._first(logits_nv, np.int32(row), self._sampling([(params, key, salt, 0)], 1))
        token, lp, ids, lps = (np.asarray(x)[0] for x in out)
        return int(token), float(lp), ids, lps

    def warm_up(self) -> None:
        """Run each program once so the first requests do not pay for compilation."""
        logits = None
        for size in self.config.prefill_buckets:
            if self.packs_prompts:
                (logits,) = self.prefill_packed([(0, np.zeros(size, np.int32), 0)])
            else:
                _, logits = self.prefill_chunk(0, np.zeros(size, np.int32), 0)
        # Continuation chunks (after a held prefix, or past the largest bucket), every size used.
        for size in sorted({self._continuation(b) for b in self.config.prefill_buckets}):
            if size < self.config.max_model_len:
                prompt = np.zeros(size + 1, np.int32)
                _, logits = self._chunk(0, prompt, 1, size, self.config.max_model_len)
        assert logits is not None
        self.sample_first(logits, SamplingParams(), np.zeros(2, np.uint32), 0)
        self.copy_slot(0, 0)
        for length in self.config.decode_lengths:
            self._warm_decode(length)
        jax.block_until_ready(self.cache)

    def _warm_decode(self, length: int) -> None:
        n = self.config.num_slots
        rows = [(SamplingParams(), np.zeros(2, np.uint32), 0, 0)] * n
        tokens, positions = np.zeros(n, np.int32), np.full(n, -1, np.int32)
        self.cache, *_ = self._decode(
            length, self.state, self.cache, tokens, positions, self._sampling(rows, n)
        )
