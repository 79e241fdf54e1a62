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
  ``mmspec_prefix_cache_bytes`` / ``mmspec_prefix_cache_budget_bytes``.
"""

from __future__ import annotations

import time

OUTCOME_BY_STATUS = {401: "unauthorized", 413: "too_large", 415: "unsupported_media_type", 499: "cancelled"}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def outcome_of(status: int) -> str:
    if status in OUTCOME_BY_STATUS:
        return OUTCOME_BY_STATUS[status]
    return "bad_request" if status < 500 else "failed"


class Metrics:
    """The counters of one server; ``worker`` and ``decoder`` are read at scrape time."""

    def __init__(self, service):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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

    def answered(self, finish_reason: str, prompt_tokens: int, n_tokens: int, t0: float, t_first: float | None,
                 result=None) -> None:
        """One choice answered: its tokens, latencies (perf_counter times) and its blocks' stats."""
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


class MeteredScheduler:
    """A scheduler whose steps report their batch size to ``metrics`` (everything else passed on)."""

    def __init__(self, scheduler, metrics: Metrics):
        self._scheduler, self._metrics = scheduler, metrics

    def step(self):
        events = self._scheduler.step()
        self._metrics.step(len({e.rid for e in events}))
        return events

    def __getattr__(self, name):
        return getattr(self._scheduler, name)
