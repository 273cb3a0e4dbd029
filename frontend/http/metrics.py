"""Where the frontend's timings and counts are observed. A no-op until something installs an
observer; a served frontend installs PrometheusObserver."""

from __future__ import annotations

from gapless.common.metrics import BatchedHistogram, FrontendMetrics


class RequestObserver:
    """Called by the handlers and the router; every duration is in seconds."""

    def arrived(self, endpoint: str, prompt_tokens: int) -> None:
        pass

    def tokenized(self, seconds: float) -> None:
        pass

    def admission_decided(self, seconds: float) -> None:
        """Body received to the admission decision: before tokenizing, or after it with a
        token cap."""

    def first_token(self, endpoint: str, ttft_s: float) -> None:
        pass

    def delta(self, gap_s: float, num_tokens: int) -> None:
        """A later delta of one choice: time since that choice's previous delta."""

    def streamed(self, seconds: float) -> None:
        """One delta's SSE event written, `seconds` after its TextDeltas reached the frontend."""

    def finished(
        self, endpoint: str, e2e_s: float, output_tokens: int, finish_reason: str | None
    ) -> None:
        pass

    def aborted(self, endpoint: str) -> None:
        pass

    def rejected(self, reason: str) -> None:
        pass

    def slow_client(self, reason: str) -> None:
        """A stream aborted because its client stopped reading: "buffer" or "write_timeout"."""

    def connection_closed(self, reason: str) -> None:
        """The server closed or refused a connection (common.metrics.CONNECTION_CLOSES)."""

    def connections(self, delta: int) -> None:
        """A connection opened (+1) or closed (-1)."""


class PrometheusObserver(RequestObserver):
    def __init__(self, series: FrontendMetrics | None = None) -> None:
        self.series = series or FrontendMetrics()
        # observed once per delta of every stream: batched, and flushed as each request ends
        self._itl = BatchedHistogram(self.series.itl)
        self._stream = BatchedHistogram(self.series.stream)

    def tokenized(self, seconds: float) -> None:
        self.series.tokenize.observe(seconds)

    def admission_decided(self, seconds: float) -> None:
        self.series.admission.observe(seconds)

    def first_token(self, endpoint: str, ttft_s: float) -> None:
        self.series.ttft.observe(ttft_s)

    def delta(self, gap_s: float, num_tokens: int) -> None:
        if num_tokens:
            self._itl.observe(gap_s / num_tokens)

    def streamed(self, seconds: float) -> None:
        self._stream.observe(seconds)

    def finished(
        self, endpoint: str, e2e_s: float, output_tokens: int, finish_reason: str | None
    ) -> None:
        if finish_reason is not None:
            self.series.e2e.observe(e2e_s)
        self._itl.flush()
        self._stream.flush()

    def aborted(self, endpoint: str) -> None:
        self.series.aborted.inc()

    def rejected(self, reason: str) -> None:
        self.series.rejected.labels(reason).inc()

    def slow_client(self, reason: str) -> None:
        self.series.slow_clients.labels(reason).inc()

    def connection_closed(self, reason: str) -> None:
        self.series.connections_closed.labels(reason).inc()

    def connections(self, delta: int) -> None:
        self.series.connections.inc(delta)


observer = RequestObserver()


def set_observer(new: RequestObserver) -> None:
    global observer
    observer = new
