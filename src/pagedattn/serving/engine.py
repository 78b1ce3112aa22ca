"""Continuous batching over a :class:`PagedKVCache`: requests join and leave between steps.

Each :meth:`Engine.step` is either a **prefill** (waiting requests that fit are admitted and
their prompts run as one packed varlen pass, giving each its first token) or a **decode** (one
token for every running request, one ``paged_decode`` call per layer, through a
:class:`DecodeRunner`: padded to a batch-size bucket, eager or replayed from a CUDA graph).
Waiting requests are admitted while the batch has room (``max_batch_size``), the prompts of
the step stay within ``max_prefill_tokens`` (one request is always admitted) and the free pages
cover their prompt plus one page of headroom per running sequence. A request finishes at an EOS
token or at its own ``max_new_tokens``; its pages go back to the pool at once and the next
waiting request can use them, so lengths stay ragged and pages are reused.

If a decode step cannot get pages (:class:`CacheFullError`), the most recently admitted
request is preempted: its pages are freed and it goes back to the front of the queue, to be
re-prefilled later from its prompt plus the tokens it already produced (recompute, as vLLM).
Greedy decoding only (argmax; ties go to the lowest token id, as ``torch.argmax``).

Every request ends exactly once, with ``finish_reason`` ``"eos"``, ``"length"`` or
``"abort"``, and is then handed back once, by the next :meth:`Engine.run` (or
:meth:`Engine.take_finished`); the engine keeps no reference to it afterwards. A request that
could never fit (its longest sequence needs more pages than the whole cache) is refused at
:meth:`Engine.add_request` with :class:`CacheFullError`. :meth:`Engine.abort` ends a queued or
running request at once (its pages freed, a token of it still in flight discarded). An
``on_token`` callback that raises aborts its own request; the step finishes for every other
request, and the exception then propagates from :meth:`Engine.step` / :meth:`Engine.run`, the
engine consistent and ready for the next call.

Decode steps overlap the host with the GPU (unless ``keep_logits``): when the running batch is
the one of the step in flight and none of its requests ends by length with that step's token,
the next step is launched first, with its token ids taken from the step in flight on the
device, and only then are the step in flight's tokens read (the one device-to-host sync of a
step). A request that reaches EOS in the step read has one extra step in flight; its token is
dropped, and its pages, freed at once, are only reused by work queued after that step.
"""

from __future__ import annotations

import contextlib
import numbers
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, cast

import torch

from pagedattn._validation import FP8_DTYPES
from pagedattn.serving.cache import CacheFullError, PagedKVCache
from pagedattn.serving.model import Transformer
from pagedattn.serving.runner import DecodeRunner, DecodeStep, buckets_up_to


@dataclass(frozen=True)
class RequestKey:
    """A request's sequence id in the cache: never equal to an id of the caller's own
    sequences in a shared cache (an int request id could be)."""

    engine: int  # id() of the engine
    rid: int

    def __repr__(self) -> str:
        return f"request {self.rid}"


@dataclass(frozen=True)
class PrefixKey:
    """A cached prefix's sequence id in the cache (:meth:`Engine.add_prefix`)."""

    engine: int  # id() of the engine
    pid: int


@dataclass
class Request:
    """One generation request. ``output`` grows by one token per step it takes part in."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    key: RequestKey | None = None  # its sequence id in the cache (set by the engine)
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "eos", "length" or "abort" once done
    preemptions: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)  # fp32 [vocab] per token, if kept
    first_token_s: float = 0.0  # perf_counter() when the first token came
    finish_s: float = 0.0  # perf_counter() when it finished
    prefix: int | None = None  # the cached prefix it starts with (Engine.add_prefix)
    pending: list[int] | None = None  # tokens still to prefill, chunk by chunk (extend)

    @property
    def time_per_output_token(self) -> float | None:
        """Seconds per token after the first (None with fewer than two tokens)."""
        n = len(self.output) - 1
        return (self.finish_s - self.first_token_s) / n if n > 0 else None


@dataclass
class EngineStats:
    prefill_steps: int = 0
    extend_steps: int = 0  # of them, chunks over the paged cache (Transformer.extend)
    decode_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    max_running: int = 0
    preemptions: int = 0
    #: tokens of a request that had already finished: the host launches step k + 1 before it
    #: reads step k, so a request that meets its end in step k has one more token in flight
    discarded_tokens: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


class Engine:
    """Greedy continuous-batching generator.

    Args:
        model: a :class:`Transformer` (paged attention), or any object with its ``cfg``,
            ``dtype``, ``device``, ``prefill``, ``extend`` and ``decode`` (the tests' fake model).
        cache: a :class:`PagedKVCache` shaped for it (empty, or holding other sequences):
            the model's ``num_layers``, ``num_kv_heads``, ``head_dim`` and device, the
            model's dtype or an fp8 dtype. Else ValueError naming the mismatch.
        max_batch_size: most sequences decoded together (1..256).
        eos_token_ids: tokens that end a request (kept in its output).
        keep_logits: store each produced token's logits (fp32, on the host) in its request.
        graphs: decode by CUDA-graph replay (CUDA only); else eagerly.
        compile: decode through ``torch.compile`` (see :mod:`pagedattn.serving.runner`).
        max_model_len: longest sequence (prompt + new tokens) a request may reach; sets the
            block-table width of decode steps. Default: the model's context length.
        max_prefill_tokens: prompt tokens per prefill step. A longer prompt prefills in chunks
            of at most this many tokens over the paged cache (``Transformer.extend``), one
            chunk a step, with a decode step of the running batch between two chunks.
    """

    def __init__(self, model: Transformer, cache: PagedKVCache, *, max_batch_size: int = 8,
                 eos_token_ids: Sequence[int] = (), keep_logits: bool = False,
                 graphs: bool = False, compile: bool = False, max_model_len: int | None = None,
                 max_prefill_tokens: int = 8192):
        for name, v in (("max_batch_size", max_batch_size),
                        ("max_prefill_tokens", max_prefill_tokens),
                        ("max_model_len", max_model_len)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
                raise TypeError(f"{name}: expected an int, got {v!r}")
        buckets_up_to(max_batch_size)  # 1..256: ValueError naming max_batch_size
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens: expected >= 1, got {max_prefill_tokens}")
        self.max_model_len = model.cfg.max_position if max_model_len is None else max_model_len
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len: expected >= 2, got {self.max_model_len}")
        _check_cache_fits(model, cache)
        self.model, self.cache = model, cache
        self.max_batch_size, self.max_prefill_tokens = max_batch_size, max_prefill_tokens
        max_pages = min(-(-self.max_model_len // cache.page_size), cache.num_pages)
        self.runner = DecodeRunner(model, cache, max_batch_size=max_batch_size,
                                   max_pages=max_pages, graphs=graphs, compile=compile)
        self.eos = set(eos_token_ids)
        self.keep_logits = keep_logits
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # ended requests not handed back yet (run() and take_finished() empty it)
        self.finished: dict[int, Request] = {}
        self._live: dict[int, Request] = {}  # queued or running, by request id
        self.stats = EngineStats()
        self._next_rid = 0
        self.on_token: Callable[[Request, int], None] | None = None
        self._callback_errors: list[BaseException] = []  # raised by on_token in this step
        # the decode step launched but not read yet (its requests, in batch order)
        self._inflight: tuple[list[Request], DecodeStep] | None = None
        # the request whose prompt prefills chunk by chunk (or after a cached prefix), and
        # whether the running batch decodes before its next chunk
        self.extending: Request | None = None
        self._decode_turn = False
        # cached prefixes (add_prefix): id -> (its cache sequence, its tokens)
        self.prefixes: dict[int, tuple[PrefixKey, list[int]]] = {}
        self._next_prefix = 0

    def add_prefix(self, tokens: Sequence[int]) -> int:
        """Prefill ``tokens`` now into a cache sequence of their own, kept until
        :meth:`drop_prefix`, and return its id: a request that starts with them
        (``add_request(..., prefix=id)``) shares its pages (a fork) and prefills only the
        rest of its prompt over them. Raises as :meth:`add_request` for bad tokens, and
        CacheFullError when the pages are not free now."""
        tokens = self._checked_tokens("tokens", tokens)
        pid = self._next_prefix
        key = PrefixKey(id(self), pid)
        self._drain()
        self.cache.add_sequence(key)
        try:
            meta = self.cache.prepare_step([key], [len(tokens)])
            with torch.inference_mode():
                self.model.prefill(torch.tensor(tokens, dtype=torch.long).to(self.model.device),
                                   meta, self.cache)
        except BaseException:
            self.cache.free(key)
            raise
        self._next_prefix += 1
        self.prefixes[pid] = (key, tokens)
        return pid

    def drop_prefix(self, prefix: int) -> None:
        """Release a cached prefix's own hold on its pages (requests forked from it keep
        theirs). Raises KeyError for an unknown id."""
        key, _ = self.prefixes.pop(prefix)
        self.cache.free(key)

    def _checked_tokens(self, name: str, prompt) -> list[int]:
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise TypeError(f"{name}: expected a sequence of token ids, got "
                            f"{type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError(f"{name}: expected at least one token")
        vocab = self.model.cfg.vocab_size
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise TypeError(f"{name}: expected int token ids, got {t!r} at {i}")
            if not 0 <= t < vocab:
                raise ValueError(f"{name}: expected token ids in [0, {vocab}), got {t} at {i}")
        return [int(t) for t in prompt]

    def add_request(self, prompt: Sequence[int], max_new_tokens: int, *,
                    prefix: int | None = None) -> int:
        """Queue a prompt (token ids); returns its request id. Raises TypeError for a
        token or count that is not an int, ValueError for an empty prompt, a token outside
        ``[0, vocab_size)``, ``max_new_tokens < 1`` or a total over ``max_model_len``
        (checked here: a bad token found at prefill would strand the request), and
        CacheFullError for a request that could never fit: the ``prompt + max_new_tokens -
        1`` tokens it writes need more pages than the whole cache holds (the error gives
        both counts). ``prefix``: the id of a cached prefix (:meth:`add_prefix`) that the
        prompt starts with and outgrows; only the rest is prefilled (ValueError naming
        ``prefix`` otherwise, KeyError for an unknown id)."""
        prompt = self._checked_tokens("prompt", prompt)
        if prefix is not None:
            if prefix not in self.prefixes:
                raise KeyError(f"prefix: no cached prefix {prefix!r} (add_prefix)")
            head = self.prefixes[prefix][1]
            if len(prompt) <= len(head) or prompt[:len(head)] != head:
                raise ValueError(f"prefix: expected a prompt that starts with prefix "
                                 f"{prefix}'s {len(head)} tokens and has more")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
            raise TypeError(f"max_new_tokens: expected an int, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
        if len(prompt) + max_new_tokens > self.max_model_len:
            raise ValueError(f"max_new_tokens: prompt ({len(prompt)}) + max_new_tokens "
                             f"({max_new_tokens}) exceeds max_model_len {self.max_model_len}")
        # its last token is never fed back: the cache holds prompt + max_new_tokens - 1
        longest = len(prompt) + max_new_tokens - 1
        need, limit = self._pages_for(longest), self.runner.max_pages
        if need > limit:
            ps, pool = self.cache.page_size, self.cache.num_pages
            where = (f"the {pool} pages of the whole cache" if limit == pool else
                     f"the {limit} pages a sequence may hold (max_model_len "
                     f"{self.max_model_len})")
            raise CacheFullError(
                None, longest, need, pool, message=(
                    f"request: prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) "
                    f"needs {need} pages of {ps} tokens, more than {where}: it could never "
                    "run; build the cache with more pages or ask for fewer tokens"))
        rid = self._next_rid
        self._next_rid += 1
        r = Request(rid, prompt, int(max_new_tokens), key=RequestKey(id(self), rid),
                    prefix=prefix)
        self.waiting.append(r)
        self._live[rid] = r
        return rid

    def abort(self, request_id: int) -> bool:
        """End a queued or running request now, as vLLM's ``abort_request``: its pages return
        to the pool, a token of it still in flight is discarded, and it is handed back (once)
        by the next :meth:`run` / :meth:`take_finished` with ``finish_reason == "abort"`` and
        the tokens it had. May be called from an ``on_token`` callback (a stop string).

        Returns True when it aborted the request; False, changing nothing, for a request that
        has already ended (finished or aborted: a no-op, so a late abort is harmless). Raises
        KeyError for an id :meth:`add_request` never returned, TypeError for a non-int id.
        """
        if isinstance(request_id, bool) or not isinstance(request_id, numbers.Integral):
            raise TypeError(f"request_id: expected an int, got {request_id!r}")
        if not 0 <= request_id < self._next_rid:
            raise KeyError(f"request_id: no request {request_id} was added")
        r = self._live.get(int(request_id))
        if r is None:
            return False
        self._retire(r, "abort")
        return True

    def take_finished(self) -> list[Request]:
        """The requests that ended since the last call (or :meth:`run`), in request-id order;
        each is handed back once and the engine forgets it (with its logits)."""
        done, self.finished = self.finished, {}
        return [done[r] for r in sorted(done)]

    def warmup(self) -> None:
        """Compile (eager) or capture (graphs) the decode step of every batch bucket now, so
        that no timed step pays for it (see :meth:`DecodeRunner.warmup`)."""
        self.runner.warmup()

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running and self.extending is None

    def run(self, on_token: Callable[[Request, int], None] | None = None) -> list[Request]:
        """Step until no request is queued or running; returns every request that ended since
        the last call (finished or aborted), in request-id order, each once.

        ``on_token(request, token)`` is called for each token appended. If it raises, that
        request is aborted, the step completes for the others, and the exception propagates;
        a later call goes on, and hands back the requests that ended meanwhile."""
        self.on_token = on_token
        while not self.done:
            self.step()
        with self._callbacks_checked():
            self._drain()  # a step launched for requests that all met EOS meanwhile
        return self.take_finished()

    @contextlib.contextmanager
    def _callbacks_checked(self) -> Iterator[None]:
        """Re-raise the first ``on_token`` exception of the block once the block is done (the
        engine consistent: those requests aborted); an error of the block itself wins."""
        try:
            yield
        finally:
            errors, self._callback_errors = self._callback_errors, []
        if errors:
            if len(errors) > 1:
                errors[0].add_note(f"on_token raised for {len(errors) - 1} more request(s) "
                                   "of the step; each was aborted")
            raise errors[0]

    def _retire(self, r: Request, reason: str, now: float | None = None) -> None:
        """End ``r`` (queued or running): free its pages, queue it to be handed back."""
        r.finish_reason = reason
        r.finish_s = time.perf_counter() if now is None else now
        if r in self.running:
            self.cache.free(r.key)
            self.running.remove(r)
        elif r is self.extending:  # its chunks so far return their pages
            self.cache.free(r.key)
            self.extending, r.pending = None, None
        elif r in self.waiting:
            self.waiting.remove(r)
        del self._live[r.rid]
        self.finished[r.rid] = r

    # -- one scheduler iteration ---------------------------------------------------------
    def step(self) -> None:
        """Prefill admitted requests if any fit, else decode the running batch. Raises
        CacheFullError when a single request cannot fit even in an otherwise empty cache
        (pages held by the caller's own sequences), and whatever an ``on_token`` callback
        raised (see :meth:`run`)."""
        with self._callbacks_checked():
            self._step()

    def _step(self) -> None:
        if self.extending is not None:  # a chunk, or a decode step of the others first
            if self.running and self._decode_turn:
                self._decode()
            else:
                self._drain()  # its callbacks may abort the extending request
                if self.extending is not None:
                    self._extend_chunk()
            self._decode_turn = not self._decode_turn
            return
        admitted = self._admit()
        if admitted:
            self._drain()  # a decode step in flight gives its tokens first
            # its callbacks may have aborted an admitted request (out of the queue already)
            admitted = [r for r in admitted if r.finish_reason is None]
            if len(admitted) == 1 and self._extends(admitted[0]):
                self._start_extend(admitted[0])
            elif admitted:
                self._prefill(admitted)
        elif self.running:
            self._decode()
        elif self.waiting:
            r = self.waiting[0]
            need = self._pages_for(len(r.prompt) + len(r.output))
            raise CacheFullError(f"request {r.rid}", len(r.prompt) + len(r.output), need,
                                 self.cache.num_free_pages)

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.cache.page_size)

    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        free = self.cache.num_free_pages - len(self.running)  # headroom: a page per runner
        tokens = 0
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            r = self.waiting[0]
            n = len(r.prompt) + len(r.output)
            need = self._pages_for(n) + 1  # headroom for its next token
            if need > free and not self.running and not admitted:
                # alone in the cache: the pages of what it writes before any other request
                # could run (its tokens, and the first decode token if it decodes)
                need = self._pages_for(n + (r.max_new_tokens - len(r.output) > 1))
            if need > free or (admitted and (tokens + n > self.max_prefill_tokens
                                             or self._extends(r))):
                break
            free, tokens = free - need, tokens + n
            admitted.append(self.waiting.popleft())
        return admitted

    def _extends(self, r: Request) -> bool:
        """Whether ``r`` prefills over the paged cache (alone, chunk by chunk): its prompt
        outgrows ``max_prefill_tokens`` or starts with a cached prefix."""
        return r.prefix is not None or len(r.prompt) + len(r.output) > self.max_prefill_tokens

    def _start_extend(self, r: Request) -> None:
        """Give ``r`` its sequence (a fork of its prefix, or a new one) and prefill its first
        chunk; the next chunks come in later steps (:meth:`_extend_chunk`)."""
        tokens = r.prompt + r.output  # a preempted request resumes here
        if r.prefix is not None:
            key, head = self.prefixes[r.prefix]
            self.cache.fork(key, r.key)
            tokens = tokens[len(head):]
        else:
            self.cache.add_sequence(r.key)
        self.extending, r.pending, self._decode_turn = r, tokens, False
        self._extend_chunk()
        self._decode_turn = True

    def _extend_chunk(self) -> None:
        """The next chunk of the extending request's prompt, at most ``max_prefill_tokens``
        tokens, through ``Transformer.extend``; the last chunk gives its first token and
        moves it to the running batch. A chunk that finds no pages preempts the running
        batch's newest request; with none, it returns the request's pages, queues it again
        and raises CacheFullError."""
        r = cast(Request, self.extending)
        t0 = time.perf_counter()
        chunk = cast(list, r.pending)[:self.max_prefill_tokens]
        try:
            meta = self.cache.prepare_step([r.key], [len(chunk)])
        except CacheFullError:  # nothing was reserved: a running request makes room
            if self.running:
                self._preempt(self.running[-1])
                return
            self.cache.free(r.key)
            self.extending, r.pending = None, None
            self.waiting.appendleft(r)
            raise
        try:
            with torch.inference_mode():
                logits = self.model.extend(
                    torch.tensor(chunk, dtype=torch.long).to(self.model.device), meta,
                    self.cache)
        except BaseException:  # it waits again from the start; its pages return
            self.cache.free(r.key)
            self.extending, r.pending = None, None
            self.waiting.appendleft(r)
            raise
        r.pending = cast(list, r.pending)[len(chunk):]
        self.stats.prefill_steps += 1
        self.stats.extend_steps += 1
        self.stats.prefill_tokens += len(chunk)
        self.stats.prefill_s += time.perf_counter() - t0
        if not r.pending:
            self.extending, r.pending = None, None
            self.running.append(r)
            self.stats.max_running = max(self.stats.max_running, len(self.running))
            self._emit([r], logits.argmax(dim=-1).tolist(), logits)

    def _emit(self, reqs: list[Request], tokens: list[int],
              logits: torch.Tensor | None) -> int:
        """Append each request's next token (``logits`` ``[len(reqs), vocab]`` kept when asked);
        retire the done. A request already ended (an extra step was in flight when it met
        EOS, or it was aborted) drops its token. A callback that raises aborts its request;
        its exception is kept for :meth:`_callbacks_checked`. Returns the number of tokens
        appended."""
        host_logits = logits.float().cpu() if self.keep_logits and logits is not None else None
        now = time.perf_counter()
        emitted = 0
        for i, (r, tok) in enumerate(zip(reqs, tokens, strict=True)):
            if r.finish_reason is not None:
                self.stats.discarded_tokens += 1
                continue
            emitted += 1
            r.output.append(tok)
            if len(r.output) == 1:
                r.first_token_s = now
            if host_logits is not None:
                r.logits.append(host_logits[i])
            if self.on_token is not None:
                try:
                    self.on_token(r, tok)
                except BaseException as e:  # noqa: BLE001 (re-raised after the step)
                    self._callback_errors.append(e)
                    if r.finish_reason is None:
                        self._retire(r, "abort", now)
                if r.finish_reason is not None:  # aborted by (or for) its callback
                    continue
            if tok in self.eos:
                self._retire(r, "eos", now)
            elif len(r.output) >= r.max_new_tokens:
                self._retire(r, "length", now)
        return emitted

    def _prefill(self, reqs: list[Request]) -> None:
        t0 = time.perf_counter()
        tokens = [r.prompt + r.output for r in reqs]  # a preempted request resumes here
        ids = [r.key for r in reqs]
        added = []
        try:
            for sid in ids:
                self.cache.add_sequence(sid)
                added.append(sid)
            meta = self.cache.prepare_step(ids, [len(t) for t in tokens])
            flat = torch.tensor([t for ts in tokens for t in ts], dtype=torch.long)
            with torch.inference_mode():
                logits = self.model.prefill(flat.to(self.model.device), meta, self.cache)
        except BaseException:  # the requests wait again and their pages return
            for sid in added:
                self.cache.free(sid)
            self.waiting.extendleft(reversed(reqs))
            raise
        self.running.extend(reqs)
        # counted before the step's tokens retire anyone (a request may end at its first token)
        self.stats.max_running = max(self.stats.max_running, len(self.running))
        self._emit(reqs, logits.argmax(dim=-1).tolist(), logits)
        self.stats.prefill_steps += 1
        self.stats.prefill_tokens += int(flat.numel())
        self.stats.prefill_s += time.perf_counter() - t0

    @contextlib.contextmanager
    def _decode_clock(self) -> Iterator[None]:
        """Adds the block's time to ``stats.decode_s`` (the one place decode time is counted;
        a block that raises adds nothing)."""
        t0 = time.perf_counter()
        yield
        self.stats.decode_s += time.perf_counter() - t0

    def _decode(self) -> None:
        with self._decode_clock():
            self._decode_step()

    def _decode_step(self) -> None:
        prev, self._inflight = self._inflight, None
        reqs = list(self.running)
        if prev is not None:
            # the same batch, none ending by length with the token in flight: launch the
            # next step (its tokens from the step in flight, on the device), then read
            if prev[0] == reqs and all(len(r.output) + 1 < r.max_new_tokens for r in reqs):
                # pages out: nothing was reserved; read first, then preempt below
                with contextlib.suppress(CacheFullError):
                    self._inflight = (reqs, self.runner.step([r.key for r in reqs], None))
            self._finish(*prev)
            reqs = list(self.running)
            if self._inflight is not None or not reqs:
                return
        while True:
            try:
                step = self.runner.step([r.key for r in reqs], [r.output[-1] for r in reqs])
                break
            except CacheFullError:  # nothing was reserved
                if self.extending is not None:  # a prompt half prefilled gives its pages
                    self._preempt(self.extending)
                    continue
                if len(reqs) == 1:
                    raise
                self._preempt(reqs[-1])
                reqs = list(self.running)
        if self.keep_logits:  # the logits are read before the bucket's next step
            self._finish(reqs, step)
        else:
            self._inflight = (reqs, step)

    def _finish(self, reqs: list[Request], step: DecodeStep) -> None:
        """Read a launched decode step (the sync) and append its tokens."""
        self.stats.decode_steps += 1
        self.stats.decode_tokens += self._emit(reqs, step.token_ids(), step.logits)

    def _drain(self) -> None:
        """Read the decode step in flight, if any."""
        if self._inflight is not None:
            with self._decode_clock():
                prev, self._inflight = self._inflight, None
                self._finish(*prev)

    def _preempt(self, r: Request) -> None:
        """Free ``r``'s pages (running, or extending: its chunks so far) and queue it first
        again: it prefills anew from its prompt and the tokens it has."""
        self.cache.free(r.key)
        if r is self.extending:
            self.extending, r.pending = None, None
        else:
            self.running.remove(r)
        r.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(r)


class GenerateResult(NamedTuple):
    requests: list[Request]  # in prompt order
    stats: EngineStats


def _check_cache_fits(model: Transformer, cache: PagedKVCache) -> None:
    """ValueError naming the first of the cache's shape, dtype and device that does not fit
    ``model`` (a mismatch failed only inside the first prefill)."""
    cfg = model.cfg
    for name, got, want in (("num_layers", cache.num_layers, cfg.num_layers),
                            ("num_kv_heads", cache.num_kv_heads, cfg.num_kv_heads),
                            ("head_dim", cache.head_dim, cfg.head_dim)):
        if got != want:
            raise ValueError(f"cache: {name} {got} does not match the model's {want}")
    if cache.dtype != model.dtype and cache.dtype not in FP8_DTYPES:
        raise ValueError(f"cache: dtype {cache.dtype} does not fit the model: expected its "
                         f"dtype {model.dtype} or an fp8 dtype")
    if cache.kv.device != model.device:
        raise ValueError(f"cache: on {cache.kv.device}, the model on {model.device}")


def generate_greedy(model: Transformer, prompts: Sequence[Sequence[int]],
                    max_new_tokens: int | Sequence[int], *, num_pages: int | None = None,
                    page_size: int = 16, max_batch_size: int = 8,
                    eos_token_ids: Sequence[int] = (), keep_logits: bool = False,
                    cache_dtype: torch.dtype | None = None, graphs: bool = False,
                    compile: bool = False,
                    on_token: Callable[[Request, int], None] | None = None,
                    max_prefill_tokens: int = 8192) -> GenerateResult:
    """Generate for every prompt through an :class:`Engine` on a fresh cache.

    ``num_pages`` defaults to enough for every request at full length, ``max_model_len`` to
    the longest request; ``max_prefill_tokens`` as :class:`Engine`'s (a longer prompt
    prefills chunk by chunk). Returns the finished requests in prompt order and the
    engine's statistics.
    """
    per_req = ([int(max_new_tokens)] * len(prompts) if isinstance(max_new_tokens, int)
               else [int(n) for n in max_new_tokens])
    if num_pages is None:
        num_pages = sum(-(-(len(p) + n) // page_size) + 1
                        for p, n in zip(prompts, per_req, strict=True))
    cache = model.make_cache(num_pages, page_size=page_size, dtype=cache_dtype)
    longest = max(len(p) + n for p, n in zip(prompts, per_req, strict=True))
    engine = Engine(model, cache, max_batch_size=max_batch_size, eos_token_ids=eos_token_ids,
                    keep_logits=keep_logits, graphs=graphs, compile=compile,
                    max_model_len=max(longest, 2), max_prefill_tokens=max_prefill_tokens)
    for p, n in zip(prompts, per_req, strict=True):
        engine.add_request(p, n)
    return GenerateResult(engine.run(on_token), engine.stats)
