"""Generating text across tiers: a decoder plan driven token by token, with an optional draft.

:class:`Generator` drives a decoder plan (``plan.json``'s ``decoder``) through a
:class:`~tierflow.device.client.DeviceClient`: a prefill of the prompt, then one step per
token, each a request of one session whose KV cache stays on the tiers that made it
([Note: session state on a tier] in tierflow/state/store.py). With a draft model
(:class:`LocalDecoder`, run on the device) it speculates ([Note: speculation] in
device/speculation.py): several tokens per round trip, the same greedy output.

[Note: replaying a session]
A tier that no longer holds a session's state at the request's position answers
STATE_LOST (evicted, idle too long, restarted). The device holds what it needs to rebuild
the state: for a decoder, the tokens fed so far; for a streaming model, the chunks sent so
far (``tierflow.device.sessions``). It sends them again from position 0 and goes on: a
decoder's replay is one request (one prefill of every token so far); a stream's is its
chunks again, in order, a window of them in flight, and each tier holds a session's state
while a request of it waits there (``SessionStates.hold`` in tierflow/state/store.py),
so the replay is not evicted chunk by chunk under pressure; one that loses its state all
the same starts over, a few times at most. Each tier starts the session afresh at
position 0, and recomputes exactly what it held, so the answers are the same as without
the loss, later.
"""

from __future__ import annotations

import itertools
import logging
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tierflow.device.client import DeviceClient, SessionRequest
from tierflow.device.results import Result, Ticket
from tierflow.device.speculation import AcceptanceMeter, sample, verify_greedy, verify_sampled
from tierflow.errors import (
    InputError,
    ModelError,
    PlanError,
    StateError,
    TierflowError,
    TransportError,
    UsageError,
    is_missing,
    is_state_lost,
)
from tierflow.greedy import decoder_of_session, session_step
from tierflow.link.spec import LINKS, TIERS
from tierflow.onnxrt.inference import open_session
from tierflow.options import RuntimeOptions
from tierflow.runtime.segment_runner import emulate_slower
from tierflow.state.spec import DecoderSpec, StateSpec
from tierflow.state.store import SessionStates

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"\d+")
#: With ``--fallback draft``, how long a missing tier is waited for before the draft goes on.
FALLBACK_AFTER_S = 2.0


class TierDecoder:
    """The plan's decoder across the tiers, as one session (replayed when a tier lost it).

    :meth:`forward` feeds ``tokens`` after the first ``position`` tokens of the session
    and returns their logits, ``[len(tokens), vocab]``.
    """

    def __init__(
        self, client: DeviceClient, session: str | None = None, *, retry_s: float | None = None
    ) -> None:
        decoder = client.plan.decoder
        if decoder is None:
            raise PlanError(
                f"plan {client.plan_id} is not a decoder plan (its plan.json has no 'decoder'): "
                "plan a decoder exported with its KV cache (past_key_values.N -> present.N)"
            )
        self.client = client
        self.decoder: DecoderSpec = decoder
        self.session = session or f"gen-{uuid.uuid4().hex[:12]}"
        self.fed: list[int] = []  # tokens in the tiers' state, in order
        self.results: list[Result] = []
        self.replays = 0
        self.retries = 0
        #: How long a step is tried again while a tier is missing (restarting, say).
        self.retry_s = client.deadline_s if retry_s is None else retry_s

    @property
    def vocab(self) -> int:
        return self.decoder.vocab

    def forward(self, tokens: Sequence[int], position: int, keep: int = 0) -> np.ndarray:
        """``keep``: the logits of the last ``keep`` tokens only come back (0: all): a
        prefill needs the last one, not one per prompt token."""
        logits = self._answer(tokens, position, keep, choices_only=False)
        return logits.reshape(-1, logits.shape[-1])[-(keep or len(tokens)) :]

    def choose(self, tokens: Sequence[int], position: int, keep: int = 0) -> np.ndarray:
        """The large model's greedy choice (its argmax) at each of the last ``keep``
        positions, ``[keep]``: the tiers answer the choices alone (tier.proto:
        Request.choices_only), 8 bytes a position where the logits take 4 a vocabulary
        entry."""
        return self._choices(self._answer(tokens, position, keep, choices_only=True), tokens, keep)

    @staticmethod
    def choose_together(
        steps: Sequence[tuple[TierDecoder, Sequence[int], int]], keep: int = 0
    ) -> list[np.ndarray | TierflowError]:
        """:meth:`choose` for several sessions of one client at once, from this thread
        ([Note: sessions stepped together] in device/client.py): each step's
        ``(decoder, tokens, position)``. Each session's choices, or its own error. Steps
        that a missing tier failed are tried again together (each while its decoder's
        ``retry_s`` lasts); a step whose tier lost its session is replayed alone, as
        :meth:`choose` replays it."""
        if len({id(decoder.client) for decoder, _, _ in steps}) > 1:
            raise UsageError("sessions stepped together share one DeviceClient")
        answers: dict[int, np.ndarray | TierflowError] = {}
        requests: dict[int, SessionRequest] = {}
        for seat, (decoder, tokens, position) in enumerate(steps):
            try:
                decoder._check(tokens, position)
            except StateError as exc:
                answers[seat] = exc
                continue
            requests[seat] = decoder._request(tokens, position, keep or len(tokens), True)
        if requests:
            client = steps[0][0].client
            decoders = {seat: steps[seat][0] for seat in requests}
            tried = _tries(decoders, requests, client.submit_together)
            for seat, result in tried.items():
                decoder, tokens, position = steps[seat]
                try:
                    answer = decoder._answer(
                        tokens, position, keep, choices_only=True, tried=result
                    )
                    answers[seat] = decoder._choices(answer, tokens, keep)
                except TierflowError as exc:
                    answers[seat] = exc
        return [answers[seat] for seat in range(len(steps))]

    @staticmethod
    def _choices(answer: np.ndarray, tokens: Sequence[int], keep: int) -> np.ndarray:
        if np.issubdtype(answer.dtype, np.floating):  # answered on a path that kept logits
            answer = np.argmax(answer, axis=-1)
        return answer.reshape(-1).astype(np.int64)[-(keep or len(tokens)) :]

    def _answer(
        self,
        tokens: Sequence[int],
        position: int,
        keep: int,
        *,
        choices_only: bool,
        tried: Result | None = None,
    ) -> np.ndarray:
        """The decoder's answer to ``tokens`` fed after ``position``, replayed once if a
        tier lost the session. ``tried``: the step's result, if it was sent already."""
        keep = keep or len(tokens)
        self._check(tokens, position)
        result = tried
        if result is None:
            result = self._submit(self._request(tokens, position, keep, choices_only))
        if is_state_lost(result.error):
            # [Note: replaying a session]: every token so far again, from position 0.
            self.replays += 1
            logger.info(
                "[device] session %s: a tier lost its state (%s); replaying %d tokens",
                self.session,
                result.error,
                position + len(tokens),
            )
            replay = self._request([*self.fed[:position], *tokens], 0, keep, choices_only)
            result = self._submit(replay)
        return self._finish(result, tokens, position)

    def _check(self, tokens: Sequence[int], position: int) -> None:
        if position > len(self.fed):
            raise StateError(f"position {position} is past the {len(self.fed)} tokens fed")
        if position + len(tokens) > self.decoder.context:
            raise StateError(
                f"{position + len(tokens)} tokens do not fit the decoder's context of "
                f"{self.decoder.context} (plan --context)"
            )

    def _finish(self, result: Result, tokens: Sequence[int], position: int) -> np.ndarray:
        """The answer of a step's result (raising its error); the session has its tokens."""
        result.unwrap()
        self.fed[position:] = list(tokens)
        return np.asarray(result.outputs[self.decoder.logits])

    def _request(
        self, tokens: Sequence[int], position: int, keep: int, choices_only: bool
    ) -> SessionRequest:
        return SessionRequest(
            self.decoder.step_feeds(list(tokens), position),
            self.session,
            position,
            keep,
            choices_only,
        )

    def _submit(self, request: SessionRequest) -> Result:
        """One step; while a tier is missing, tried again (with backoff) for ``retry_s``."""

        def alone(requests: Sequence[SessionRequest]) -> list[Ticket]:
            (step,) = requests
            return [
                self.client.submit(
                    step.inputs,
                    session=step.session,
                    position=step.position,
                    keep_last=step.keep_last,
                    choices_only=step.choices_only,
                )
            ]

        return _tries({0: self}, {0: request}, alone)[0]


def _tries(
    decoders: Mapping[int, TierDecoder],
    requests: Mapping[int, SessionRequest],
    submit: Callable[[Sequence[SessionRequest]], list[Ticket]],
) -> dict[int, Result]:
    """Each step's result, by seat: the steps sent with ``submit``, and those a missing tier
    failed sent again together, with backoff, while their decoder's ``retry_s`` lasts."""
    ends = {seat: time.monotonic() + decoders[seat].retry_s for seat in requests}
    results: dict[int, Result] = {}
    left = dict(requests)
    wait = _FIRST_RETRY_S
    while left:
        again = {}
        tickets = submit(list(left.values()))
        for (seat, request), ticket in zip(left.items(), tickets, strict=True):
            decoder, result = decoders[seat], ticket.result()
            decoder.results.append(result)
            if is_missing(result.error) and time.monotonic() + wait <= ends[seat]:
                decoder.retries += 1
                logger.info("[device] session %s: %s; trying again", decoder.session, result.error)
                again[seat] = request
            else:
                results[seat] = result
        if again:
            time.sleep(wait)
            wait = min(wait * 2, _LAST_RETRY_S)
        left = again
    return results


#: Backoff between tries of a step while a tier is missing.
_FIRST_RETRY_S = 0.1
_LAST_RETRY_S = 1.0


class LocalDecoder:
    """A decoder run on the device in one ONNX Runtime session, its KV cache kept here.

    The draft model of [Note: speculation]; :meth:`forward` as :class:`TierDecoder`'s.
    It runs as slowly as the device's own segments (``options.slowdown``, [Note: emulating
    a slower tier] in tierflow/runtime/segment_runner.py): a draft on an emulated phone
    costs what it would cost there, and ``auto`` weighs that cost.
    """

    def __init__(self, path: str | Path, options: RuntimeOptions, context: int) -> None:
        self.path = Path(path)
        session = open_session(
            self.path,
            threads=options.threads,
            optimization=options.optimization,
            providers=options.providers,
            what=f"draft model {self.path.name}",
        )
        self.decoder, self.states = decoder_of_session(
            session, context=context, where=f"draft model {self.path.name}"
        )
        self._step = session_step(session)
        self._slowdown = options.slowdown
        # What a step's compute is timed by, as SegmentRunner times a segment's.
        self._clock = time.thread_time if options.threads == 1 else time.perf_counter
        self._store = SessionStates("device")
        self._position = 0
        self.seconds = 0.0

    @property
    def vocab(self) -> int:
        return self.decoder.vocab

    @property
    def state_bytes(self) -> int:
        """Bytes of KV cache the draft holds now (its memory beside its weights)."""
        return self._store.nbytes

    def forward(self, tokens: Sequence[int], position: int) -> np.ndarray:
        start = time.perf_counter()
        state = self._store.inputs("draft", "draft", position, self.states)
        feeds = {**self.decoder.step_feeds(list(tokens), position), **state}
        computing = self._clock() if self._slowdown > 1.0 else 0.0
        outputs = self._step(feeds)
        emulate_slower(self._slowdown, computing, self._clock)
        kept = {s.input: np.asarray(outputs[s.output]) for s in self.states}
        self._store.commit("draft", "draft", position, self.states, kept)
        self.seconds += time.perf_counter() - start
        logits = np.asarray(outputs[self.decoder.logits])
        return logits.reshape(-1, logits.shape[-1])


@dataclass
class GenerationReport:
    """What one generation did (``generate --json``'s last line)."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    ttft_ms: float = 0.0
    ms_per_token: float = 0.0
    round_trips: int = 0
    drafted: int = 0
    accepted: int = 0
    judged: int = 0  # drafts the large model looked at ([Note: speculation])
    replays: int = 0
    bytes_per_token: dict[str, float] = field(default_factory=dict)
    tiers: dict[str, list[int]] = field(default_factory=dict)
    draft_only: list[int] = field(default_factory=list)  # indices made by the draft alone
    stopped: str = "max-tokens"  # or "stop-token", or "error" (then ``error`` says why)
    error: str | None = None
    draft_dropped: str | None = None  # why the draft stopped helping, if it did
    #: Where the time went ([Note: where a step's time goes]): ``prefill`` the first round
    #: trip's, ``step`` the median of those after it, in ms per part.
    parts_ms: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        extra: dict[str, Any] = {} if self.error is None else {"error": self.error}
        if self.draft_dropped is not None:
            extra["draft_dropped"] = self.draft_dropped
        return {
            "prompt": self.prompt,
            "tokens": self.tokens,
            "ttft_ms": round(self.ttft_ms, 3),
            "ms_per_token": round(self.ms_per_token, 3),
            "round_trips": self.round_trips,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else None,
            # The chance that a draft is kept once those before it were (the acceptance
            # rate of Leviathan et al.): drafts after a rejection are never looked at.
            "judged": self.judged,
            "acceptance_rate": round(self.accepted / self.judged, 4) if self.judged else None,
            "replays": self.replays,
            "bytes_per_token": {k: round(v, 1) for k, v in self.bytes_per_token.items()},
            "tiers": self.tiers,
            "draft_only": self.draft_only,
            "stopped": self.stopped,
            "parts_ms": {
                point: {k: round(v, 3) for k, v in parts.items()}
                for point, parts in self.parts_ms.items()
            },
            **extra,
        }


class Generator:
    """Generation with a decoder plan across tiers ([Note: speculation] with a draft).

    ``temperature`` 0 is greedy (token-identical to the unsplit model's greedy loop);
    above 0 tokens are sampled from a ``seed``-ed generator. ``draft``: a small decoder of
    the same vocabulary, run on the device; ``draft_tokens``: how many it proposes per
    round (None: chosen from what is measured, ``auto``). ``fallback_draft``: when the
    tiers cannot be reached, go on with the draft alone, those tokens marked.
    """

    def __init__(
        self,
        client: DeviceClient,
        *,
        draft: str | Path | None = None,
        draft_tokens: int | None = None,
        temperature: float = 0.0,
        seed: int | None = None,
        fallback_draft: bool = False,
    ) -> None:
        if temperature < 0 or not np.isfinite(temperature):
            raise InputError(f"the temperature must be 0 or more, got {temperature}")
        if draft_tokens is not None and not 1 <= draft_tokens <= 64:
            raise InputError(f"--draft-tokens must be within 1..64, got {draft_tokens}")
        self.target = TierDecoder(client, retry_s=FALLBACK_AFTER_S if fallback_draft else None)
        self.client = client
        self.temperature = temperature
        self.rng = np.random.default_rng(seed)
        self.draft_tokens = draft_tokens
        self.fallback_draft = fallback_draft
        self.draft: LocalDecoder | None = None
        if draft is not None:
            self.draft = LocalDecoder(draft, client.options, self.target.decoder.context)
            if self.draft.vocab != self.target.vocab:
                raise InputError(
                    f"the draft model {Path(draft).name} has a vocabulary of "
                    f"{self.draft.vocab} tokens, the plan's decoder {self.target.vocab}: "
                    "a draft must share the large model's vocabulary"
                )
        elif fallback_draft:
            raise InputError("--fallback draft needs a draft model (--draft SMALL.onnx)")
        self.meter = AcceptanceMeter()
        self._draft_fed: list[int] = []  # the tokens in the draft's KV cache, in order
        #: The generation under way or last done; after a failure, the tokens made before
        #: it, ``stopped`` "error" and the ``error`` (``generate --json`` prints it).
        self.report: GenerationReport | None = None
        #: Why the draft was dropped during the generation (None: it was not).
        self.draft_error: str | None = None

    def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        stop: Sequence[int] = (),
        on_token: Callable[[int, bool], None] | None = None,
    ) -> GenerationReport:
        """Prefill ``prompt`` and generate up to ``max_tokens`` tokens (a stop token ends
        it, and is kept). ``on_token(token, draft_only)`` is called as each arrives."""
        ids = [int(t) for t in prompt]
        vocab = self.target.vocab
        if not ids:
            raise InputError("the prompt is empty: a decoder needs at least one token")
        if max_tokens < 1:
            raise InputError(f"--max-tokens must be at least 1, got {max_tokens}")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InputError(f"prompt token {bad} is outside the vocabulary 0..{vocab - 1}")
        context = self.target.decoder.context
        if len(ids) + max_tokens - 1 > context:
            raise StateError(
                f"a prompt of {len(ids)} tokens and {max_tokens} new ones need a context of "
                f"{len(ids) + max_tokens - 1}; the plan was made for --context {context}"
            )
        report = GenerationReport(prompt=ids, tiers=_tiers_and_layers(self.client))
        self.report = report
        stop_set = set(stop)
        started = time.perf_counter()

        def emit(token: int, draft_only: bool = False) -> bool:
            """Add ``token``; whether generation goes on."""
            if draft_only:
                report.draft_only.append(len(report.tokens))
            report.tokens.append(token)
            if len(report.tokens) == 1:
                report.ttft_ms = (time.perf_counter() - started) * 1e3
            if on_token is not None:
                on_token(token, draft_only)
            if token in stop_set:
                report.stopped = "stop-token"
                return False
            return len(report.tokens) < max_tokens

        sequence = list(ids)  # every token so far
        try:
            going = emit(self._next(ids, 0))
            sequence.append(report.tokens[-1])
            while going:
                going = self._round(sequence, emit, max_tokens - len(report.tokens))
        except TransportError as exc:
            if not (self.fallback_draft and self.draft is not None):
                self._failed(report, exc, started)
                raise
            logger.warning("[device] %s; going on with the draft model alone", exc)
            report.stopped = "max-tokens"
            try:
                self._draft_alone(sequence, report, emit, max_tokens)
            except TierflowError as failure:
                self._failed(report, failure, started)
                raise
        except TierflowError as exc:
            self._failed(report, exc, started)
            raise
        elapsed = (time.perf_counter() - started) * 1e3
        self._fill(report, elapsed)
        return report

    def _failed(self, report: GenerationReport, error: Exception, started: float) -> None:
        """Keep what a failed generation made, and why it stopped, in ``report``."""
        report.stopped, report.error = "error", str(error)
        self._fill(report, (time.perf_counter() - started) * 1e3)

    def _round(self, sequence: list[int], emit: Callable[[int], bool], room: int) -> bool:
        """One round trip of the large model: a plain step, or a speculated one."""
        target = self.target
        position = len(sequence) - 1  # the last token is not fed yet
        pending = sequence[-1]
        if self.draft is None:
            token = self._next([pending], position)
            sequence.append(token)
            return emit(token)
        draft = self.draft
        k = max(1, min(self.meter.choose(self.draft_tokens), room))
        draft_start = draft.seconds
        drafts: list[int] = []
        draft_logits: list[np.ndarray] = []
        try:
            scores = self._draft_next(sequence)
            for i in range(k):
                token = sample(scores, self.temperature, self.rng)
                drafts.append(token)
                draft_logits.append(scores)
                if i + 1 < k:
                    scores = self._draft_next([*sequence, *drafts])
        except ModelError as exc:
            # The draft is a helper: one that cannot go on (a draft with fewer positions
            # than this generation needs fails past its last) leaves the large model to
            # go on alone, as without --draft, instead of ending the generation.
            logger.warning(
                "[device] the draft model failed at position %d (%s); going on without it",
                len(sequence) - 1,
                exc,
            )
            self.draft, self.draft_error = None, f"at position {len(sequence) - 1}: {exc}"
            return self._round(sequence, emit, room)
        draft_s = draft.seconds - draft_start
        trip = time.perf_counter()
        if self.temperature <= 0:
            verdict = verify_greedy(target.choose([pending, *drafts], position), drafts)
        else:
            logits = target.forward([pending, *drafts], position)
            verdict = verify_sampled(
                logits, np.stack(draft_logits), drafts, self.temperature, self.rng
            )
        trip_s = time.perf_counter() - trip
        self.meter.observe(len(drafts), verdict.kept, trip_s, draft_s)
        for token in [*drafts[: verdict.kept], verdict.token]:
            sequence.append(token)
            if not emit(token):
                return False
        return True

    def _next(self, tokens: Sequence[int], position: int) -> int:
        """The large model's token after ``tokens`` fed from ``position``: greedy asks the
        tiers for their choice alone, sampling for the logits."""
        if self.temperature <= 0:
            return int(self.target.choose(tokens, position, keep=1)[-1])
        logits = self.target.forward(tokens, position, keep=1)
        return sample(logits[-1], self.temperature, self.rng)

    def _draft_next(self, sequence: list[int]) -> np.ndarray:
        """The draft's logits for the token after ``sequence``, fed what it lacks of it.

        Its KV cache keeps the longest prefix of ``sequence`` it has fed; what it fed
        beyond that (rejected drafts) is cut back, as on the tiers.
        """
        assert self.draft is not None
        fed = self._draft_fed
        kept = 0
        while kept < min(len(fed), len(sequence) - 1) and fed[kept] == sequence[kept]:
            kept += 1
        news = sequence[kept:]
        scores = self.draft.forward(news, kept)[-1]
        self._draft_fed = list(sequence)
        return scores

    def _draft_alone(
        self,
        sequence: list[int],
        report: GenerationReport,
        emit: Callable[[int, bool], bool],
        max_tokens: int,
    ) -> None:
        """Go on with the draft model only (``--fallback draft``): every token marked."""
        while len(report.tokens) < max_tokens:
            token = sample(self._draft_next(sequence), self.temperature, self.rng)
            sequence.append(token)
            if not emit(token, True):
                return

    def _fill(self, report: GenerationReport, elapsed_ms: float) -> None:
        """The figures of ``report`` from the requests the generation made."""
        results = self.target.results
        report.round_trips = len(results)
        report.replays = self.target.replays
        report.drafted = self.meter.drafted
        report.accepted = self.meter.accepted
        report.judged = self.meter.judged
        report.draft_dropped = self.draft_error
        count = max(len(report.tokens), 1)  # [Note: bytes per token] in partitioner/decoder_cost.py
        report.bytes_per_token = {
            link: sum(r.bytes.get(link, 0) for r in results) / count for link in LINKS
        }
        if len(report.tokens) > 1:
            report.ms_per_token = (elapsed_ms - report.ttft_ms) / (len(report.tokens) - 1)
        answered = [r for r in results if r.ok and r.ms]
        if answered:
            report.parts_ms["prefill"] = _parts(answered[:1])
        if len(answered) > 1:
            report.parts_ms["step"] = _parts(answered[1:])


#: The parts of a round trip's time that ``generate --json`` reports.
PARTS = (*TIERS, "queue", "network")


def _parts(results: Sequence[Result]) -> dict[str, float]:
    """The median of each part of these round trips' time, in ms.

    [Note: where a step's time goes]
    A round trip's time is each tier's compute and codec time (as that tier timed it,
    emulated slowdown included), the waiting in queues, and the rest: transfers,
    propagation, gRPC and the way back (``network``, [Note: honest link figures]). Set
    beside ``plan``'s estimate (``plan.json``'s ``estimate.decoder``: each tier's
    ``compute_s`` at the prefill and decode points), it says whether a gap is the compute
    (a machine busier, or slower, than when it was profiled) or the links.
    """
    return {part: float(np.median([r.ms.get(part, 0.0) for r in results])) for part in PARTS}


def _tiers_and_layers(client: DeviceClient) -> dict[str, list[int]]:
    """Which tier holds which layers' KV cache (the decoder's blocks), by tier."""
    layers: dict[str, list[int]] = {}
    for spec in client.plan.segments:
        for state in spec.state:
            found = _LAYER.search(state.input)
            if found is not None:
                layers.setdefault(spec.tier, []).append(int(found.group()))
    return {tier: sorted(set(found)) for tier, found in layers.items()}


def layer_ranges(tiers: dict[str, list[int]]) -> str:
    """``device 0-1, edge 2-3, cloud 4-7``: the blocks each tier runs, for people."""
    parts = []
    for tier, found in tiers.items():
        groups = []
        for _, run in itertools.groupby(enumerate(found), lambda pair: pair[1] - pair[0]):
            values = [v for _, v in run]
            groups.append(str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}")
        parts.append(f"{tier} {','.join(groups)}")
    return ", ".join(parts)


__all__ = [
    "GenerationReport",
    "Generator",
    "LocalDecoder",
    "StateSpec",
    "TierDecoder",
    "layer_ranges",
]
