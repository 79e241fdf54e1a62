"""``GET /metrics``: the server's counters in Prometheus' text format (``prometheus-client``).

Owns :class:`Metrics` (one registry per server, no global state) and what it counts:

* ``mmspec_requests_total{outcome}``: chat/completion requests by how they ended: ``stop`` /
  ``length`` (answered), ``bad_request`` (4xx: refused, before or after admission),
  ``unauthorized``, ``too_large``, ``unsupported_media_type``, ``failed`` (5xx, 503 at shutdown),
  ``cancelled`` (the client went away);
* ``mmspec_prompt_tokens_total``, ``mmspec_generation_tokens_total``;
* ``mmspec_time_to_first_token_seconds``, ``mmspec_time_per_output_token_seconds`` (after the
  first), ``mmspec_e2e_request_latency_seconds``: histograms, from the request's arrival;
* ``mmspec_requests_running`` (admitted: decoding or waiting for a row), ``mmspec_requests_waiting``
  (queued for the worker): gauges read at scrape time;
* ``mmspec_batch_size``: a histogram of the requests in each scheduler step;
* speculation, over the blocks of finished requests: ``mmspec_spec_blocks_total{drafted}``
  (drafting on/off: a block that drafted, or a plain target step), ``mmspec_spec_block_tokens_total``
  (tokens those blocks emitted: tau = tokens / blocks, counting the bonus/recovered token),
  ``mmspec_spec_draft_proposed_total{position}`` / ``..._accepted_total{position}`` (acceptance
  at draft depth ``position`` = accepted / proposed);
* ``mmspec_prefix_cache_hit_tokens_total`` (prompt tokens not prefilled again) and the gauges
  ``mmspec_prefix_cache_bytes`` / ``mmspec_prefix_cache_budget_bytes``;
* where an answered request's time went, ``mmspec_request_phase_seconds{phase}`` (:data:`PHASES`;
  they add up to its e2e latency), ``mmspec_http_request_seconds`` (its arrival in the app to its
  response's last byte sent: the phases, the response's JSON and its sending), and how much of the
  server's CPU is the engine's:
  ``mmspec_engine_seconds_total`` / ``mmspec_engine_cpu_seconds_total`` (the worker thread inside
  the scheduler: admission, prefill, steps) beside prometheus-client's ``process_cpu_seconds_total``.
"""

from __future__ import annotations

import time

OUTCOME_BY_STATUS = {401: "unauthorized", 413: "too_large", 415: "unsupported_media_type", 499: "cancelled"}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
# a request's arrival to its last token, in turn (the event loop: parse; a pool thread: images, processor;
# the worker thread: queue, prefill, decode, engine_other; handoff: the rest, between the threads)
PHASES = {
    "parse": "the body read, its JSON and checks",
    "images": "decoding the image data",
    "processor": "the prompt framed, the processor, the inputs to the device",
    "queue": "handed to the worker thread until it takes it, between two steps",
    "prefill": "vision encoding and the target's and draft's prefill",
    "decode": "the blocks it was in (the shared steps' draft and verify phases)",
    "engine_other": "in the scheduler but not its own prefill or blocks: waiting for admission, other requests' "
                    "prefills, the scheduler's own work",
    "handoff": "the rest: between the threads (the pool's, the worker's, the event loop's)",
}


def outcome_of(status: int) -> str:
    if status in OUTCOME_BY_STATUS:
        return OUTCOME_BY_STATUS[status]
    return "bad_request" if status < 500 else "failed"


class Metrics:
    """The counters of one server; ``worker`` and ``decoder`` are read at scrape time."""

    def __init__(self, service):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("mmspec_requests", "Requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("mmspec_prompt_tokens", "Prompt tokens (images expanded)", registry=r)
        self.generation_tokens = Counter("mmspec_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("mmspec_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.tpot = Histogram("mmspec_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("mmspec_e2e_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.batch = Histogram("mmspec_batch_size", "Requests in a scheduler step", buckets=BATCH_BUCKETS, registry=r)
        self.blocks = Counter("mmspec_spec_blocks", "Blocks of finished requests, drafted or plain", ["drafted"],
                              registry=r)
        self.block_tokens = Counter("mmspec_spec_block_tokens", "Tokens emitted by those blocks (tau = this / blocks)",
                                    registry=r)
        self.proposed = Counter("mmspec_spec_draft_proposed", "Blocks that drafted as deep as the position",
                                ["position"], registry=r)
        self.accepted = Counter("mmspec_spec_draft_accepted", "Blocks whose draft at the position was accepted",
                                ["position"], registry=r)
        self.phase = Histogram("mmspec_request_phase_seconds", "Where an answered request's time went, by phase: "
                               f"{', '.join(PHASES)} (they add up to its e2e latency)", ["phase"],
                               buckets=LATENCY_BUCKETS, registry=r)
        self.http = Histogram("mmspec_http_request_seconds", "Answered completions: the request's arrival in the "
                              "app to its response's last byte sent", buckets=LATENCY_BUCKETS, registry=r)
        self.engine_s = Counter("mmspec_engine_seconds", "Wall seconds the worker thread spent in the scheduler",
                                registry=r)
        self.engine_cpu_s = Counter("mmspec_engine_cpu_seconds", "CPU seconds of the worker thread in the scheduler",
                                    registry=r)
        ProcessCollector(registry=r)  # process_cpu_seconds_total and the like: the engine's share of the CPU
        self.cache_hits = Counter("mmspec_prefix_cache_hit_tokens", "Prompt tokens reused from the prefix cache",
                                  registry=r)
        Gauge("mmspec_requests_running", "Requests admitted (decoding or waiting for a row)",
              registry=r).set_function(lambda: service.worker.active)  # (the worker is made after this)
        Gauge("mmspec_requests_waiting", "Requests queued for the worker", registry=r).set_function(
            lambda: service.worker.pending)
        cache = getattr(service.decoder, "prefix_cache", None)
        Gauge("mmspec_prefix_cache_bytes", "Bytes the prefix cache holds", registry=r).set_function(
            lambda: cache.nbytes if cache is not None else 0)
        Gauge("mmspec_prefix_cache_budget_bytes", "The prefix cache's budget", registry=r).set_function(
            lambda: getattr(cache, "budget", 0) if cache is not None else 0)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # ------------------------------------------------------------------ events
    def refused(self, status: int) -> None:
        self.requests.labels(outcome_of(status)).inc()

    def step(self, batch_size: int) -> None:
        if batch_size:
            self.batch.observe(batch_size)

    def responded(self, path: str, status: int | None, seconds: float) -> None:
        """A response's last byte was sent ``seconds`` after its request arrived in the app."""
        if status == 200 and path in COMPLETION_PATHS:
            self.http.observe(seconds)

    def engine(self, wall_s: float, cpu_s: float) -> None:
        """The worker thread spent ``wall_s`` (``cpu_s`` of its CPU) in a scheduler call."""
        self.engine_s.inc(wall_s)
        self.engine_cpu_s.inc(cpu_s)

    def answered(self, finish_reason: str, prompt_tokens: int, n_tokens: int, t0: float, t_first: float | None,
                 result=None, timings: dict | None = None) -> None:
        """One choice answered: its tokens, latencies (perf_counter times) and its blocks' stats;
        ``timings`` (the request's parse, images and processor seconds; given for one choice per
        request): its time split into :data:`PHASES`."""
        now = time.perf_counter()
        self.requests.labels(finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(n_tokens)
        self.e2e.observe(now - t0)
        if t_first is not None:
            self.ttft.observe(t_first - t0)
            if n_tokens > 1:
                self.tpot.observe((now - t_first) / (n_tokens - 1))
        st = getattr(result, "stats", None)
        if timings is not None:
            self._phases(now - t0, timings, st)
        if st is None:
            return
        self.cache_hits.inc(getattr(st, "prompt_tokens_reused", 0) or 0)
        drafted = sum(1 for b in st.blocks if b.n_drafted)  # summed first: one labelled update per position
        proposed: dict[int, int] = {}
        accepted: dict[int, int] = {}
        for b in st.blocks:
            for i in range(1, b.drafted_depth + 1):
                proposed[i] = proposed.get(i, 0) + 1
            for i in range(1, min(b.n_accepted, b.drafted_depth) + 1):
                accepted[i] = accepted.get(i, 0) + 1
        self.blocks.labels("true").inc(drafted)
        self.blocks.labels("false").inc(len(st.blocks) - drafted)
        self.block_tokens.inc(sum(b.n_emitted for b in st.blocks))
        for i, n in proposed.items():
            self.proposed.labels(str(i)).inc(n)
        for i, n in accepted.items():
            self.accepted.labels(str(i)).inc(n)

    def _phases(self, e2e: float, timings: dict, st) -> None:
        """A request's ``e2e`` seconds by phase. Without stats (an answer cut at a stop string: the
        scheduler never finished it) only the phases before the scheduler are known."""
        spent = {k: timings.get(k, 0.0) for k in ("parse", "images", "processor", "queue")}
        if st is not None:
            spent["prefill"] = st.vision_s + st.caption_s + st.substitute_s + st.prefill_s
            spent["decode"] = st.draft_s + st.verify_s
            spent["engine_other"] = max(0.0, st.total_s - spent["prefill"] - spent["decode"])
            spent["handoff"] = max(0.0, e2e - sum(spent.values()))
        for phase, seconds in spent.items():
            self.phase.labels(phase).observe(seconds)


class MeteredScheduler:
    """A scheduler whose steps report their batch size to ``metrics``, and whose calls on the
    worker thread (submit, step) their wall and CPU seconds (everything else passed on)."""

    def __init__(self, scheduler, metrics: Metrics):
        self._scheduler, self._metrics = scheduler, metrics

    def submit(self, request, **defaults):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self._scheduler.submit(request, **defaults)
        finally:
            self._metrics.engine(time.perf_counter() - t0, time.thread_time() - c0)

    def step(self):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            events = self._scheduler.step()
        finally:
            self._metrics.engine(time.perf_counter() - t0, time.thread_time() - c0)
        self._metrics.step(len({e.rid for e in events}))
        return events

    def __getattr__(self, name):
        return getattr(self._scheduler, name)
